"""Qwen3-VL image preprocessing with PIL and numpy, giving the same pixels as transformers' PIL image processor.

An image is made RGB (transparency composited onto white), resized with PIL's bicubic filter so both sides are
multiples of `patch_size * merge_size` and its area lies within [min_pixels, max_pixels], scaled to [0, 1],
normalized with the mean and std, and cut into patches listed in merge-window order. A still image is one temporal
patch: its frame repeated `temporal_patch_size` times.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps

MAX_ASPECT_RATIO = 200  # longer side / shorter side; the vision encoder refuses anything more elongated
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


class ImageError(ValueError):
    """An image that cannot be loaded: undecodable, badly encoded, too large to decode, or from an unsupported URL."""


@dataclass(frozen=True)
class ImageProcessorConfig:
    """How images are preprocessed; the defaults are Qwen3-VL's. Validated on construction (ValueError naming the
    field); `image_mean` and `image_std` become tuples of floats."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65_536  # 256 x 256: 64 image tokens
    max_pixels: int = 16_777_216  # 4096 x 4096: 16384 image tokens
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels"):
            _check_int(name, getattr(self, name), lo=1)
        _check_int("max_pixels", self.max_pixels, lo=self.min_pixels)
        if self.max_pixels < self.factor**2:
            raise ValueError(
                f"max_pixels: must be >= (patch_size * merge_size)**2 = {self.factor**2}, the area of one image "
                f"token, got {self.max_pixels}"
            )
        object.__setattr__(self, "image_mean", _check_channels("image_mean", self.image_mean, nonzero=False))
        object.__setattr__(self, "image_std", _check_channels("image_std", self.image_std, nonzero=True))

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one image token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, path: str | Path) -> ImageProcessorConfig:
        """The settings in `preprocessor_config.json` of a Hugging Face model directory; the defaults for what it
        (or the whole file) leaves out. As in transformers, top-level `min_pixels` / `max_pixels` take precedence
        over `size.shortest_edge` / `size.longest_edge`."""
        file = Path(path) / "preprocessor_config.json"
        if not file.is_file():
            return cls()
        try:
            raw = json.loads(file.read_text())
            size = raw.get("size") or {}
            if not isinstance(size, dict):
                raise ValueError(f"size: must be an object, got {size!r}")
            keys = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std")
            fields = {key: raw[key] for key in keys if raw.get(key) is not None}
            for name, size_key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
                value = raw.get(name)
                value = size.get(size_key) if value is None else value
                if value is not None:
                    fields[name] = value
            return cls(**fields)
        except ValueError as e:  # bad JSON or a bad value
            raise ValueError(f"{file}: {e}") from e

    def with_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> ImageProcessorConfig:
        """This config with a new pixel budget; None keeps the current bound. Validated like the constructor."""
        return replace(
            self,
            min_pixels=self.min_pixels if min_pixels is None else min_pixels,
            max_pixels=self.max_pixels if max_pixels is None else max_pixels,
        )


@dataclass
class ProcessedImage:
    """One image ready for the vision encoder."""

    pixel_values: torch.Tensor  # (t * gh * gw, 3 * temporal_patch_size * patch_size**2) float32, merge-window order
    grid_thw: tuple[int, int, int]  # (t, gh, gw) in patches
    merge_size: int
    content_hash: str  # sha256 hex of the RGB image's size and pixels (before resizing)

    @property
    def num_tokens(self) -> int:
        """Image tokens in the prompt: one per merge_size x merge_size window of patches."""
        t, gh, gw = self.grid_thw
        return t * gh * gw // self.merge_size**2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to: multiples of `factor`, with the aspect ratio kept as nearly as
    that allows and the area brought within [min_pixels, max_pixels] (transformers' rounding, exactly: each side to
    the nearest multiple, ties to even; if the area is then too large, both sides scaled down and floored, to no
    less than `factor`; if too small, scaled up and ceiled). Raises ValueError for an aspect ratio over 200."""
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio must be at most {MAX_ASPECT_RATIO}, got {ratio:g} ({width}x{height})")
    new_height = round(height / factor) * factor
    new_width = round(width / factor) * factor
    if new_height * new_width > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / scale / factor) * factor)
        new_width = max(factor, math.floor(width / scale / factor) * factor)
    elif new_height * new_width < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * scale / factor) * factor
        new_width = math.ceil(width * scale / factor) * factor
    return new_height, new_width


def load_image(source: bytes | str | Path | Image.Image) -> Image.Image:
    """An RGB image, turned upright by its EXIF orientation, with any transparency composited onto white.

    `source` is encoded image bytes, a base64 `data:` URL, a file path, or a PIL image. Remote URLs are not fetched
    here. Raises ImageError if the image cannot be read or decoded, or is a decompression bomb.
    """
    data = None if isinstance(source, Image.Image) else _read_bytes(source)
    try:
        image = source if data is None else Image.open(io.BytesIO(data))
        return _to_rgb(ImageOps.exif_transpose(image))
    except Image.DecompressionBombError as e:
        raise ImageError(f"image refused as a possible decompression bomb: {e}") from e
    except Exception as e:  # PIL reports corrupt data as OSError, ValueError, SyntaxError, EOFError, ...
        raise ImageError(f"cannot decode image: {e}") from e


def process_image(image: Image.Image, config: ImageProcessorConfig) -> ProcessedImage:
    """Resizes, normalizes and patches one image (any PIL mode) for the vision encoder."""
    rgb = _to_rgb(image)
    width, height = rgb.size
    digest = hashlib.sha256(f"{width}x{height}:".encode())
    digest.update(rgb.tobytes())

    new_height, new_width = smart_resize(height, width, config.factor, config.min_pixels, config.max_pixels)
    frame = np.asarray(rgb.resize((new_width, new_height), Image.Resampling.BICUBIC))  # (H, W, 3) uint8
    p, m, t = config.patch_size, config.merge_size, config.temporal_patch_size
    gh, gw = new_height // p, new_width // p
    # A uint8 view (gh/m, gw/m, m, m, 3, p, p): each m x m window of patches contiguous, each patch channels-first.
    windows = frame.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    levels = _level_table(config.image_mean, config.image_std)
    values = np.empty((*windows.shape[:5], t, p, p), dtype=np.float32)  # a temporal axis after the channels
    for channel in range(3):  # each level's normalized value, the one frame repeated over the t frames
        values[:, :, :, :, channel] = levels[channel][windows[:, :, :, :, channel]][:, :, :, :, None]
    return ProcessedImage(
        pixel_values=torch.from_numpy(values.reshape(gh * gw, 3 * t * p * p)),
        grid_thw=(1, gh, gw),
        merge_size=m,
        content_hash=digest.hexdigest(),
    )


def _level_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """(3, 256) float32: each channel's value for each uint8 level, computed in transformers' order and precision
    (times 1/255 in float64, cast to float32, then (x - mean) / std in float32), so lookups equal its output."""
    levels = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    return (levels - np.asarray(mean, dtype=np.float32)[:, None]) / np.asarray(std, dtype=np.float32)[:, None]


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB; an image with an alpha band or a transparent colour is composited onto white first."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _read_bytes(source: bytes | str | Path) -> bytes:
    """The encoded image in `source`: the bytes themselves, a data URL's payload, or a file's contents."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if isinstance(source, str):
        if source[:5].lower() == "data:":
            return _decode_data_url(source)
        if scheme := _URL_SCHEME.match(source):
            raise ImageError(
                f"unsupported image URL scheme {scheme.group()!r}: only data: URLs and file paths are loaded here"
            )
        source = Path(source)
    if isinstance(source, Path):
        try:
            return source.read_bytes()
        except OSError as e:
            raise ImageError(f"cannot read image file {str(source)!r}: {e.strerror}") from e
    raise TypeError(f"image source must be bytes, str, Path or PIL.Image.Image, got {type(source).__name__}")


def _decode_data_url(url: str) -> bytes:
    """The payload of `data:[<media type>][;<param>]*;base64,<data>`; whitespace in the data is ignored."""
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise ImageError("malformed data URL: no ',' before the data")
    if "base64" not in (param.strip().lower() for param in header.split(";")[1:]):
        raise ImageError("data URL must be base64-encoded: data:image/<type>;base64,<data>")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"invalid base64 in data URL: {e}") from e


def _check_int(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}: must be an int >= {lo}, got {value!r}")


def _check_channels(name: str, value: object, nonzero: bool) -> tuple[float, float, float]:
    """`value` as 3 floats, one per RGB channel; ValueError naming `name` if it is not 3 finite numbers."""
    numbers = list(value) if isinstance(value, (tuple, list)) else []
    valid = len(numbers) == 3 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and not (nonzero and v == 0)
        for v in numbers
    )
    if not valid:
        what = "3 finite non-zero numbers" if nonzero else "3 finite numbers"
        raise ValueError(f"{name}: must be {what} (one per RGB channel), got {value!r}")
    return (float(numbers[0]), float(numbers[1]), float(numbers[2]))

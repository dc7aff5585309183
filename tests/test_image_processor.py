"""The Qwen3-VL image preprocessing against transformers' PIL image processor, and image loading."""

import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from slotserve.multimodal.image_processor import (
    ImageError,
    ImageProcessorConfig,
    ProcessedImage,
    load_image,
    process_image,
    smart_resize,
)

qwen2_vl_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

# Qwen/Qwen3-VL-2B-Instruct's preprocessor_config.json.
QWEN3_VL_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
SMALL = ImageProcessorConfig(min_pixels=32 * 32, max_pixels=128 * 128)


def reference(image: Image.Image, config: ImageProcessorConfig) -> tuple[np.ndarray, np.ndarray]:
    """transformers' (pixel_values, image_grid_thw) for one image, with the processor configured as `config`."""
    processor = qwen2_vl_pil.Qwen2VLImageProcessorPil(
        patch_size=config.patch_size,
        temporal_patch_size=config.temporal_patch_size,
        merge_size=config.merge_size,
        image_mean=list(config.image_mean),
        image_std=list(config.image_std),
        size={"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
    )
    out = processor(images=[image], return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def noise(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Random pixels (and, for a mode with alpha, random opacity)."""
    rgba = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 4), dtype=np.uint8))
    return rgba.convert(mode) if "A" in mode else rgba.convert("RGB").convert(mode)


def png_bytes(image: Image.Image, **save_args) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG", **save_args)
    return buf.getvalue()


def assert_matches_transformers(image: Image.Image, config: ImageProcessorConfig) -> ProcessedImage:
    ours = process_image(image, config)
    pixel_values, grid_thw = reference(image, config)
    assert ours.pixel_values.dtype == torch.float32
    assert ours.pixel_values.shape == pixel_values.shape
    np.testing.assert_array_equal(ours.pixel_values.numpy(), pixel_values)
    assert grid_thw.tolist() == [list(ours.grid_thw)]
    return ours


# --- configuration -------------------------------------------------------------------------------------------------


def test_defaults_are_qwen3_vl(tmp_path):
    c = ImageProcessorConfig()
    assert (c.patch_size, c.temporal_patch_size, c.merge_size, c.factor) == (16, 2, 2, 32)
    assert (c.min_pixels, c.max_pixels) == (65536, 16777216)
    assert c.image_mean == c.image_std == (0.5, 0.5, 0.5)
    assert ImageProcessorConfig.from_dir(tmp_path) == c  # no preprocessor_config.json
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PREPROCESSOR))
    assert ImageProcessorConfig.from_dir(tmp_path) == c


def test_from_dir_reads_the_file(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "size": {"shortest_edge": 3136, "longest_edge": 12845056},
        "min_pixels": 4096,  # top-level keys win over size, as in transformers
        "max_pixels": None,
    }))
    c = ImageProcessorConfig.from_dir(str(tmp_path))
    assert (c.patch_size, c.factor, c.min_pixels, c.max_pixels) == (14, 28, 4096, 12845056)
    assert c.image_mean == (0.48145466, 0.4578275, 0.40821073)


def test_from_dir_rejects_bad_values_naming_the_file_and_field(tmp_path):
    file = tmp_path / "preprocessor_config.json"
    file.write_text(json.dumps({"merge_size": 0}))
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: merge_size"):
        ImageProcessorConfig.from_dir(tmp_path)
    file.write_text("{not json")
    with pytest.raises(ValueError, match=r"preprocessor_config\.json"):
        ImageProcessorConfig.from_dir(tmp_path)


def test_with_pixels_overrides_and_validates():
    c = ImageProcessorConfig().with_pixels(max_pixels=1024 * 1024)
    assert (c.min_pixels, c.max_pixels) == (65536, 1024 * 1024)
    assert c.with_pixels(min_pixels=1024) == ImageProcessorConfig(min_pixels=1024, max_pixels=1024 * 1024)
    with pytest.raises(ValueError, match="min_pixels"):
        c.with_pixels(min_pixels=0)
    with pytest.raises(ValueError, match="max_pixels"):
        c.with_pixels(max_pixels=65535)  # below min_pixels
    with pytest.raises(ValueError, match="max_pixels"):
        c.with_pixels(min_pixels=1, max_pixels=1023)  # less than one image token
    with pytest.raises(ValueError, match="max_pixels"):
        c.with_pixels(max_pixels=2.5e6)
    with pytest.raises(ValueError, match="image_std"):
        ImageProcessorConfig(image_std=(0.5, 0.0, 0.5))
    with pytest.raises(ValueError, match="image_mean"):
        ImageProcessorConfig(image_mean=(0.5, 0.5))


# --- smart_resize --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("factor", "min_pixels", "max_pixels"), [
    (32, 65536, 16777216), (32, 1024, 128 * 128), (32, 4096, 1310720), (28, 3136, 12845056),
])
def test_smart_resize_matches_transformers(factor, min_pixels, max_pixels):
    sides = [1, 2, 3, 15, 16, 17, 31, 32, 33, 47, 48, 49, 80, 100, 111, 224, 255, 256, 257, 479, 640, 1000, 1001,
             2047, 4096, 4097, 5000, 9999]
    rng = np.random.default_rng(factor + min_pixels)
    sizes = [(h, w) for h in sides for w in sides] + [tuple(rng.integers(1, 8000, 2).tolist()) for _ in range(500)]
    for height, width in sizes:
        try:
            expected = qwen2_vl_pil.smart_resize(height, width, factor, min_pixels, max_pixels)
        except ValueError:  # aspect ratio over 200
            with pytest.raises(ValueError, match="aspect ratio"):
                smart_resize(height, width, factor, min_pixels, max_pixels)
        else:
            assert smart_resize(height, width, factor, min_pixels, max_pixels) == expected, (height, width)


def test_smart_resize_rounds_halves_to_even():
    # 48 / 32 = 1.5 and 80 / 32 = 2.5 both round to 2 (Python's round), as in transformers.
    assert smart_resize(48, 80, 32, 1, 10**9) == (64, 64)


def test_aspect_ratio_over_200_is_refused():
    assert smart_resize(1, 200, 32, 65536, 16777216) == qwen2_vl_pil.smart_resize(1, 200, 32, 65536, 16777216)
    for height, width in [(1, 201), (3001, 15), (2, 1000)]:
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(height, width, 32, 65536, 16777216)
    with pytest.raises(ValueError, match="aspect ratio"):
        process_image(noise(402, 2), ImageProcessorConfig())
    with pytest.raises(ValueError, match="positive"):
        smart_resize(0, 10, 32, 65536, 16777216)


# --- process_image against transformers ----------------------------------------------------------------------------


@pytest.mark.parametrize(("width", "height"), [
    (53, 37),  # odd sizes, upscaled to min_pixels
    (37, 53),
    (300, 2),  # aspect 150
    (3000, 20),  # extreme aspect ratios
    (20, 3000),
    (1, 1),  # tiny
    (5, 7),
    (256, 256),  # exactly min_pixels: no resampling needed
    (641, 479),  # rounded to the nearest multiple of 32
])
def test_matches_transformers_with_qwen3_vl_defaults(width, height):
    ours = assert_matches_transformers(noise(width, height, seed=width * height), ImageProcessorConfig())
    t, gh, gw = ours.grid_thw
    assert t == 1 and gh % 2 == 0 and gw % 2 == 0
    assert ours.pixel_values.shape == (t * gh * gw, 3 * 2 * 16 * 16)
    assert ours.num_tokens == t * gh * gw // 4
    assert gh * gw * 16 * 16 >= 65536


@pytest.mark.parametrize(("width", "height"), [(1200, 900), (333, 1001), (64, 40), (3, 3), (1000, 8)])
def test_matches_transformers_with_a_small_pixel_budget(width, height):
    ours = assert_matches_transformers(noise(width, height, seed=width + height), SMALL)
    t, gh, gw = ours.grid_thw
    assert 32 * 32 <= t * gh * gw * 16 * 16 <= 128 * 128


def test_matches_transformers_with_per_channel_mean_and_std():
    qwen2_vl = ImageProcessorConfig(
        patch_size=14, min_pixels=56 * 56, max_pixels=256 * 28 * 28,
        image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711),
    )
    assert_matches_transformers(noise(500, 333, seed=4), qwen2_vl)


def test_large_image_is_downscaled_to_max_pixels():
    config = ImageProcessorConfig().with_pixels(max_pixels=512 * 512)
    ours = assert_matches_transformers(noise(1700, 1300, seed=3), config)
    _, gh, gw = ours.grid_thw
    assert gh * gw * 16 * 16 <= 512 * 512
    assert ours.num_tokens == gh * gw // 4


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "CMYK", "1", "I;16"])
def test_matches_transformers_for_other_modes(mode):
    assert_matches_transformers(noise(45, 61, mode, seed=7), SMALL)


def test_transparency_is_composited_onto_white_like_transformers():
    palette = noise(40, 30, seed=1).convert("P")
    palette.info["transparency"] = 0  # palette index 0 is transparent
    rgb_with_key = noise(40, 30, seed=2)
    rgb_with_key.info["transparency"] = (0, 0, 0)
    clear = Image.new("RGBA", (40, 30), (10, 200, 30, 0))
    for image in (palette, rgb_with_key, clear):
        assert_matches_transformers(image, SMALL)
    assert np.all(np.asarray(load_image(clear)) == 255)  # fully transparent becomes white


def test_num_tokens_matches_transformers_patch_count():
    processor = qwen2_vl_pil.Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, size={"shortest_edge": 65536, "longest_edge": 16777216}
    )
    config = ImageProcessorConfig()
    for width, height in [(640, 480), (1920, 1080), (100, 4000), (8000, 6000)]:
        t, gh, gw = (1, *(side // 16 for side in smart_resize(height, width, 32, 65536, 16777216)))
        image = ProcessedImage(torch.empty(0), (t, gh, gw), config.merge_size, "")
        assert image.num_tokens * 4 == processor.get_number_of_image_patches(height, width)


# --- load_image ----------------------------------------------------------------------------------------------------


def test_load_image_from_a_data_url_round_trips():
    image = noise(23, 17, seed=5)
    encoded = base64.b64encode(png_bytes(image)).decode()
    loaded = load_image(f"data:image/png;base64,{encoded}")
    assert loaded.mode == "RGB" and loaded.size == (23, 17)
    assert np.array_equal(np.asarray(loaded), np.asarray(image))
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))  # MIME-style line breaks
    assert np.array_equal(np.asarray(load_image(f"DATA:image/png;base64,{wrapped}")), np.asarray(image))


def test_load_image_from_bytes_paths_and_pil(tmp_path):
    image = noise(19, 11, "RGBA", seed=6)
    path = tmp_path / "x.png"
    path.write_bytes(png_bytes(image))
    expected = np.asarray(load_image(image))
    for source in (png_bytes(image), path, str(path)):
        loaded = load_image(source)
        assert loaded.mode == "RGB"
        assert np.array_equal(np.asarray(loaded), expected)


def test_load_image_applies_exif_orientation():
    image = noise(30, 10, seed=8)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    loaded = load_image(png_bytes(image, exif=exif))
    assert loaded.size == (10, 30)
    assert np.array_equal(np.asarray(loaded), np.asarray(image.transpose(Image.Transpose.ROTATE_270)))


@pytest.mark.parametrize(("source", "message"), [
    (b"definitely not an image", "cannot decode"),
    (png_bytes(noise(8, 8))[:40], "cannot decode"),  # truncated
    ("data:image/png;base64,iVBOR*w0KGgo=", "invalid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "invalid base64"),  # bad padding
    ("data:image/png,rawdata", "base64"),
    ("data:image/png;base64", "malformed"),
    ("data:image/png;base64,", "cannot decode"),
    ("https://example.com/cat.png", "URL scheme"),
    ("ftp://example.com/cat.png", "URL scheme"),
    ("/no/such/image.png", "cannot read"),
])
def test_load_image_errors(source, message):
    with pytest.raises(ImageError, match=message):
        load_image(source)
    assert issubclass(ImageError, ValueError)


def test_load_image_refuses_decompression_bombs(monkeypatch):
    data = png_bytes(noise(20, 20))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 400 pixels > 2 * limit: an error, not just a warning
    with pytest.raises(ImageError, match="decompression bomb"):
        load_image(data)


# --- content_hash --------------------------------------------------------------------------------------------------


def test_content_hash_identifies_the_image():
    image = noise(40, 30, seed=9)
    from_pil = process_image(load_image(image), SMALL)
    from_png = process_image(load_image(png_bytes(image)), SMALL)
    assert from_pil.content_hash == from_png.content_hash == process_image(image, SMALL).content_hash
    assert len(from_pil.content_hash) == 64
    # The hash is of the image, not of the budget it was processed with.
    assert process_image(image, ImageProcessorConfig()).content_hash == from_pil.content_hash

    pixels = np.asarray(image).copy()
    pixels[0, 0, 0] ^= 1
    assert process_image(Image.fromarray(pixels), SMALL).content_hash != from_pil.content_hash
    # The same bytes in another shape are another image.
    reshaped = Image.fromarray(np.asarray(image).reshape(30 * 40 // 24, 24, 3))
    assert process_image(reshaped, SMALL).content_hash != from_pil.content_hash

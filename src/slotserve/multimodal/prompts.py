"""Images into a prompt, in the front end: each decoded, resized and cut into patches, and its one
`<|image_pad|>` placeholder (what the chat template writes for an image part) widened to one token per
image token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from slotserve.config import ModelConfig
from slotserve.multimodal.image_input import ImageInput
from slotserve.multimodal.image_processor import (
    ImageError,
    ImageProcessorConfig,
    ProcessedImage,
    load_image,
    process_image,
)

# What a prompt may carry as an image: an encoded file's bytes, a path or data: URL, a PIL image, or one
# already processed.
ImageLike = bytes | str | Path | Image.Image | ProcessedImage


@dataclass(frozen=True)
class ImagePrompting:
    """How a vision-language model's prompts take images."""

    processor: ImageProcessorConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    limit_per_prompt: int

    @classmethod
    def for_model(cls, path: str | Path, cfg: ModelConfig, limit_per_prompt: int, min_pixels: int | None = None,
                  max_pixels: int | None = None) -> ImagePrompting | None:
        """None for a text model."""
        if cfg.vision is None:
            return None
        processor = ImageProcessorConfig.from_dir(path).with_pixels(min_pixels, max_pixels)
        vision = cfg.vision
        return cls(processor, vision.image_token_id, vision.vision_start_token_id, vision.vision_end_token_id,
                   limit_per_prompt)

    def process(self, image: ImageLike) -> ProcessedImage:
        """ImageError (a ValueError) for data that is not an image this model can take."""
        return image if isinstance(image, ProcessedImage) else process_image(load_image(image), self.processor)

    def place(self, token_ids: list[int], images: Sequence[ImageLike]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's placeholder widened to its tokens, and the images where they stand. A
        prompt without placeholders gets the images at its start, each between its start and end tokens."""
        if len(images) > self.limit_per_prompt:
            raise ValueError(f"images: at most {self.limit_per_prompt} per prompt (--limit-mm-per-prompt), "
                             f"got {len(images)}")
        processed = []
        for i, image in enumerate(images):
            try:
                processed.append(self.process(image))
            except ImageError as e:
                raise ImageError(f"images[{i}]: {e}") from None
        pad = self.image_token_id
        slots = [i for i, t in enumerate(token_ids) if t == pad]
        if not slots and processed:
            head = [pad if j % 3 == 1 else self.vision_start_token_id if j % 3 == 0 else self.vision_end_token_id
                    for j in range(3 * len(processed))]
            token_ids, slots = head + list(token_ids), list(range(1, 3 * len(processed), 3))
        if len(slots) != len(processed):
            raise ValueError(f"prompt: holds {len(slots)} image placeholders for {len(processed)} images")
        out: list[int] = []
        placed: list[ImageInput] = []
        start = 0
        for slot, image in zip(slots, processed, strict=True):
            out.extend(token_ids[start:slot])
            placed.append(ImageInput.of(len(out), image.num_tokens, image.grid_thw, image.pixel_values,
                                        image.content_hash))
            out.extend([pad] * image.num_tokens)
            start = slot + 1
        out.extend(token_ids[start:])
        return out, placed

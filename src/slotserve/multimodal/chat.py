"""Chat messages with content parts (OpenAI's, and the offline `{"type": "image", "image": ...}`) made into
what any chat template renders: one string per message, each image a placeholder in its place, and the
images in order beside it."""

from __future__ import annotations

from typing import Any

from slotserve.multimodal.prompts import ImageLike

# What Qwen-VL chat templates write for an image part; the input processor widens its <|image_pad|>.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def flatten_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageLike]]:
    """The messages with their content parts joined into strings, and the images they carry (an image part's
    URL as a string, as given). ValueError naming the part for one that is malformed or of an unknown type."""
    flat, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            flat.append(message)
            continue
        texts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(_field(part, "text", str, where))
            elif kind in ("image_url", "image"):
                images.append(_image_source(part, kind, where))
                texts.append(IMAGE_PLACEHOLDER)
            else:
                raise ValueError(f"{where}.type: must be 'text', 'image_url' or 'image', got {kind!r}")
        flat.append({**message, "content": "".join(texts)})
    return flat, images


def _image_source(part: dict[str, Any], kind: str, where: str) -> ImageLike:
    if kind == "image":
        if part.get("image") is None:
            raise ValueError(f"{where}.image: is missing")
        return part["image"]
    value = part.get("image_url")
    if isinstance(value, dict):
        return _field(value, "url", str, f"{where}.image_url")
    if isinstance(value, str):
        return value
    raise ValueError(f"{where}.image_url: must be an object with a 'url'")


def _field(obj: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = obj.get(name)
    if not isinstance(value, kind):
        raise ValueError(f"{where}.{name}: must be a {kind.__name__}")
    return value

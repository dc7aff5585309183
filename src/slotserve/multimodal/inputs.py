"""A prompt's images on their way through the engine: placed in the prompt's tokens, carried to the engine
core, encoded once by the vision tower, and fed to the text model as the rows of their image tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slotserve.multimodal.image_input import ImageInput


@dataclass
class EncodedImage:
    """The vision tower's output for one image: a row per image token, and its DeepStack features (one tensor
    per level, added to the text model's hidden states after that many first layers)."""

    embeds: torch.Tensor
    deepstack: list[torch.Tensor]


@dataclass
class VisualRows:
    """A forward's image tokens: which rows of the flat batch they are, and what goes into those rows."""

    rows: torch.Tensor  # int64 row indices, increasing
    embeds: torch.Tensor  # [rows, hidden] in place of the token embeddings
    deepstack: list[torch.Tensor]  # per level [rows, hidden], added after that layer

    @classmethod
    def gather(cls, pieces: list[tuple[int, EncodedImage, slice]], device: torch.device) -> VisualRows:
        """pieces: (first row in the batch, an image's encoder output, the slice of its tokens in these rows)."""
        rows = torch.cat([torch.arange(row, row + part.stop - part.start) for row, _, part in pieces]).to(device)
        embeds = torch.cat([image.embeds[part] for _, image, part in pieces])
        levels = len(pieces[0][1].deepstack)
        deepstack = [torch.cat([image.deepstack[k][part] for _, image, part in pieces]) for k in range(levels)]
        return cls(rows, embeds, deepstack)


def rope_positions(num_tokens: int, images: list[ImageInput], merge: int) -> tuple[torch.Tensor, int]:
    """Qwen3-VL's (T, H, W) rotary positions of a prompt [3, num_tokens], and the offset of every later token's
    position from its index (the same on all three). Text counts on from where the last token left off, the
    same number three times; an image starting at position s with merged grid (t, h, w) takes T = s + frame,
    H = s + row, W = s + column, and the text after it starts at s + max(h, w)."""
    parts, pos, index = [], 0, 0
    for image in sorted(images, key=lambda im: im.offset):
        if image.offset > index:
            parts.append(torch.arange(pos, pos + image.offset - index).expand(3, -1))
            pos += image.offset - index
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge, image.grid_thw[2] // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        parts.append(grid.reshape(3, -1) + pos)
        pos += max(h, w)
        index = image.end
    if num_tokens > index:
        parts.append(torch.arange(pos, pos + num_tokens - index).expand(3, -1))
        pos += num_tokens - index
    positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return positions, int(positions.max()) + 1 - num_tokens if num_tokens else 0


@dataclass
class SeqVision:
    """A sequence's share of a step in a vision-language model, beside its tokens (engine/model_runner.py)."""

    positions: torch.Tensor | None  # [3, tokens] where the tokens include image ones; None: index + offset
    offset: int  # of a text token's position from its index, on all three axes (after images: negative)
    images: list[tuple[int, EncodedImage, slice]]  # (first row among the tokens, the image, its tokens there)


@dataclass
class RequestImages:
    """A request's images in the engine core: their inputs, their encoder outputs once computed (kept until
    the request ends, so a later chunk or a recompute after preemption reuses them), and the prompt's M-RoPE
    positions."""

    inputs: list[ImageInput]
    positions: torch.Tensor  # [3, prompt tokens]
    offset: int  # of every token after the prompt
    encoded: list[EncodedImage | None]

    @classmethod
    def of(cls, inputs: list[ImageInput], num_prompt_tokens: int, merge: int) -> RequestImages:
        positions, offset = rope_positions(num_prompt_tokens, inputs, merge)
        return cls(inputs, positions, offset, [None] * len(inputs))

    def overlapping(self, start: int, end: int) -> list[int]:
        """The images with tokens in [start, end)."""
        return [i for i, image in enumerate(self.inputs) if image.offset < end and start < image.end]

    def unencoded(self, start: int, end: int) -> list[int]:
        return [i for i in self.overlapping(start, end) if self.encoded[i] is None]

    def vision(self, start: int, end: int) -> SeqVision:
        """Tokens [start, end)'s share of a step; every image among them encoded."""
        prompt = self.positions.shape[1]
        images = []
        for i in self.overlapping(start, end):
            image = self.inputs[i]
            first, stop = max(start, image.offset), min(end, image.end)
            images.append((first - start, self.encoded[i], slice(first - image.offset, stop - image.offset)))
        if start >= prompt:
            return SeqVision(None, self.offset, images)
        after = torch.arange(prompt, max(end, prompt)) + self.offset  # recomputed output tokens, if any
        positions = torch.cat((self.positions[:, start:min(end, prompt)], after.expand(3, -1)), dim=1)
        return SeqVision(positions, self.offset, images)

    def block_key(self, start: int, end: int) -> tuple[tuple[str, int], ...]:
        """What besides its token ids tells a block of tokens [start, end) apart: the images in it (content
        hash, and where in the image the block begins)."""
        return tuple((self.inputs[i].content_hash, start - self.inputs[i].offset) for i in self.overlapping(start, end))

"""One image of a prompt as it crosses from the front end to the engine core: plain fields, no tensors, so the
process boundary's messages stay torch-free (engine/protocol.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class ImageInput:
    offset: int  # the prompt index of its first image token
    num_tokens: int  # its image tokens, one per 2x2 window of patches
    grid_thw: tuple[int, int, int]  # frames, rows and columns of patches
    pixels: bytes  # its pixel_values, float32 rows of patch values
    content_hash: str  # of the decoded image: two different images never share cached blocks

    @classmethod
    def of(cls, offset: int, num_tokens: int, grid_thw: tuple[int, int, int], pixel_values: torch.Tensor,
           content_hash: str) -> ImageInput:
        pixels = pixel_values.float().contiguous().numpy().tobytes()
        return cls(offset, num_tokens, tuple(grid_thw), pixels, content_hash)

    def pixel_values(self) -> torch.Tensor:
        import torch  # the engine core's side only

        t, h, w = self.grid_thw
        return torch.frombuffer(bytearray(self.pixels), dtype=torch.float32).view(t * h * w, -1)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

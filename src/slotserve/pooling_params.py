"""PoolingParams: what an embedding request asks for (the counterpart of SamplingParams)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    dimensions: int | None = None  # keep the first `dimensions` values (Matryoshka), then re-normalise
    normalize: bool | None = None  # None: the model's own choice (L2-normalised for Qwen3-Embedding)

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"dimensions: must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize: must be true or false, got {self.normalize!r}")

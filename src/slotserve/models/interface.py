"""What the engine asks of a model class (docs/adding_a_model.md walks through writing one). The runner calls
only these; everything else about a model is its own."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from slotserve.config import ModelConfig, PrefillPrecision
from slotserve.distributed.group import ModelParallel
from slotserve.layers.attention import AttentionMetadata
from slotserve.multimodal.inputs import EncodedImage, VisualRows


@runtime_checkable
class Model(Protocol):
    """A decoder over a flat batch: every sequence's new tokens side by side, with their positions.

    Built as `cls(cfg, max_position, parallel)`: under tensor parallel each rank builds its own part, as
    `parallel` says. The loader then fills the parameters from the checkpoint by name and calls `tie_weights`.
    Each `Attention` layer of the model gets its slice of the paged KV cache from the runner."""

    config: ModelConfig
    parallel: ModelParallel

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states [rows, hidden] of the rows `keep` names (None: all)."""
        ...

    def tie_weights(self) -> None:
        """Shares tensors the config ties (the embedding and the output head); again after loading."""
        ...


@runtime_checkable
class CausalLM(Model, Protocol):
    """A model with an output head: what generates."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab] on the driver rank; None on the other ranks under tensor parallel."""
        ...


@runtime_checkable
class VisionLanguageModel(CausalLM, Protocol):
    """A causal LM that reads images: the runner passes the image tokens' rows and encoder outputs to
    `forward` as `visual`, and positions [3, tokens] (M-RoPE) for a chunk with image tokens."""

    @property
    def spatial_merge_size(self) -> int:
        """Patches merged, per side, into one image token."""
        ...

    def choose_vision_dtype(self, precision: PrefillPrecision) -> torch.dtype:
        """Puts the vision tower in the dtype its GEMMs run fastest in under the engine's `precision` of large
        GEMMs (where that loses nothing but the activations' rounding, or was asked for); that dtype."""
        ...

    def encode_images(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[EncodedImage]:
        """The vision tower over these images in one call: each image's token embeddings (and extra features)."""
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None, visual: VisualRows | None = None) -> torch.Tensor:
        ...

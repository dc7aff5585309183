"""Maps a config's `architectures[0]` to the module that implements it."""

from __future__ import annotations

from torch import nn

from slotserve.models.qwen import QwenForCausalLM, QwenForEmbedding
from slotserve.models.qwen3_moe import Qwen3MoeForCausalLM
from slotserve.models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration


class UnsupportedArchitectureError(ValueError):
    pass


ARCHITECTURES: dict[str, type[nn.Module]] = {
    "Qwen2ForCausalLM": QwenForCausalLM,
    "Qwen3ForCausalLM": QwenForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2Model": QwenForEmbedding,
    "Qwen3Model": QwenForEmbedding,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported architectures: {supported}") from None

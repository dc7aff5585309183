"""Qwen3-VL (dense and MoE): a vision tower (qwen3_vl_vision.py) whose output takes the place of the prompt's
image tokens in a Qwen3 text model, with two changes to that model:

- interleaved M-RoPE: each token is rotated by a (T, H, W) position (layers/rotary.py), which the engine
  computes per request (multimodal/inputs.py `rope_positions`);
- DeepStack: features from inner vision blocks are added to the hidden states of the image tokens after
  each of the first text layers.

Checkpoint names: `model.visual.*`, `model.language_model.*` (the Qwen3 decoder's names below it) and
`lm_head.weight`. The vision tower runs once per image (`encode_images`), outside the step's forward; the
step's forward takes its output for the image tokens it computes (`VisualRows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import ClassVar

import torch
from torch import nn

from slotserve.config import ConfigError, ModelConfig, PrefillPrecision
from slotserve.distributed.group import UNSPLIT, ModelParallel
from slotserve.layers.attention import AttentionMetadata
from slotserve.layers.embedding import gather_logits, lm_head, tie
from slotserve.layers.rotary import MropeRotaryEmbedding
from slotserve.models.qwen import MlpFactory, QwenModel, dense_mlp
from slotserve.models.qwen3_moe import check_moe_config, moe_mlp
from slotserve.models.qwen3_vl_vision import Qwen3VLVisionModel, VisionConfig
from slotserve.multimodal.inputs import EncodedImage, VisualRows

# (a tensor of the model, how to take it from the stacked checkpoint tensor): models/loader.py places them.
TensorParts = list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]


class Qwen3VLTextModel(QwenModel):
    """The Qwen3 decoder with M-RoPE and DeepStack."""

    def __init__(self, cfg: ModelConfig, max_position: int, mlp_for_layer: MlpFactory,
                 parallel: ModelParallel = UNSPLIT) -> None:
        super().__init__(cfg, max_position, mlp_for_layer, parallel)
        self.rotary = MropeRotaryEmbedding(cfg.head_dim, max_position, cfg.rope, cfg.mrope_section)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None, visual: VisualRows | None = None) -> torch.Tensor:
        """positions: [tokens], or [3, tokens] where any token's three differ (a chunk with image tokens)."""
        x, residual = self.embed_tokens(input_ids), None
        if visual is not None:
            x = x.index_copy(0, visual.rows, visual.embeds.to(x.dtype))
        rope = self.rotary(positions)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            deep = visual is not None and i < len(visual.deepstack)
            x, residual = layer(rope, x, residual, meta, keep if i == last and not deep else None)
            if deep:  # the layer's output is x + residual: the features go into the residual stream
                residual = residual.index_add(0, visual.rows, visual.deepstack[i].to(residual.dtype))
                if i == last and keep is not None:
                    x, residual = x[keep], residual[keep]
        return self.norm.add_and_norm(x, residual)[0]


class Qwen3VLModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int, mlp_for_layer: MlpFactory,
                 parallel: ModelParallel) -> None:
        super().__init__()
        self.visual = Qwen3VLVisionModel(VisionConfig.from_dict(cfg.vision.vision_config))
        self.language_model = Qwen3VLTextModel(cfg, max_position, mlp_for_layer, parallel)


class Qwen3VLForConditionalGeneration(nn.Module):
    """Input: a flat batch of token ids with their (M-RoPE) positions and the image tokens' rows; output: hidden
    states, then logits for only the rows that sample."""

    mlp_for_layer: ClassVar[MlpFactory] = staticmethod(dense_mlp)

    def __init__(self, cfg: ModelConfig, max_position: int | None = None,
                 parallel: ModelParallel = UNSPLIT) -> None:
        super().__init__()
        if cfg.vision is None or not cfg.mrope_section:
            raise ConfigError(f"config.json: {cfg.architecture} needs a vision_config and an mrope_section")
        if parallel.group.size > 1:
            raise ConfigError(f"tensor_parallel_size: {cfg.architecture} runs on one rank")
        self.config, self.parallel = cfg, parallel
        self.model = Qwen3VLModel(cfg, max(max_position or 0, cfg.max_position_embeddings), self.mlp_for_layer,
                                  parallel)
        self.lm_head = lm_head(cfg.hidden_size, cfg.vocab_size, parallel.group)
        self.tie_weights()

    @property
    def spatial_merge_size(self) -> int:
        return self.model.visual.cfg.spatial_merge_size

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            tie(self.lm_head, self.model.language_model.embed_tokens)

    def choose_vision_dtype(self, precision: PrefillPrecision) -> torch.dtype:
        return self.model.visual.choose_dtype(precision)

    @torch.inference_mode()
    def encode_images(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]) -> list[EncodedImage]:
        """The vision tower over these images in one call; each image's token embeddings and DeepStack features."""
        # The text model's dtype, from its final norm: its linears and embedding may hold packings, no weight.
        param, vision = self.model.language_model.norm.weight, next(self.model.visual.parameters())
        out = self.model.visual(torch.cat(pixel_values).to(vision.device, vision.dtype),
                                torch.tensor(grids, dtype=torch.long, device=param.device))
        merge = self.spatial_merge_size**2
        sizes = [t * h * w // merge for t, h, w in grids]
        embeds = out.embeds.to(param.dtype).split(sizes)
        levels = [feature.to(param.dtype).split(sizes) for feature in out.deepstack]
        return [EncodedImage(e, [level[i] for level in levels]) for i, e in enumerate(embeds)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                keep: torch.Tensor | None = None, visual: VisualRows | None = None) -> torch.Tensor:
        return self.model.language_model(input_ids, positions, meta, keep, visual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_logits(self.lm_head(hidden), self.parallel.group, self.config.vocab_size)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL with Qwen3-MoE's sparse MLPs in the text model (router renormalised)."""

    mlp_for_layer = staticmethod(moe_mlp)

    def __init__(self, cfg: ModelConfig, max_position: int | None = None,
                 parallel: ModelParallel = UNSPLIT) -> None:
        check_moe_config(cfg)
        # Its router always renormalises the chosen experts' weights, whatever norm_topk_prob says.
        super().__init__(replace(cfg, norm_topk_prob=True), max_position, parallel)

    def split_checkpoint_tensor(self, name: str, shapes: dict[str, tuple[int, ...]]) -> TensorParts | None:
        """A layer's experts stored stacked (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) as each
        expert's tensors; None for any other tensor. Two layouts exist: the published checkpoints' ((E, H, 2I),
        (E, I, H)) and the one transformers 5 writes with save_pretrained ((E, 2I, H), (E, H, I))."""
        prefix, _, kind = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or kind not in ("gate_up_proj", "down_proj"):
            return None
        width, hidden = self.config.moe_intermediate_size, self.config.hidden_size
        down, gate_up = shapes.get(f"{prefix}.down_proj", ()), shapes.get(f"{prefix}.gate_up_proj", ())
        # Whichever tensor's shape tells the two layouts apart (down_proj's does unless I == H; then 2I != H).
        published = down[1:] == (width, hidden) if width != hidden else gate_up[1:] == (hidden, 2 * width)

        def part(e: int, rows: slice) -> Callable[[torch.Tensor], torch.Tensor]:
            return (lambda t: t[e][:, rows].T) if published else (lambda t: t[e][rows])

        experts = range(shapes[name][0])
        if kind == "down_proj":
            return [(f"{prefix}.{e}.down_proj.weight", part(e, slice(None))) for e in experts]
        return [(f"{prefix}.{e}.{proj}.weight", part(e, rows)) for e in experts
                for proj, rows in (("gate_proj", slice(0, width)), ("up_proj", slice(width, 2 * width)))]

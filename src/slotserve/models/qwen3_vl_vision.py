"""The Qwen3-VL vision tower: images (and video frames) in, merged image tokens and DeepStack features out.

A ViT over patches of `temporal_patch_size` frames x `patch_size`^2 pixels. Each image arrives as the rows
of `pixel_values`, one flattened patch per row, listed window by window: the `spatial_merge_size`^2 patches
that merge into one token are consecutive. Every block keeps that order, so merging is a reshape. A learned
square grid of position embeddings is resampled to each image's grid, a 2-D rotary encodes (row, column),
and attention stays within one frame. The final merger gives the tokens the language model reads; the
DeepStack mergers turn the outputs of a few earlier blocks into features that the language model adds to
the hidden states of its first layers.

Parameter names are the checkpoint's under `model.visual.` (as transformers 4.57 and 5 both save them):
strip that prefix and `load_state_dict`.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.config import ConfigError, PrefillPrecision
from slotserve.layers.rotary import apply_rotary
from slotserve.quantization.packed_linear import panel_dtype

ACTIVATIONS = {"gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"), "gelu": F.gelu}
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin per patch: [patches, 1, head_dim / 2]


@dataclass(frozen=True)
class VisionConfig:
    """The fields of a Qwen3-VL config.json's `vision_config`."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0  # transformers 5 saves it as rope_parameters.rope_theta; 4.x did not save it

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                     "num_position_embeddings", "in_channels", "patch_size", "temporal_patch_size",
                     "spatial_merge_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"vision_config.{name}: must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"vision_config.num_heads: {self.num_heads} heads do not divide "
                              f"hidden_size {self.hidden_size}")
        if self.head_dim % 4:
            raise ConfigError(f"vision_config.num_heads: head dim {self.head_dim} (hidden_size / num_heads) is not "
                              "divisible by 4; the 2-D rotary gives a quarter of it to each of row and column")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ConfigError(f"vision_config.num_position_embeddings: {self.num_position_embeddings} is not a "
                              "perfect square (the embeddings are a square grid)")
        layers = self.deepstack_visual_indexes
        if any(not 0 <= i < self.depth for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"vision_config.deepstack_visual_indexes: {list(layers)} must be distinct blocks "
                              f"in 0..{self.depth - 1}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"vision_config.hidden_act: {self.hidden_act!r} is not supported; choose one of "
                              f"{', '.join(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        """From a config.json's `vision_config`; unknown keys are ignored."""
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in d]
        if missing:
            raise ConfigError(f"vision_config.{missing[0]}: required field is missing")
        args = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        args["deepstack_visual_indexes"] = tuple(int(i) for i in d["deepstack_visual_indexes"])
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"vision_config.rope_parameters: rope_type {rope['rope_type']!r} is not supported "
                              "(only 'axial')")
        args["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", cls.rope_theta)))
        return cls(**args)


@dataclass
class VisionOutput:
    embeds: torch.Tensor  # (tokens, out_hidden_size): the merged tokens of every image, in order
    deepstack: list[torch.Tensor]  # per DeepStack block, in block order: (tokens, out_hidden_size)


def window_order(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an h x w grid, listed merge x merge window by window."""
    rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    return rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, rope: Rope, frames: list[tuple[int, int]]) -> torch.Tensor:
        """frames: (t, patches per frame) per image; each frame attends to itself only."""
        n, dim = x.shape
        heads, head_dim = self.num_heads, self.head_dim
        qkv = self.qkv(x)
        qk = apply_rotary(qkv[:, : 2 * dim].view(n, 2 * heads, head_dim), *rope)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, 2 * dim :].view(n, heads, head_dim)
        sizes = [t * hw for t, hw in frames]
        out = []
        # One call per image: its frames are equally long, so they batch (the frame is the batch dim).
        for q_i, k_i, v_i, (t, hw) in zip(q.split(sizes), k.split(sizes), v.split(sizes), frames, strict=True):
            q_i, k_i, v_i = (z.reshape(t, hw, heads, head_dim).transpose(1, 2) for z in (q_i, k_i, v_i))
            out.append(F.scaled_dot_product_attention(q_i, k_i, v_i).transpose(1, 2).reshape(t * hw, dim))
        return self.proj(torch.cat(out))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, rope: Rope, frames: list[tuple[int, int]]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, frames)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each window's merge^2 patches, side by side in one row, to one token of out_hidden_size. The final
    merger normalizes each patch before the concatenation; the DeepStack ones (`postshuffle`) the row after."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # A conv whose stride is its kernel, over inputs one kernel in size, is a matmul over the flat rows
        # (in the weight's own (channel, frame, y, x) order). On a CPU F.linear is 7x faster than the conv.
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.flatten(1), self.proj.bias)


class Qwen3VLVisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_visual_indexes)

    def choose_dtype(self, precision: PrefillPrecision) -> torch.dtype:
        """Moves a float32 CPU tower to bfloat16 where the engine's large GEMMs run in bfloat16 (`panel_dtype`) and
        either every weight is a bfloat16 value (a bfloat16 checkpoint, so only the activations round) or
        bfloat16 was asked for; the dtype it runs in. Its GEMMs then run at the bfloat16 units' rate."""
        params = list(self.parameters())
        float_cpu = params[0].device.type == "cpu" and params[0].dtype == torch.float32
        if not float_cpu or panel_dtype(precision) != torch.bfloat16:
            return params[0].dtype
        if precision is PrefillPrecision.BFLOAT16 or all(torch.equal(p, p.bfloat16().float()) for p in params):
            self.to(torch.bfloat16)
        return next(self.parameters()).dtype

    def position_embeddings(self, h: int, w: int) -> torch.Tensor:
        """The learned grid resampled to h x w, as (h * w, hidden) in raster order, in float32."""
        side = math.isqrt(self.cfg.num_position_embeddings)
        grid = self.pos_embed.weight.float().t().reshape(1, -1, side, side)
        # align_corners: the table's corners land on the image's corner patches, as transformers resamples it.
        grid = F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)
        return grid[0].flatten(1).t()

    def rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> Rope:
        """cos, sin for `apply_rotary`, which pairs element j of a head with j + head_dim / 2: the first
        head_dim / 4 pairs turn with the patch's row, the rest with its column."""
        half = self.cfg.head_dim // 2
        inv_freq = 1.0 / self.cfg.rope_theta ** (torch.arange(0, half, 2, device=rows.device).float() / half)
        freqs = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)
        return freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        """pixel_values: (sum of t * h * w, in_channels * temporal_patch_size * patch_size^2), image after image
        in window order; grid_thw: (images, 3), each image's frames (t) and rows and columns of patches."""
        cfg, device = self.cfg, pixel_values.device
        merge = cfg.spatial_merge_size
        grids = [tuple(g) for g in grid_thw.tolist()]
        if any(h % merge or w % merge for _, h, w in grids):
            raise ValueError(f"grid_thw: every h and w must be a multiple of spatial_merge_size {merge}, got {grids}")
        patches = sum(t * h * w for t, h, w in grids)
        if patches != pixel_values.shape[0]:
            raise ValueError(f"pixel_values: {pixel_values.shape[0]} rows, but grid_thw {grids} has {patches} patches")

        x = self.patch_embed(pixel_values)
        pos, rows, cols = [], [], []
        for t, h, w in grids:
            r, c = window_order(h, w, merge, device)
            pos.append(self.position_embeddings(h, w)[r * w + c].repeat(t, 1))
            rows.append(r.repeat(t))
            cols.append(c.repeat(t))
        x = x + torch.cat(pos).to(x.dtype)
        rope = self.rotary(torch.cat(rows), torch.cat(cols))
        frames = [(t, h * w) for t, h, w in grids]

        deepstack = {layer: i for i, layer in enumerate(cfg.deepstack_visual_indexes)}
        features = []
        for layer, block in enumerate(self.blocks):
            x = block(x, rope, frames)
            if layer in deepstack:
                features.append(self.deepstack_merger_list[deepstack[layer]](x))
        return VisionOutput(self.merger(x), features)

"""Rotary position embedding with the config's theta and optional linear or YaRN scaling."""

from __future__ import annotations

import math

import torch

from slotserve.config import RopeConfig
from slotserve.kernels import native
from slotserve.kernels import norm_rotary_swiglu_argmax as kernels


def inverse_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Per-pair rotation frequencies and the factor that scales cos/sin (YaRN's attention factor)."""
    base_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.scaling_type == "default":
        return base_freq, 1.0
    if rope.scaling_type == "linear":
        return base_freq / rope.factor, 1.0
    return _yarn(rope, dim)


def _yarn(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    # YaRN keeps high-frequency pairs as they are (extrapolate), divides low-frequency pairs by the
    # factor (interpolate) and ramps linearly between the two correction dimensions.
    factor = rope.factor
    if rope.original_max_position is None:
        raise ValueError("rope_scaling: yarn needs original_max_position_embeddings")
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


class RotaryEmbedding:
    """cos/sin tables for every position, built on first use on the device of the positions.

    Not a module buffer: the model is built on the meta device and filled from the checkpoint,
    and these tables are computed, never loaded."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        self.head_dim, self.max_position, self.rope = head_dim, max_position, rope
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position, [max_position, head_dim / 2] each, on `device`."""
        if self._tables is None or self._tables[0].device != device:
            inv_freq, scale = inverse_frequencies(self.rope, self.head_dim)
            freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32), inv_freq)
            self._tables = ((freqs.cos() * scale).to(device), (freqs.sin() * scale).to(device))
        return self._tables

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, shaped [tokens, 1, head_dim / 2] to broadcast over heads."""
        cos, sin = self.tables(positions.device)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


class MropeRotaryEmbedding(RotaryEmbedding):
    """Interleaved multimodal RoPE (Qwen3-VL): each token has a (T, H, W) position (an image token its frame,
    row and column; a text token the same number three times), and frequency i of the head takes the H
    position where i % 3 == 1 and i < 3 * section[1], the W position where i % 3 == 2 and i < 3 * section[2],
    else the T position. 1-D positions are text only, where this is plain RoPE."""

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig, section: tuple[int, ...]) -> None:
        super().__init__(head_dim, max_position, rope)
        # Python ints, not a tensor: the model is built on the meta device.
        self.axis = [1 if i % 3 == 1 and i < 3 * section[1] else 2 if i % 3 == 2 and i < 3 * section[2] else 0
                     for i in range(head_dim // 2)]

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [tokens] or [3, tokens]; cos and sin [tokens, 1, head_dim / 2]."""
        if positions.dim() == 1:
            return super().__call__(positions)
        cos, sin = self.tables(positions.device)
        index = torch.tensor(self.axis, device=positions.device).expand(1, positions.shape[1], -1)
        return tuple(table[positions].gather(0, index).squeeze(0).unsqueeze(1) for table in (cos, sin))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates [tokens, heads, head_dim] by pairing element j with element j + head_dim / 2 (on a CPU in
    float32, one native call instead of nine torch ops; x may be a column slice of wider rows)."""
    if x.dim() == 3 and kernels.rows_dense(x) and kernels.applies(cos, sin) and native.takes(x):
        return kernels.rotary(x, cos.view(len(x), -1), sin.view(len(x), -1))
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

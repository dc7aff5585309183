"""SwiGLU's activation: silu(gate) * up, on a merged gate/up projection's output.

On a CPU in float32 it is one native call (kernels/norm_rotary_swiglu_argmax.c) instead of a split, a silu and
a multiply."""

import torch
import torch.nn.functional as F

from slotserve.kernels import norm_rotary_swiglu_argmax as kernels


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [tokens, 2 * inner], gate then up in each row -> silu(gate) * up [tokens, inner]."""
    if x.dim() == 2 and kernels.applies(x):
        return kernels.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

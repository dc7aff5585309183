"""RMSNorm, computed in float32 whatever the weights' dtype (as the reference implementation does).

On a CPU in float32 it is one native call (kernels/norm_rotary_swiglu_argmax.c) instead of six torch ops, and with the
residual add before it (`add_and_norm`) one instead of seven."""

import torch
from torch import nn

from slotserve.kernels import norm_rotary_swiglu_argmax as kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.applies(x, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps)
        return self._torch(x)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): a decoder layer's residual add and the norm after it, as
        one native call on the CPU (which updates `residual` in place and returns it)."""
        if kernels.applies(x, residual, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps, residual), residual
        residual = residual + x
        return self._torch(residual), residual

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

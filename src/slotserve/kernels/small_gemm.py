"""The small-batch float32 GEMM of a CPU decode step (small_gemm.c), called from Python.

`small_gemm(x, weight, bias)` is F.linear for a contiguous float32 CPU input of a few rows, reading each
weight once where MKL would copy it into panels first; `available()` says whether it was built here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from slotserve.kernels import native

SOURCE = Path(__file__).with_name("small_gemm.c")
_ARGS = (ctypes.c_void_p,) * 4 + (ctypes.c_long,) * 3 + (ctypes.c_int,)


def available() -> bool:
    return native.function(SOURCE, "slotserve_small_gemm", _ARGS) is not None


class BoundGemm:
    """The kernel bound to one weight and bias, checked once: a call checks only its input. A decode
    step of the default model makes 121 of these calls, each between two streams of weights that have
    pushed Python's own data out of the caches, where every check costs several times what it does warm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self._gemm = native.require(native.function(SOURCE, "slotserve_small_gemm", _ARGS), SOURCE)
        if weight.dim() != 2 or (bias is not None and bias.shape != weight.shape[:1]):
            raise ValueError(f"small_gemm: weight {tuple(weight.shape)} and bias "
                             f"{None if bias is None else tuple(bias.shape)} do not fit together")
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()):
                raise ValueError(f"small_gemm: {name} must be a contiguous float32 CPU tensor")
        self.weight, self.bias = weight, bias  # held: the kernel reads them through raw pointers
        self._pointers = (weight.data_ptr(), None if bias is None else bias.data_ptr())
        self.n, self.k = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ weight^T + bias."""
        if x.dim() != 2 or x.shape[1] != self.k or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"small_gemm: x {tuple(x.shape)} {x.dtype} on {x.device} does not multiply a float32 "
                             f"CPU weight of {self.k} columns")
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.n)
        if self._gemm(x.data_ptr(), *self._pointers, out.data_ptr(), x.shape[0], self.n, self.k,
                      torch.get_num_threads()):
            raise MemoryError(f"small_gemm: no memory for a {self.k} x {x.shape[0]} scratch buffer")
        return out


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias, all float32 on the CPU."""
    return BoundGemm(weight.contiguous(), None if bias is None else bias.contiguous())(x)

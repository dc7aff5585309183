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


def small_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias, all float32 on the CPU."""
    gemm = native.require(native.function(SOURCE, "slotserve_small_gemm", _ARGS), SOURCE)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"small_gemm: shapes {tuple(x.shape)} and {tuple(weight.shape)} do not multiply")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"small_gemm: {name} must be float32 on the CPU, not {t.dtype} on {t.device}")
    x, weight = x.contiguous(), weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n)
    if gemm(x.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(),
            m, n, k, torch.get_num_threads()):
        raise MemoryError(f"small_gemm: no memory for a {k} x {m} scratch buffer")
    return out

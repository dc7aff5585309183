"""RMSNorm (with the residual add before it), rotary embedding, SwiGLU's silu(gate) * up and the argmax of each
row, in one native call each (norm_rotary_swiglu_argmax.c), for CPU float32 tensors."""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from slotserve.kernels import native

SOURCE = Path(__file__).with_name("norm_rotary_swiglu_argmax.c")
_NORM_ARGS = (ctypes.c_void_p,) * 4 + (ctypes.c_long,) * 2 + (ctypes.c_float, ctypes.c_int)
_SILU_MUL_ARGS = (ctypes.c_void_p,) * 2 + (ctypes.c_long,) * 2 + (ctypes.c_int,)
_ROTARY_ARGS = (ctypes.c_void_p, ctypes.c_long) + (ctypes.c_void_p,) * 3 + (ctypes.c_long,) * 3 + (ctypes.c_int,)
_ARGMAX_ARGS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_int)


def available() -> bool:
    return native.function(SOURCE, "slotserve_rms_norm", _NORM_ARGS) is not None


def applies(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can take the native path: contiguous float32 on the CPU, no autograd."""
    return native.takes(*tensors) and all(t.is_contiguous() for t in tensors) and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2, last dim) + eps) * weight, for x [..., dim]. With `residual` (x's shape): first
    residual += x in place, then the norm of that sum."""
    norm = native.require(native.function(SOURCE, "slotserve_rms_norm", _NORM_ARGS), SOURCE)
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match the last dim of x {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} is not the shape of x {tuple(x.shape)}")
    out = torch.empty_like(x)
    norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
         x.numel() // dim, dim, eps, torch.get_num_threads())
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [rows, 2 * inner] holding gate then up: [rows, inner]."""
    swiglu = native.require(native.function(SOURCE, "slotserve_silu_mul", _SILU_MUL_ARGS), SOURCE)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_mul: x {tuple(x.shape)} is not [rows, 2 * inner]")
    rows, inner = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, inner)
    swiglu(x.data_ptr(), out.data_ptr(), rows, inner, torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by cos, sin [tokens, head_dim / 2], pairing j with j + head_dim / 2;
    x's heads must be dense within a token, its tokens any distance apart. The result is dense."""
    rotate = native.require(native.function(SOURCE, "slotserve_rotary", _ROTARY_ARGS), SOURCE)
    tokens, heads, head_dim = x.shape
    if head_dim % 2 or cos.shape != (tokens, head_dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"rotary: x {tuple(x.shape)} and cos/sin {tuple(cos.shape)} do not fit together")
    if not rows_dense(x) or not cos.is_contiguous() or not sin.is_contiguous():
        raise ValueError("rotary: x needs dense heads within each token, cos and sin dense")
    out = torch.empty(x.shape)
    rotate(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens, heads, head_dim,
           torch.get_num_threads())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch's argmax(x, dim=-1) for x [rows, n] with n > 0: the first index among equal largest values, a
    row's first NaN where it holds one. int64. The kernel keeps indices in 32-bit lanes: n < 2**31."""
    find = native.require(native.function(SOURCE, "slotserve_argmax", _ARGMAX_ARGS), SOURCE)
    if x.dim() != 2 or not 0 < x.shape[1] < 2**31:
        raise ValueError(f"argmax: x {tuple(x.shape)} is not [rows, n] with 0 < n < 2**31")
    out = torch.empty(x.shape[0], dtype=torch.long)
    find(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def rows_dense(x: torch.Tensor) -> bool:
    """Whether each row (first dim) of x is dense in memory, rows any distance apart."""
    return all(x.shape[d] == 1 or x.stride(d) == math.prod(x.shape[d + 1:]) for d in range(1, x.dim()))

"""The model's linear layer: nn.Linear, with a CPU decode step's rows multiplied by our own kernel.

For 1..64 float32 input rows (a decode step of that many sequences) the native small GEMM
(kernels/small_gemm.c) reads each weight once, where MKL copies every weight into its panel layout
on each call before reading it again. On the default model's 24 layers and output head (2 GB of
float32 weights streamed per step, 2 threads, same run): 1 row 81 vs 81 ms (MKL's matrix-vector
product is as good), 8 rows 122 vs 224 ms, 32 rows 154 vs 217 ms. Prefill (over 64 rows, where
packing pays for itself) goes to a BLAS library, as below.

Where the kernel cannot be built (no C compiler or OpenMP), 16..64 rows go through MKL as W @ x^T,
which is 1.17x faster than x @ W^T there (457 -> 391 ms on the 32-sequence decode step).

On CPUs with AMX, a weight that is a scale times bfloat16 values (plus an offset or not) in every block
of 32 along a row (a GGUF's Q8_0/Q5_0/Q4_K tensors, a bfloat16 checkpoint in float32) runs through AMX
from amx_gemm.MIN_ROWS rows on (`AmxWeight.runs`), with exact products and float32 sums
(kernels/amx_gemm.c); `bind_amx` packs it, once, where it can. Fewer rows of a bfloat16 packing stay on the
FMA kernel (the default model's 24 gate/up weights in huge pages, Xeon with 2 threads, FMA vs AMX per
layer: 1 row 1.16 vs 0.88 ms, 8 rows 1.59 vs 0.90, 12 rows 1.79 vs 0.90, 32 rows 2.50 vs 1.56, 64 rows
4.69 vs 3.07: AMX would win from 1 row on, but moving those rows is left to a change of its own). A
packing of small integers (GGUF's, 1 byte a value: `narrow`) takes every row count: up to
amx_gemm.FEW_ROWS rows on the vector units, in float32 from its bytes, which streams under a third of the
float32 bytes (batch-1 decode of the default model 12.9 -> ~22 tok/s in a slow hour, 35 in a fast one),
and AMX above. Without AMX the same few-row kernel takes those rows (AVX2 or AVX-512; 1.8-2.2x the float32
speed at batch 1) and the float32 weight the rest: `AmxWeight.runs` says which. Q6_K's integers, under a
scale per 16, pack for those few rows only, with AMX or without.

Other prefill rows (over 64) go through oneDNN's matmul where torch has it, straight from the checkpoint's
weight: on an AMD EPYC (2 threads, the default model's four shapes at 512 rows, same run) 134 vs 105
GFLOP/s for MKL's, whose GEMM trails most on the wide gate/up weight (98 vs 125-134).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from slotserve.kernels import amx_gemm, native, small_gemm
from slotserve.layers import changes

NATIVE_ROWS = range(1, 65)
TRANSPOSED_ROWS = range(16, 65)


def _onednn_linear() -> bool:
    """Whether torch ships oneDNN's linear (a CPU build with mkldnn, the op inductor uses)."""
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._linear_pointwise.default is not None
    except (AttributeError, RuntimeError):
        return False


ONEDNN = _onednn_linear()


class Linear(nn.Linear):
    _gemm: small_gemm.BoundGemm | None = None  # the kernel bound to this layer's current weight and bias
    amx: amx_gemm.AmxWeight | None = None  # this layer's weight packed for AMX, where bind_amx could

    def __setattr__(self, name: str, value: object) -> None:
        if name == "amx":  # a packing kernels may point into (layers/changes.py)
            changes.note(self)
        super().__setattr__(name, value)

    def bind_amx(self) -> bool:
        """Packs this layer's weight and bias for the AMX GEMM where it can (amx_gemm.py); whether it did."""
        self.amx = amx_gemm.AmxWeight.pack(self.weight, self.bias)
        return self.amx is not None

    def current_amx(self) -> amx_gemm.AmxWeight | None:
        """The AMX packing of this layer's current weight and bias (None: none, or they were replaced since)."""
        amx = self.amx
        return amx if amx is not None and amx.weight is self.weight and amx.bias is self.bias else None

    def streamed_bytes(self, rows: int) -> int:
        """The weight bytes a call of this many rows reads: its AMX packing's where that runs them."""
        amx = self.current_amx()
        return amx.nbytes if amx is not None and amx.runs(rows) else self.weight.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not native.takes(x, self.weight):
            return super().forward(x)
        rows = x.shape[0]
        if (amx := self.current_amx()) is not None and amx.runs(rows):
            return amx(x)
        if rows in NATIVE_ROWS and small_gemm.available() and self.weight.is_contiguous():
            gemm = self._gemm
            if gemm is None or gemm.weight is not self.weight or gemm.bias is not self.bias:
                gemm = self._gemm = small_gemm.BoundGemm(self.weight, self.bias)
            return gemm(x)
        if rows in TRANSPOSED_ROWS:
            if self.bias is None:
                return torch.mm(self.weight, x.t()).t()
            return torch.addmm(self.bias[:, None], self.weight, x.t()).t()
        if ONEDNN:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return super().forward(x)


class MergedLinear(Linear):
    """Projections of one input stacked into one weight (attention's q, k and v; an MLP's gate and up): one
    call instead of two or three. Measured at batch 1 on CPU, each call costs 30-60 us of Python and
    dispatch besides its GEMM (several times its cost in a warm loop: the weights streamed between two
    calls push the interpreter's own data out of the caches), so the fewer the better.

    Checkpoints store the parts as separate tensors, named as sibling modules (`parts`); the loader
    copies each into its rows (`part_rows`), so this weight is a copy, never a view of the file."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], parts: Sequence[str], bias: bool) -> None:
        if len(output_sizes) != len(parts):
            raise ValueError(f"parts: {len(parts)} names for {len(output_sizes)} output sizes")
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes, self.parts = list(output_sizes), tuple(parts)

    def part_rows(self, i: int) -> slice:
        start = sum(self.output_sizes[:i])
        return slice(start, start + self.output_sizes[i])

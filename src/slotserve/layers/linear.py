"""The model's linear layer: nn.Linear, with a CPU decode step's rows multiplied by our own kernel.

For 1..64 float32 input rows (a decode step of that many sequences) the native small GEMM
(kernels/small_gemm.c) reads each weight once, where MKL copies every weight into its panel layout
on each call before reading it again. On the default model's 24 layers and output head (2 GB of
float32 weights streamed per step, 2 threads, same run): 1 row 81 vs 81 ms (MKL's matrix-vector
product is as good), 8 rows 122 vs 224 ms, 32 rows 154 vs 217 ms. Prefill (over 64 rows, where
packing pays for itself) goes to a BLAS library, as below.

Where the kernel cannot be built (no C compiler or OpenMP), 16..64 rows go through MKL as W @ x^T,
which is 1.17x faster than x @ W^T there (457 -> 391 ms on the 32-sequence decode step).

More rows (prefill) go through oneDNN's matmul where torch has it, straight from the checkpoint's
weight: on an AMD EPYC (2 threads, the default model's four shapes at 512 rows, same run) 134 vs 105
GFLOP/s for MKL's, whose GEMM trails most on the wide gate/up weight (98 vs 125-134).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from slotserve.kernels import native, small_gemm

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not native.takes(x, self.weight):
            return super().forward(x)
        rows = x.shape[0]
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

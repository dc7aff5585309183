"""The model's linear layer: nn.Linear, with each CPU float32 call sent to a kernel by its row count and
the weight's form.

- A weight whose form packs (`pack`: GGUF's integer blocks, bfloat16 checkpoints; kernels/packed_linear.py)
  runs packed for the row counts its packing takes (`PackedWeight.runs`), with exact products: a narrow
  packing's 1..FEW_ROWS rows on the vector units of any CPU (kernels/few_rows.c, streaming a third of the
  float32 bytes), more rows, or a bfloat16 packing's from AMX_MIN_ROWS on, on AMX where the CPU has it.
- Other calls of NATIVE_ROWS (decode steps) go to the small GEMM (kernels/small_gemm.c), which reads each
  weight once, where a BLAS library copies every weight into its panel layout on each call before reading it
  again (8 rows of the default model's weights: 122 vs 224 ms a step). Where it is not built, TRANSPOSED_ROWS
  go through BLAS as W @ x^T, faster there than x @ W^T.
- More rows (prefill, where the panel copy pays for itself) go to oneDNN's matmul where torch has it, else to
  torch's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from slotserve.kernels import native, packed_linear, small_gemm

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
    packed: packed_linear.PackedWeight | None = None  # this layer's weight packed, where `pack` could

    def pack(self) -> bool:
        """Packs this layer's weight and bias where their form allows (kernels/packed_linear.py); whether it did."""
        self.packed = packed_linear.PackedWeight.pack(self.weight, self.bias)
        return self.packed is not None

    def current_packed(self) -> packed_linear.PackedWeight | None:
        """The packing of this layer's current weight and bias (None: none, or they were replaced since)."""
        packed = self.packed
        return packed if packed is not None and packed.weight is self.weight and packed.bias is self.bias else None

    def streamed_bytes(self, rows: int) -> int:
        """The weight bytes a call of this many rows reads: its packing's where that runs them."""
        packed = self.current_packed()
        return packed.nbytes if packed is not None and packed.runs(rows) else self.weight.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not native.takes(x, self.weight):
            return super().forward(x)
        rows = x.shape[0]
        if (packed := self.current_packed()) is not None and packed.runs(rows):
            return packed(x)
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

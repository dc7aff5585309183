"""The model's linear layer: nn.Linear, with each CPU float32 call sent to a kernel by its row count and
the weight's form.

- A layer loaded packed (a GGUF's tensors: `weight` None, `packed` the weight) runs every call on its packing;
  a float32 weight whose form packs (`pack`: integer blocks, bfloat16 checkpoints; quantization/packed_linear.py)
  runs packed for the row counts its packing takes (`PackedWeight.runs`): a narrow packing's rows on the
  vector units of any CPU (kernels/few_rows.c, streaming a third of the float32 bytes) or AMX, exactly, and
  from PANEL_ROWS on through unpacked panels; a bfloat16 packing's from AMX_MIN_ROWS on, on AMX.
- Other calls of NATIVE_ROWS (decode steps) go to the small GEMM (kernels/small_gemm.c), which reads each
  weight once, where a BLAS library copies every weight into its panel layout on each call before reading it
  again (8 rows of the default model's weights: 1.8x as fast a step). Where it is not built, TRANSPOSED_ROWS
  go through BLAS as W @ x^T, faster there than x @ W^T.
- More rows (prefill, where the panel copy pays for itself) go to oneDNN's matmul where torch has it, else to
  torch's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from slotserve.kernels import native, small_gemm
from slotserve.quantization import packed_linear

NATIVE_ROWS = range(1, 65)
TRANSPOSED_ROWS = range(16, 65)


def _onednn_linear() -> bool:
    """Whether torch ships oneDNN's linear (a CPU build with mkldnn, the op inductor uses)."""
    try:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._linear_pointwise.default is not None
    except (AttributeError, RuntimeError):
        return False


ONEDNN = _onednn_linear()


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank holds: [start, stop) along `dim`, of `full` (tensor parallel)."""

    dim: int
    start: int
    stop: int
    full: int

    @classmethod
    def of(cls, dim: int, full: int, rank: int, ranks: int) -> Shard:
        """Rank `rank`'s even part of `full` (which must divide by `ranks`)."""
        if full % ranks:
            raise ValueError(f"{full} does not split over {ranks} ranks")
        part = full // ranks
        return cls(dim, rank * part, (rank + 1) * part, full)

    @property
    def size(self) -> int:
        return self.stop - self.start


class Linear(nn.Linear):
    """`weight_shard`: the part of the checkpoint's weight this rank holds (tensor parallel): its rows (dim 0,
    column parallel: the bias shares them) or its columns (dim 1, row parallel: the caller sums the ranks'
    outputs); None: all of it."""

    weight_shard: Shard | None = None
    _gemm: small_gemm.BoundGemm | None = None  # the kernel bound to this layer's current weight and bias
    packed: packed_linear.PackedWeight | None = None  # this layer's weight packed, where `pack` could

    @classmethod
    def column_parallel(cls, in_features: int, out_features: int, bias: bool, rank: int, ranks: int) -> Linear:
        """This rank's rows of an `out_features` projection."""
        shard = Shard.of(0, out_features, rank, ranks)
        layer = cls(in_features, shard.size, bias=bias)
        layer.weight_shard = shard if ranks > 1 else None
        return layer

    @classmethod
    def row_parallel(cls, in_features: int, out_features: int, rank: int, ranks: int) -> Linear:
        """This rank's columns of an `in_features` projection (no bias: each rank's output is a partial sum)."""
        shard = Shard.of(1, in_features, rank, ranks)
        layer = cls(shard.size, out_features, bias=False)
        layer.weight_shard = shard if ranks > 1 else None
        return layer

    def pack(self) -> bool:
        """Packs this layer's weight and bias where their form allows (quantization/packed_linear.py); whether
        it did."""
        self.packed = packed_linear.PackedWeight.pack(self.weight, self.bias)
        return self.packed is not None

    def hold_packed(self, packed: packed_linear.PackedWeight) -> None:
        """Makes a checkpoint's packing this layer's weight: no float32 copy is kept."""
        if (packed.n, packed.k) != (self.out_features, self.in_features):
            raise ValueError(f"packed weight {(packed.n, packed.k)} does not fit a linear of "
                             f"{(self.out_features, self.in_features)}")
        self.weight, self.packed = None, packed

    def current_packed(self) -> packed_linear.PackedWeight | None:
        """The packing of this layer's current weight and bias (None: none, or they were replaced since)."""
        packed = self.packed
        return packed if packed is not None and packed.weight is self.weight and packed.bias is self.bias else None

    def streamed_bytes(self, rows: int) -> int:
        """The weight bytes a call of this many rows reads: its packing's where that runs them."""
        packed = self.current_packed()
        if packed is not None and (packed.runs(rows) or self.weight is None):
            return packed.nbytes
        return self.weight.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:  # a checkpoint's packing, for every call
            return self.packed(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)
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


class FloatLinear(Linear):
    """A Linear whose weight is never packed nor quantized to int8: it keeps float32 (a MoE router, where a small
    error flips a choice between experts), and its few-row calls take the small GEMM, as the fused decode step's do."""

    keeps_float = True  # what quantization/int8.py, below this package, goes by

    def pack(self) -> bool:
        return False


class MergedLinear(Linear):
    """Projections of one input stacked into one weight (attention's q, k and v; an MLP's gate and up): one
    call instead of two or three. Measured at batch 1 on CPU, each call costs 30-60 us of Python and
    dispatch besides its GEMM (several times its cost in a warm loop: the weights streamed between two
    calls push the interpreter's own data out of the caches), so the fewer the better.

    Checkpoints store the parts as separate tensors, named as sibling modules (`parts`); the loader
    copies each into its rows (`part_rows`), so this weight is a copy, never a view of the file. Under tensor
    parallel each part is its checkpoint tensor's rows `part_shards[i]` (column parallel)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], parts: Sequence[str], bias: bool,
                 part_shards: Sequence[Shard | None] | None = None) -> None:
        """output_sizes: each part's rows here (its shard's size, where sharded)."""
        if len(output_sizes) != len(parts):
            raise ValueError(f"parts: {len(parts)} names for {len(output_sizes)} output sizes")
        shards = list(part_shards) if part_shards is not None else [None] * len(parts)
        sizes_differ = any(s is not None and s.size != n for s, n in zip(shards, output_sizes, strict=False))
        if len(shards) != len(parts) or sizes_differ:
            raise ValueError(f"part_shards: {shards} do not match the output sizes {list(output_sizes)}")
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes, self.parts, self.part_shards = list(output_sizes), tuple(parts), shards

    def part_rows(self, i: int) -> slice:
        start = sum(self.output_sizes[:i])
        return slice(start, start + self.output_sizes[i])

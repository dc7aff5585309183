"""Linears on a packed weight (packed_linear.h), called from Python: `PackedWeight.pack(weight, bias)` packs a
float32 weight that is, in every block of 32 along a row, a scale times bfloat16 values, plus an offset or not
(a GGUF's Q8_0/Q5_0/Q4_K tensors, a bfloat16 checkpoint loaded in float32; packed_linear.c), or answers None
for any other weight; calling the packed weight is F.linear, with every product exact. Values that are all
small integers (GGUF's) are kept in 1 byte each (`narrow`), others in 2; the results are the same bits. Weights
with a scale per 16 (GGUF's Q6_K) pack in int8 `halves` for the few-row kernel alone.

Two kernels multiply by a packing: few_rows.c takes a narrow packing's calls of 1..FEW_ROWS rows on the vector
units of any CPU the kernels build on (VNNI or AVX2), amx_gemm.c the calls from AMX_MIN_ROWS rows on where the
CPU has AMX (`amx_available()`; Linux asks each process to request the tile registers; `SLOTSERVE_AMX=0` turns
AMX off). `PackedWeight.runs` says which row counts a packing takes; the float32 weight takes the rest.
`SLOTSERVE_PACK_WEIGHTS=0` keeps every linear on its float32 weights.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from slotserve import host_memory
from slotserve.kernels import native

PACK_SOURCE = Path(__file__).with_name("packed_linear.c")
FEW_ROWS_SOURCE = Path(__file__).with_name("few_rows.c")
AMX_SOURCE = Path(__file__).with_name("amx_gemm.c")
BLOCK, PAIR = 32, 32  # k per scale; weight rows per packed pair of tiles (packed_linear.h's)
# A bfloat16 packing's calls of fewer rows stay on the float32 kernel's dot-product form (small_gemm.c's 1..DOT_ROWS
# rows), AMX takes the rest. A narrow packing takes every row count: up to FEW_ROWS on few_rows.c.
AMX_MIN_ROWS = 12
FEW_ROWS = 4  # packed_linear.h's FEW
ALL_ROWS = 2**62  # max_rows where AMX runs
BYTES_PER_WEIGHT = 2 + 2 * 4 / BLOCK  # the most a packing keeps: a bfloat16, a scale and an offset per block
_PACK_ARGS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_long) + (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 3
_GEMM_ARGS = (ctypes.c_void_p,) * 4 + (ctypes.c_long,) * 3 + (ctypes.c_int,)  # both kernels'


class Packing(ctypes.Structure):
    """packed_linear.h's slotserve_packed_weight: a packed weight's buffers (NULL values: not packed)."""

    _fields_ = [("values", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("narrow", ctypes.c_int), ("halves", ctypes.c_int), ("min_rows", ctypes.c_long),
                ("max_rows", ctypes.c_long)]


@functools.cache
def amx_available() -> bool:
    """Whether AMX runs here: packings then take every row count their form is worth."""
    if os.environ.get("SLOTSERVE_AMX", "1") == "0" or not packs():
        return False
    init = native.function(AMX_SOURCE, "slotserve_amx_init", ())
    return init is not None and init() == 0


@functools.cache
def packs() -> bool:
    """Whether weights are packed here at all: where AMX is not, narrow ones for the few-row kernel."""
    return (os.environ.get("SLOTSERVE_PACK_WEIGHTS", "1") != "0"
            and native.function(PACK_SOURCE, "slotserve_pack_weight", _PACK_ARGS) is not None
            and native.function(FEW_ROWS_SOURCE, "slotserve_few_rows_gemm", _GEMM_ARGS) is not None)


class PackedWeight:
    """One linear's weight (and bias) packed for the packed kernels (few_rows.c; amx_gemm.c where AMX runs);
    holds the float32 weight it was packed from, which is what a caller compares to see whether the module
    still holds it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, values: torch.Tensor,
                 scales: torch.Tensor, offsets: torch.Tensor | None, halves: bool = False) -> None:
        self.weight, self.bias, self.values, self.scales, self.offsets = weight, bias, values, scales, offsets
        self.n, self.k = weight.shape
        self.narrow, self.halves = values.dtype == torch.int8, halves
        self.max_rows = ALL_ROWS if amx_available() and not halves else FEW_ROWS
        self.packing = Packing(values.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
                               self.narrow, halves, AMX_MIN_ROWS, self.max_rows)
        self._few_rows = native.function(FEW_ROWS_SOURCE, "slotserve_few_rows_gemm", _GEMM_ARGS)
        self._amx = native.function(AMX_SOURCE, "slotserve_amx_gemm", _GEMM_ARGS) if amx_available() else None

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, narrow: bool = True) -> PackedWeight | None:
        """The packed weight, in int8 values where every block allows and `narrow` asks, else bfloat16 ones
        (where AMX runs: nothing else would read them); without offsets where every block allows. Failing those,
        int8 values under a scale per half block (GGUF's Q6_K: for the few-row kernel only). None where some
        block has no such form, or nothing here would run it."""
        amx = amx_available()
        if (not (packs() and (amx or narrow)) or weight.dim() != 2 or weight.shape[1] % BLOCK
                or not native.takes(weight)):
            return None
        if bias is not None and (bias.shape != weight.shape[:1] or not native.takes(bias)):
            raise ValueError(f"packed_linear: bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
        weight = weight.contiguous()
        n, k = weight.shape
        scalars = -(-n // PAIR) * PAIR * (k // BLOCK)
        pack = native.require(native.function(PACK_SOURCE, "slotserve_pack_weight", _PACK_ARGS), PACK_SOURCE)
        values = {}
        for halves in (False, True) if narrow else (False,):
            scales = torch.empty(scalars * (2 if halves else 1))
            for offsets in (None, torch.empty_like(scales)):
                for dtype in (torch.int8,) * narrow + (torch.int16,) * (amx and not halves):
                    if dtype not in values:  # what a step streams
                        values[dtype] = host_memory.zeros((scalars * BLOCK,), dtype, weight.device)
                    fit = pack(weight.data_ptr(), n, k, None if offsets is None else offsets.data_ptr(),
                               values[dtype].data_ptr(), scales.data_ptr(), dtype == torch.int8, halves,
                               torch.get_num_threads())
                    if fit == 0:
                        return cls(weight, None if bias is None else bias.contiguous(), values[dtype], scales,
                                   offsets, halves)
                    if fit == -1:  # a block without a form: wider values cannot help
                        break
        return None

    @property
    def nbytes(self) -> int:
        """What a call streams of the packing: its values, scales and offsets."""
        return sum(t.nbytes for t in (self.values, self.scales, self.offsets) if t is not None)

    def runs(self, rows: int) -> bool:
        """Whether a call with this many rows is worth the packing (the caller's float32 path takes the rest):
        AMX from AMX_MIN_ROWS rows on, any rows of a narrow packing (up to FEW_ROWS on few_rows.c, which streams
        its 1-byte values; AMX from there on). Without AMX, or in halves: those few rows."""
        return (rows >= AMX_MIN_ROWS or (self.narrow and rows > 0)) and rows <= self.max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ weight^T + bias."""
        if x.dim() != 2 or x.shape[1] != self.k or not native.takes(x):
            raise ValueError(f"packed_linear: x {tuple(x.shape)} {x.dtype} on {x.device} does not multiply a "
                             f"float32 CPU weight of {self.k} columns")
        x, rows = x.contiguous(), x.shape[0]
        out = torch.empty(rows, self.n)
        gemm = self._few_rows if self.narrow and rows <= FEW_ROWS else self._amx
        bias = None if self.bias is None else self.bias.data_ptr()
        fit = -2 if gemm is None else gemm(x.data_ptr(), ctypes.byref(self.packing), bias, out.data_ptr(), rows,
                                           self.n, self.k, torch.get_num_threads())
        if fit == -2:
            raise ValueError(f"packed_linear: this packing does not run {rows} rows here (see runs())")
        if fit:
            raise MemoryError(f"packed_linear: no memory to split a {tuple(x.shape)} input")
        return out

"""Float32 linears through AMX with exact products (amx_gemm.c), called from Python.

`AmxWeight.pack(weight, bias)` packs a float32 weight that is, in every block of 32 along a row, a scale
times bfloat16 values, plus an offset or not (a GGUF's Q8_0/Q5_0/Q4_K tensors, a bfloat16 checkpoint loaded
in float32), or answers None for any other weight; calling the packed weight is F.linear. Values that are
all small integers (GGUF's) are kept in 1 byte each (`narrow`), others in 2; the results are the same bits.
Weights with a scale per 16 (GGUF's Q6_K) pack in int8 `halves` for the few-row kernel alone.
`available()` says whether this CPU and kernel run AMX (Linux asks each process to request the tile
registers; `SLOTSERVE_AMX=0` turns AMX off). Without AMX a narrow packing still serves steps of 1..FEW_ROWS
rows, on the vector units (any CPU the kernels build on; `SLOTSERVE_PACK_WEIGHTS=0` keeps every linear on
its float32 weights).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from slotserve import host_memory
from slotserve.kernels import native

SOURCE = Path(__file__).with_name("amx_gemm.c")
BLOCK, PAIR = 32, 32  # k per scale; weight rows per packed pair of tiles
# Fewer rows of a bfloat16 packing stay on the FMA kernel (small_gemm.c): faster there against the first AMX
# kernels, no longer (layers/linear.py has the figures); 12 is where its broadcast form starts too
# (small_gemm.c's DOT_ROWS + 1). A narrow packing takes every row count: up to FEW_ROWS on the vector units.
MIN_ROWS = 12
FEW_ROWS = 4  # amx_gemm.c's FEW
ALL_ROWS = 2**62  # max_rows where AMX runs
BYTES_PER_WEIGHT = 2 + 2 * 4 / BLOCK  # the most a packing keeps: a bfloat16, a scale and an offset per block
_PACK_ARGS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_long) + (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 3
_GEMM_ARGS = (ctypes.c_void_p,) * 4 + (ctypes.c_long,) * 3 + (ctypes.c_int,)


class Packing(ctypes.Structure):
    """amx_gemm.c's slotserve_amx_weight: a packed weight's buffers (NULL values: not packed)."""

    _fields_ = [("values", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("narrow", ctypes.c_int), ("halves", ctypes.c_int), ("min_rows", ctypes.c_long),
                ("max_rows", ctypes.c_long)]


@functools.cache
def available() -> bool:
    """Whether AMX runs here: packings then take every row count their form is worth."""
    if os.environ.get("SLOTSERVE_AMX", "1") == "0" or not packs():
        return False
    init = native.function(SOURCE, "slotserve_amx_init", ())
    return init is not None and init() == 0


@functools.cache
def packs() -> bool:
    """Whether weights are packed here at all: where AMX is not, narrow ones for the few-row kernel."""
    return (os.environ.get("SLOTSERVE_PACK_WEIGHTS", "1") != "0"
            and native.function(SOURCE, "slotserve_amx_pack", _PACK_ARGS) is not None)


class AmxWeight:
    """One linear's weight (and bias) packed for amx_gemm.c (AMX, or its few-row kernel); holds the float32
    weight it was packed from, which is what a caller compares to see whether the module still holds it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, values: torch.Tensor,
                 scales: torch.Tensor, offsets: torch.Tensor | None, halves: bool = False) -> None:
        self.weight, self.bias, self.values, self.scales, self.offsets = weight, bias, values, scales, offsets
        self.n, self.k = weight.shape
        self.narrow, self.halves = values.dtype == torch.int8, halves
        self.max_rows = ALL_ROWS if available() and not halves else FEW_ROWS
        self.packing = Packing(values.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
                               self.narrow, halves, MIN_ROWS, self.max_rows)
        self._gemm = native.require(native.function(SOURCE, "slotserve_amx_gemm", _GEMM_ARGS), SOURCE)

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, narrow: bool = True) -> AmxWeight | None:
        """The packed weight, in int8 values where every block allows and `narrow` asks, else bfloat16 ones
        (where AMX runs: nothing else would read them); without offsets where every block allows. Failing those,
        int8 values under a scale per half block (GGUF's Q6_K: for the few-row kernel only). None where some
        block has no such form, or nothing here would run it."""
        amx = available()
        if (not (packs() and (amx or narrow)) or weight.dim() != 2 or weight.shape[1] % BLOCK
                or not native.takes(weight)):
            return None
        if bias is not None and (bias.shape != weight.shape[:1] or not native.takes(bias)):
            raise ValueError(f"amx_gemm: bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
        weight = weight.contiguous()
        n, k = weight.shape
        scalars = -(-n // PAIR) * PAIR * (k // BLOCK)
        pack = native.require(native.function(SOURCE, "slotserve_amx_pack", _PACK_ARGS), SOURCE)
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
        AMX from MIN_ROWS rows on, any rows of a narrow packing (up to FEW_ROWS on the vector units, which
        stream its 1-byte values: few_rows.c; AMX from there on). Without AMX, or in halves: those
        few rows."""
        return (rows >= MIN_ROWS or (self.narrow and rows > 0)) and rows <= self.max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ weight^T + bias."""
        if x.dim() != 2 or x.shape[1] != self.k or not native.takes(x):
            raise ValueError(f"amx_gemm: x {tuple(x.shape)} {x.dtype} on {x.device} does not multiply a float32 "
                             f"CPU weight of {self.k} columns")
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.n)
        bias = None if self.bias is None else self.bias.data_ptr()
        fit = self._gemm(x.data_ptr(), ctypes.byref(self.packing), bias, out.data_ptr(), x.shape[0], self.n, self.k,
                         torch.get_num_threads())
        if fit == -2:
            raise ValueError(f"amx_gemm: this packing does not run {x.shape[0]} rows here (see runs())")
        if fit:
            raise MemoryError(f"amx_gemm: no memory to split a {tuple(x.shape)} input")
        return out

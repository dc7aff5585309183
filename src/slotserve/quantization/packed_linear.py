"""Linears on a packed weight (packed_linear.h), called from Python: `PackedWeight.pack(weight, bias)` packs a
float32 weight that is, in every block of 32 along a row, a scale times bfloat16 values, plus an offset or not
(a GGUF's Q8_0/Q5_0/Q4_K tensors, a bfloat16 checkpoint loaded in float32; packed_linear.c), or answers None
for any other weight. Values that are all small integers (GGUF's) are kept in 1 byte each (`narrow`), others in
2; the results are the same bits. Weights with a scale per 16 (GGUF's Q6_K) pack in int8 `halves`. A narrow
packing is a weight by itself (a GGUF model keeps no float32 copy: `PackedWeight.weight` is None then); a
bfloat16 one runs beside its float32 weight, for the rows AMX takes.

Three ways multiply by a narrow packing, by the call's rows:
- few_rows.c, on the vector units of any CPU the kernels build on (VNNI or AVX2), FEW_ROWS rows at a time, with
  exact products: calls below AMX's (all of them without AMX, or in halves) and below PANEL_ROWS; where AMX runs,
  calls of TILE_ROWS rows take the same integer products on its int8 tiles (`digit_tiles_available()`): the same
  bits, so every call up to TILE_ROWS' end gives a row the bits it gets alone;
- amx_gemm.c where the CPU has AMX (`amx_available()`; Linux asks each process to request the tile registers;
  `SLOTSERVE_AMX=0` turns AMX off), also exact, past those rows;
- from PANEL_ROWS rows on (prefill), torch's GEMM on panels of the weight unpacked as it goes: in bfloat16
  where the CPU has bfloat16 units (`panel_dtype()`; AMX, AVX512-BF16), the weights and activations rounded to
  bfloat16, else in float32, exact weights.
`SLOTSERVE_PACK_WEIGHTS=0` keeps every linear of a float32 checkpoint on its float32 weights.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

from slotserve import envs, host_memory
from slotserve.config import PrefillPrecision
from slotserve.kernels import native
from slotserve.kernels.packing import Packing
from slotserve.quantization.packed_tensor import (
    BLOCK,
    BYTE_ZERO,
    CHUNK_BITS,
    PAIR,
    SCALE_GROUP,
    TILE,
    PackedTensor,
    Scales,
)

__all__ = ["BLOCK", "PAIR", "TILE", "PackedTensor", "PackedWeight", "Scales"]

PACK_SOURCE = native.SOURCE_DIR / "packed_linear.c"
FEW_ROWS_SOURCE = native.SOURCE_DIR / "few_rows.c"
AMX_SOURCE = native.SOURCE_DIR / "amx_gemm.c"
# A bfloat16 packing's calls of fewer rows stay on the float32 kernel's dot-product form (small_gemm.c's 1..DOT_ROWS
# rows), AMX takes the rest. A narrow packing takes every row count: up to FEW_ROWS on few_rows.c.
AMX_MIN_ROWS = 12
FEW_ROWS = 4  # packed_linear.h's FEW
# The calls few_rows.c multiplies on AMX's int8 tiles where it can (AMX's bfloat16 path takes narrow packings from
# their end on): on a 2-vCPU Xeon the 1.5B's decode step of 5 rows takes 2.0x one row's time there, 3.1x before;
# fewer rows stream faster on the vector units, more on the bfloat16 tiles.
TILE_ROWS = range(3, 17)
ALL_ROWS = 2**62  # max_rows: every row count
# From this many rows on, a call multiplies unpacked panels: on a 2-vCPU Xeon with AMX a 512-row call of the
# default model's gate/up runs 4.5x faster in bfloat16 panels than in float32.
PANEL_ROWS = 64
PANEL_BYTES = 2 << 20  # a panel's size: it stays in L2/L3 while torch's GEMM reads it
BYTES_PER_WEIGHT = 2 + 2 * 4 / BLOCK  # the most a packing keeps: a bfloat16, a scale and an offset per block
_PACK_ARGS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_long) + (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 3
_GEMM_ARGS = (ctypes.c_void_p,) * 4 + (ctypes.c_long,) * 3 + (ctypes.c_int,)  # both kernels'
_ROWS_ARGS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int)
_PANEL_ARGS = (ctypes.c_void_p,) + (ctypes.c_long,) * 3 + (ctypes.c_void_p, ctypes.c_long) + (ctypes.c_int,) * 2


@functools.cache
def amx_available() -> bool:
    """Whether AMX runs here: packings then take every row count their form is worth."""
    if not envs.amx() or not built():
        return False
    init = native.function(AMX_SOURCE, "slotserve_amx_init", ())
    return init is not None and init() == 0


@functools.cache
def digit_tiles_available() -> bool:
    """Whether few_rows.c takes products on AMX's int8 tiles here (its build has them and AMX runs)."""
    tiles = native.function(FEW_ROWS_SOURCE, "slotserve_few_rows_tiles", ())
    return amx_available() and tiles is not None and tiles() == 1


def panel_dtype(precision: PrefillPrecision = PrefillPrecision.AUTO) -> torch.dtype:
    """What calls of PANEL_ROWS rows or more multiply in, by the engine's choice; AUTO: bfloat16 where the CPU has
    bfloat16 dot products (AMX, AVX512-BF16), else float32."""
    if precision is PrefillPrecision.AUTO:
        return torch.bfloat16 if _bfloat16_units() else torch.float32
    return torch.bfloat16 if precision is PrefillPrecision.BFLOAT16 else torch.float32


@functools.cache
def _bfloat16_units() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return bool({"amx_bf16", "avx512_bf16"} & set(flags))


@functools.cache
def built() -> bool:
    """Whether the packed kernels build here (a checkpoint's packings need them)."""
    return (native.function(PACK_SOURCE, "slotserve_pack_weight", _PACK_ARGS) is not None
            and native.function(FEW_ROWS_SOURCE, "slotserve_few_rows_gemm", _GEMM_ARGS) is not None)


def pack_narrow(weight: torch.Tensor) -> PackedTensor | None:
    """A float32 weight [n, k] packed narrow (packed_linear.c's fit: exact) in the fewest bits its values take,
    the buffers as a checkpoint keeps them; None where some block has no narrow form or the kernels are not
    built."""
    if not built() or weight.dim() != 2 or not native.takes(weight):
        return None
    fit = _fit(weight.contiguous(), narrow=True, wide=False)
    return None if fit is None else PackedWeight(None, None, *fit).tensor().compact()


def _fit(weight: torch.Tensor, narrow: bool, wide: bool) -> tuple | None:
    """PackedWeight's buffers and shape (values, scales, offsets, n, k, halves) for a contiguous float32 weight,
    in the first form that fits: int8 values (where `narrow`), then bfloat16 ones (where `wide`), each without
    offsets, then with; failing those, int8 under a scale per half block. None where none fits."""
    n, k = weight.shape
    if k % BLOCK:
        return None
    scalars = -(-n // PAIR) * PAIR * (k // BLOCK)
    pack = native.require(native.function(PACK_SOURCE, "slotserve_pack_weight", _PACK_ARGS), PACK_SOURCE)
    values = {}
    for halves in (False, True) if narrow else (False,):
        scales = torch.empty(scalars * (2 if halves else 1))
        for offsets in (None, torch.empty_like(scales)):
            for dtype in (torch.int8,) * narrow + (torch.int16,) * (wide and not halves):
                if dtype not in values:  # what a step streams
                    values[dtype] = host_memory.zeros((scalars * BLOCK,), dtype, weight.device)
                fit = pack(weight.data_ptr(), n, k, None if offsets is None else offsets.data_ptr(),
                           values[dtype].data_ptr(), scales.data_ptr(), dtype == torch.int8, halves,
                           torch.get_num_threads())
                if fit == 0:
                    return values[dtype], scales, offsets, n, k, halves
                if fit == -1:  # a block without a form: wider values cannot help
                    break
    return None


def packs() -> bool:
    """Whether a float32 checkpoint's weights are packed here: where AMX is not, narrow ones only."""
    return envs.pack_weights() and built()


_workspace = threading.local()  # each thread's panel, kept: a new one per call would fault its pages in again


def _panel(k: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's panel buffer as [k, columns] of `dtype`, grown where it is too small."""
    need = k * columns * dtype.itemsize
    buffer = getattr(_workspace, "panel", None)
    if buffer is None or buffer.numel() < need:
        buffer = _workspace.panel = torch.empty(need, dtype=torch.uint8)
    return buffer[:need].view(dtype).view(k, columns)


class PackedWeight:
    """One linear's weight (and bias) packed for the packed kernels (few_rows.c; amx_gemm.c where AMX runs);
    holds the float32 weight it was packed from (None: a checkpoint's packing, no float32 weight), which is what a
    caller compares to see whether the module still holds it."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, values: torch.Tensor,
                 scales: torch.Tensor, offsets: torch.Tensor | None, n: int, k: int, halves: bool = False,
                 zero: int = BYTE_ZERO, scale_factors: torch.Tensor | None = None,
                 offset_factors: torch.Tensor | None = None) -> None:
        self.weight, self.bias, self.values, self.scales, self.offsets = weight, bias, values, scales, offsets
        self.scale_factors, self.offset_factors = scale_factors, offset_factors
        self.n, self.k, self.zero = n, k, zero
        self.narrow, self.halves = values.dtype in (torch.int8, torch.uint8), halves
        self.bits = CHUNK_BITS[values.numel() // (-(-n // PAIR) * (k // BLOCK))] if self.narrow else 16
        amx, tiles = amx_available() and not halves, self.narrow and digit_tiles_available()
        self.tile_rows = TILE_ROWS.start if tiles else 0
        few = TILE_ROWS.stop - 1 if tiles else FEW_ROWS  # the most rows of a narrow packing on few_rows.c
        self.min_rows = (few + 1 if self.narrow else AMX_MIN_ROWS) if amx else ALL_ROWS
        self.max_rows = ALL_ROWS if self.narrow or amx else 0
        self.packing = Packing(values.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
                               self.narrow, halves, self.min_rows, self.max_rows, self.bits, zero,
                               *(None if t is None else t.data_ptr() for t in (scale_factors, offset_factors)),
                               *(0 if t is None else t.element_size() for t in (scales, offsets)), self.tile_rows)
        self.panel_dtype = panel_dtype()  # the engine's PrefillPrecision sets it (models/packing.py)
        self._few_rows = native.function(FEW_ROWS_SOURCE, "slotserve_few_rows_gemm", _GEMM_ARGS)
        self._amx = native.function(AMX_SOURCE, "slotserve_amx_gemm", _GEMM_ARGS) if amx_available() else None

    @classmethod
    def of(cls, tensor: PackedTensor, bias: torch.Tensor | None = None) -> PackedWeight:
        """A checkpoint's packing as a weight by itself."""
        if not built():
            raise native.KernelUnavailableError("packed weights need the native kernels (packed_linear.c, few_rows.c): "
                                                "a C compiler with OpenMP")
        if bias is not None and bias.shape != (tensor.n,):
            raise ValueError(f"packed_linear: bias {tuple(bias.shape)} does not fit weight {(tensor.n, tensor.k)}")
        parts = {name: t.contiguous() for name, t in tensor.buffers.items()}
        return cls(None, None if bias is None else bias.contiguous(), parts["values"], parts["scales"],
                   parts.get("offsets"), tensor.n, tensor.k, tensor.halves, tensor.zero, parts.get("scale_factors"),
                   parts.get("offset_factors"))

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, narrow: bool = True) -> PackedWeight | None:
        """The packed weight, in int8 values where every block allows and `narrow` asks, else bfloat16 ones
        (where AMX runs: nothing else would read them); without offsets where every block allows. Failing those,
        int8 values under a scale per half block (GGUF's Q6_K). None where some block has no such form, or
        nothing here would run it."""
        amx = amx_available()
        if not (packs() and (amx or narrow)) or weight.dim() != 2 or not native.takes(weight):
            return None
        if bias is not None and (bias.shape != weight.shape[:1] or not native.takes(bias)):
            raise ValueError(f"packed_linear: bias {tuple(bias.shape)} does not fit weight {tuple(weight.shape)}")
        fit = _fit(weight.contiguous(), narrow, amx)
        return None if fit is None else cls(weight.contiguous(), None if bias is None else bias.contiguous(), *fit)

    def tensor(self) -> PackedTensor:
        """A narrow packing's buffers in their checkpoint shapes (views)."""
        pairs, blocks, segments = -(-self.n // PAIR), self.k // BLOCK, 2 if self.halves else 1
        shape, groups = (pairs, blocks, segments, PAIR), -(-blocks // SCALE_GROUP)

        def scales(codes: torch.Tensor, factors: torch.Tensor | None) -> Scales:
            return Scales(codes.view(shape), None if factors is None else factors.view(pairs, groups, PAIR))

        return PackedTensor(self.values.view(torch.uint8).view(pairs, blocks, -1),
                            scales(self.scales, self.scale_factors),
                            None if self.offsets is None else scales(self.offsets, self.offset_factors),
                            self.n, self.k, self.zero)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Its values, scales and offsets (and their factors)."""
        return [t for t in (self.values, self.scales, self.offsets, self.scale_factors, self.offset_factors)
                if t is not None]

    @property
    def nbytes(self) -> int:
        """What a call streams of the packing: its buffers."""
        return sum(t.nbytes for t in self.buffers)

    def runs(self, rows: int) -> bool:
        """Whether a call with this many rows is worth the packing (the caller's float32 path takes the rest):
        any rows of a narrow packing (but where a float32 weight is beside it, panels in float32 would only
        unpack it again); a bfloat16 packing's from AMX_MIN_ROWS on, where AMX runs."""
        if rows <= 0:
            return False
        if not self.narrow:
            return self.min_rows <= rows <= self.max_rows
        return not (rows >= PANEL_ROWS and self.weight is not None and self.panel_dtype == torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ weight^T + bias."""
        if x.dim() != 2 or x.shape[1] != self.k or not native.takes(x):
            raise ValueError(f"packed_linear: x {tuple(x.shape)} {x.dtype} on {x.device} does not multiply a "
                             f"float32 CPU weight of {self.k} columns")
        x, rows = x.contiguous(), x.shape[0]
        if rows == 0:
            return torch.empty(0, self.n)
        if self.narrow and rows >= PANEL_ROWS:
            return self._panels(x)
        out = torch.empty(rows, self.n)
        gemm = self._few_rows if self.narrow and rows < self.min_rows else self._amx
        bias = None if self.bias is None else self.bias.data_ptr()
        fit = -2 if gemm is None or not self.runs(rows) else gemm(
            x.data_ptr(), ctypes.byref(self.packing), bias, out.data_ptr(), rows, self.n, self.k,
            torch.get_num_threads())
        if fit == -2:
            raise ValueError(f"packed_linear: this packing does not run {rows} rows here (see runs())")
        if fit:
            raise MemoryError(f"packed_linear: no memory to split a {tuple(x.shape)} input")
        return out

    def _panels(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight^T + bias through torch's GEMM, a panel of the weight's rows unpacked at a time."""
        dtype = self.panel_dtype
        unpack = native.require(native.function(PACK_SOURCE, "slotserve_unpack_panel", _PANEL_ARGS), PACK_SOURCE)
        pairs = -(-self.n // PAIR)
        step = max(1, PANEL_BYTES // (self.k * PAIR * dtype.itemsize))
        xs = x.to(dtype)
        out = torch.empty(x.shape[0], self.n)
        panel = _panel(self.k, min(step, pairs) * PAIR, dtype)
        for first in range(0, pairs, step):
            count = min(step, pairs - first)
            unpack(ctypes.byref(self.packing), self.k, first, count, panel.data_ptr(), panel.shape[1],
                   dtype == torch.bfloat16, torch.get_num_threads())
            lo, hi = first * PAIR, min((first + count) * PAIR, self.n)
            out[:, lo:hi] = torch.mm(xs, panel[:, :hi - lo])
        return out if self.bias is None else out.add_(self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight's rows `ids` (int64, each in [0, n)) as float32 [len(ids), k]: an embedding's lookup."""
        if not self.narrow:
            raise ValueError("packed_linear: only a narrow packing's rows are looked up")
        ids = ids.to(torch.long).contiguous()
        out = torch.empty(len(ids), self.k)
        unpack = native.require(native.function(PACK_SOURCE, "slotserve_unpack_rows", _ROWS_ARGS), PACK_SOURCE)
        unpack(ctypes.byref(self.packing), self.k, ids.data_ptr(), len(ids), out.data_ptr(), torch.get_num_threads())
        return out

    def dequantize(self) -> torch.Tensor:
        """The whole weight as float32 [n, k]: exactly the weight it was packed from."""
        return self.rows(torch.arange(self.n))

"""Linears on a packed weight (packed_linear.h), called from Python: `PackedWeight.pack(weight, bias)` packs a
float32 weight that is, in every block of 32 along a row, a scale times bfloat16 values, plus an offset or not
(a GGUF's Q8_0/Q5_0/Q4_K tensors, a bfloat16 checkpoint loaded in float32; packed_linear.c), or answers None
for any other weight. Values that are all small integers (GGUF's) are kept in 1 byte each (`narrow`), others in
2; the results are the same bits. Weights with a scale per 16 (GGUF's Q6_K) pack in int8 `halves`. A narrow
packing is a weight by itself (a GGUF model keeps no float32 copy: `PackedWeight.weight` is None then); a
bfloat16 one runs beside its float32 weight, for the rows AMX takes.

Three ways multiply by a narrow packing, by the call's rows:
- few_rows.c, on the vector units of any CPU the kernels build on (VNNI or AVX2), FEW_ROWS rows at a time, with
  exact products: calls below AMX's (all of them without AMX, or in halves) and below PANEL_ROWS;
- amx_gemm.c where the CPU has AMX (`amx_available()`; Linux asks each process to request the tile registers;
  `SLOTSERVE_AMX=0` turns AMX off), also exact, from FEW_ROWS + 1 rows on;
- from PANEL_ROWS rows on (prefill), torch's GEMM on panels of the weight unpacked as it goes: in bfloat16
  where the CPU has bfloat16 units (`panel_dtype()`; AMX, AVX512-BF16), the weights and activations rounded to
  bfloat16, else in float32, exact weights.
`SLOTSERVE_PACK_WEIGHTS=0` keeps every linear of a float32 checkpoint on its float32 weights.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from slotserve import host_memory
from slotserve.config import PrefillPrecision
from slotserve.kernels import native

PACK_SOURCE = Path(__file__).with_name("packed_linear.c")
FEW_ROWS_SOURCE = Path(__file__).with_name("few_rows.c")
AMX_SOURCE = Path(__file__).with_name("amx_gemm.c")
BLOCK, PAIR, TILE = 32, 32, 16  # k per scale; weight rows per packed pair of tiles, per tile (packed_linear.h's)
# A bfloat16 packing's calls of fewer rows stay on the float32 kernel's dot-product form (small_gemm.c's 1..DOT_ROWS
# rows), AMX takes the rest. A narrow packing takes every row count: up to FEW_ROWS on few_rows.c.
AMX_MIN_ROWS = 12
FEW_ROWS = 4  # packed_linear.h's FEW
ALL_ROWS = 2**62  # max_rows: every row count
# From this many rows on, a call multiplies unpacked panels: on this file's first AMX machine a 512-row call of
# the default model's gate/up ran 4.5x faster in bfloat16 panels than in float32.
PANEL_ROWS = 64
PANEL_BYTES = 2 << 20  # a panel's size: it stays in L2/L3 while torch's GEMM reads it
BYTES_PER_WEIGHT = 2 + 2 * 4 / BLOCK  # the most a packing keeps: a bfloat16, a scale and an offset per block
_PACK_ARGS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_long) + (ctypes.c_void_p,) * 3 + (ctypes.c_int,) * 3
_GEMM_ARGS = (ctypes.c_void_p,) * 4 + (ctypes.c_long,) * 3 + (ctypes.c_int,)  # both kernels'
_ROWS_ARGS = (ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int)
_PANEL_ARGS = (ctypes.c_void_p,) + (ctypes.c_long,) * 3 + (ctypes.c_void_p, ctypes.c_long) + (ctypes.c_int,) * 2


class Packing(ctypes.Structure):
    """packed_linear.h's slotserve_packed_weight: a packed weight's buffers (NULL values: not packed)."""

    _fields_ = [("values", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("narrow", ctypes.c_int), ("halves", ctypes.c_int), ("min_rows", ctypes.c_long),
                ("max_rows", ctypes.c_long), ("bits", ctypes.c_int), ("zero", ctypes.c_int)]


@functools.cache
def amx_available() -> bool:
    """Whether AMX runs here: packings then take every row count their form is worth."""
    if os.environ.get("SLOTSERVE_AMX", "1") == "0" or not built():
        return False
    init = native.function(AMX_SOURCE, "slotserve_amx_init", ())
    return init is not None and init() == 0


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
    return os.environ.get("SLOTSERVE_PACK_WEIGHTS", "1") != "0" and built()


CHUNK_BITS = {2 * TILE * BLOCK: 8, TILE * BLOCK + 2 * TILE * BLOCK // 8: 5, TILE * BLOCK: 4}  # a pair's block's bytes
BYTE_ZERO = 128  # what an 8-bit packing adds to its values
_ENCODE_PAIRS = 4096  # pairs re-encoded at a time


def _nibbles(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Values in the 8-bit layout (u = v + zero, uint8 [..., 2 * TILE * BLOCK]) as packed_linear.h's `bits` layout."""
    lines = u.view(*u.shape[:-1], 2, BLOCK // 8, 2, 4 * TILE)  # [tile][k-quad pair][k-quad parity][line]
    nibbles = ((lines[..., 0, :] & 15) | (lines[..., 1, :] << 4)).reshape(*u.shape[:-1], TILE * BLOCK)
    if bits == 4:
        return nibbles
    fifth = (u >> 4 & 1).view(*u.shape[:-1], -1, 8) << torch.arange(8, dtype=torch.uint8)
    return torch.cat([nibbles, fifth.sum(-1, dtype=torch.uint8)], dim=-1)


def _bytes(chunks: torch.Tensor) -> torch.Tensor:
    """_nibbles undone: a compact layout's chunks as 8-bit layout's (u = v + zero, uint8)."""
    lead, bits = chunks.shape[:-1], CHUNK_BITS[chunks.shape[-1]]
    nibbles = chunks[..., :TILE * BLOCK].reshape(*lead, 2, BLOCK // 8, 1, 4 * TILE)
    u = torch.cat([nibbles & 15, nibbles >> 4], dim=-2).reshape(*lead, 2 * TILE * BLOCK)
    if bits == 5:
        plane = chunks[..., TILE * BLOCK:].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8) & 1
        u |= plane.reshape(u.shape) << 4
    return u


def _indexed_runs(values: torch.Tensor):
    """values' pairs, _ENCODE_PAIRS at a time (at least one run), with the first pair's index: the intermediates
    of re-encoding stay ~100 MB whatever the tensor."""
    return ((i, values[i:i + _ENCODE_PAIRS]) for i in range(0, max(len(values), 1), _ENCODE_PAIRS))


def _runs(values: torch.Tensor):
    return (run for _, run in _indexed_runs(values))


def _in_runs(values: torch.Tensor, f) -> torch.Tensor:
    """f over the pairs of values, in runs."""
    return torch.cat([f(run) for run in _runs(values)])


def _segment_range(run: torch.Tensor, segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The least and the largest value of each block (or half block) of an 8-bit layout's run of pairs, as
    [pairs, blocks, segments, PAIR] (the scales' shape)."""
    v = run.view(*run.shape[:2], 2, segments, -1, TILE, 4)  # [pair][block][tile][segment][k-quad][row][4]
    low, high = v.amin(dim=(4, 6)), v.amax(dim=(4, 6))  # [pair][block][tile][segment][row]
    shape = (*run.shape[:2], segments, 2 * TILE)
    low, high = ((t.to(torch.int16) - BYTE_ZERO).permute(0, 1, 3, 2, 4).reshape(shape) for t in (low, high))
    return low, high


@dataclass(frozen=True)
class PackedTensor:
    """A narrow packing's buffers as a checkpoint stores them (packed_linear.h's layouts): `values` uint8
    [pairs, blocks, bytes] (2 * TILE * BLOCK bytes: 8 bits a value; fewer: 5 or 4, CHUNK_BITS), each value kept
    plus `zero`; `scales` and `offsets` (None: no offsets) float32 [pairs, blocks, halves, PAIR] (halves 2 where
    each half block has its own), of an [n, k] weight."""

    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    n: int
    k: int
    zero: int = BYTE_ZERO

    @property
    def halves(self) -> bool:
        return self.scales.shape[2] == 2

    @property
    def bits(self) -> int:
        return CHUNK_BITS[self.values.shape[-1]]

    def compact(self) -> PackedTensor:
        """The same weight in the fewest bits (4, 5 or 8) that hold each block's values, or their negation (its
        scale negated too: the same products and sums, negated twice; GGUF's Q5_0 scales have either sign), and
        a padding row's 0 within one window [-zero, 2^bits - 1 - zero]."""
        if self.bits != 8:
            return self
        segments = self.scales.shape[2]
        lows, highs = zip(*(_segment_range(run, segments) for run in _runs(self.values)), strict=True)
        low, high = torch.cat(lows), torch.cat(highs)
        for bits in (4, 5):
            span = 2**bits - 1
            for start in dict.fromkeys((min(int(low.min()), 0), -(span + 1) // 2, 0)):
                flip = ~((low >= start) & (high <= start + span))
                if ((-high >= start) & (-low <= start + span) | ~flip).all():
                    return self._encoded(bits, -start, flip)
        return self

    def _encoded(self, bits: int, zero: int, flip: torch.Tensor) -> PackedTensor:
        """compact's form: `bits` a value, kept plus zero; the blocks (or half blocks) where `flip` negated."""
        sign = 1 - 2 * flip.to(torch.int16)  # [pairs, blocks, segments, PAIR]
        segments = sign.shape[2]

        def encode(run: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
            v = run.view(*run.shape[:2], 2, segments, -1, TILE, 4).to(torch.int16) - BYTE_ZERO
            per_value = signs.view(*signs.shape[:3], 2, TILE).permute(0, 1, 3, 2, 4)[..., None, :, None]
            u = (v * per_value + zero).to(torch.uint8).view(*run.shape)
            return _nibbles(u, bits)

        values = torch.cat([encode(run, sign[i:i + len(run)]) for i, run in _indexed_runs(self.values)])
        return PackedTensor(values, self.scales * sign, self.offsets, self.n, self.k, zero)

    def in_bytes(self) -> PackedTensor:
        """The same weight at 8 bits a value."""
        if self.bits == 8:
            return self
        values = _in_runs(self.values, lambda run: _bytes(run) + (BYTE_ZERO - self.zero) % 256)
        return PackedTensor(values, self.scales, self.offsets, self.n, self.k)

    def pairs(self, start: int, stop: int) -> PackedTensor:
        """Rows [start, stop) (start a multiple of PAIR; stop too, or n)."""
        if start % PAIR or (stop % PAIR and stop != self.n):
            raise ValueError(f"packed rows [{start}, {stop}) do not fall on pairs of {PAIR}")
        cut = slice(start // PAIR, -(-stop // PAIR))
        return PackedTensor(self.values[cut], self.scales[cut], None if self.offsets is None else self.offsets[cut],
                            stop - start, self.k, self.zero)

    def columns(self, start: int, stop: int) -> PackedTensor:
        """Columns [start, stop), both multiples of BLOCK (a copy)."""
        if start % BLOCK or stop % BLOCK:
            raise ValueError(f"packed columns [{start}, {stop}) do not fall on blocks of {BLOCK}")
        cut = (slice(None), slice(start // BLOCK, stop // BLOCK))
        return PackedTensor(self.values[cut].contiguous(), self.scales[cut].contiguous(),
                            None if self.offsets is None else self.offsets[cut].contiguous(), self.n, stop - start,
                            self.zero)

    def widened(self, halves: bool, offsets: bool) -> PackedTensor:
        """The same weight in a wider form: scales per half block, offsets (zero ones where it has none)."""
        scales = self.scales.expand(-1, -1, 2, -1) if halves and not self.halves else self.scales
        offs = self.offsets
        if offs is None and offsets:
            offs = torch.zeros_like(scales)
        elif offs is not None and offs.shape != scales.shape:
            offs = offs.expand_as(scales)
        return PackedTensor(self.values, scales, offs, self.n, self.k, self.zero)

    def padded(self, n: int) -> PackedTensor:
        """The weight with zero rows after its own, up to n (a rank's vocabulary rows past the vocabulary)."""
        extra = -(-n // PAIR) - self.values.shape[0]
        if extra <= 0:
            return PackedTensor(self.values, self.scales, self.offsets, max(n, self.n), self.k, self.zero)
        pad = lambda t, fill: torch.cat([t, torch.full((extra, *t.shape[1:]), fill, dtype=t.dtype)])  # noqa: E731
        zeros = torch.full((extra, self.values.shape[1], 2 * TILE * BLOCK), self.zero, dtype=torch.uint8)
        values = torch.cat([self.values, zeros if self.bits == 8 else _nibbles(zeros, self.bits)])
        return PackedTensor(values, pad(self.scales, 1.0), None if self.offsets is None else pad(self.offsets, 0.0),
                            n, self.k, self.zero)

    @staticmethod
    def cat(parts: list[PackedTensor]) -> PackedTensor:
        """The parts' rows one after another (every part but the last a whole number of pairs), in the widest
        form any part has (parts of different bits or zeros: in the fewest bits all their values take)."""
        if len(parts) == 1:
            return parts[0]
        if any(p.n % PAIR for p in parts[:-1]) or len({p.k for p in parts}) != 1:
            raise ValueError("packed parts do not stack: rows not in whole pairs, or different columns")
        halves, offsets = any(p.halves for p in parts), any(p.offsets is not None for p in parts)
        mixed = len({(p.bits, p.zero) for p in parts}) > 1
        wide = [(p.in_bytes() if mixed else p).widened(halves, offsets) for p in parts]
        tensor = PackedTensor(torch.cat([p.values for p in wide]), torch.cat([p.scales for p in wide]),
                              torch.cat([p.offsets for p in wide]) if offsets else None,
                              sum(p.n for p in parts), parts[0].k, wide[0].zero)
        return tensor.compact() if mixed else tensor


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
                 zero: int = BYTE_ZERO) -> None:
        self.weight, self.bias, self.values, self.scales, self.offsets = weight, bias, values, scales, offsets
        self.n, self.k, self.zero = n, k, zero
        self.narrow, self.halves = values.dtype in (torch.int8, torch.uint8), halves
        self.bits = CHUNK_BITS[values.numel() // (-(-n // PAIR) * (k // BLOCK))] if self.narrow else 16
        amx = amx_available() and not halves
        self.min_rows = (FEW_ROWS + 1 if self.narrow else AMX_MIN_ROWS) if amx else ALL_ROWS
        self.max_rows = ALL_ROWS if self.narrow or amx else 0
        self.packing = Packing(values.data_ptr(), scales.data_ptr(), None if offsets is None else offsets.data_ptr(),
                               self.narrow, halves, self.min_rows, self.max_rows, self.bits, zero)
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
        values, scales = tensor.values.contiguous(), tensor.scales.contiguous()
        offsets = None if tensor.offsets is None else tensor.offsets.contiguous()
        return cls(None, None if bias is None else bias.contiguous(), values, scales, offsets, tensor.n, tensor.k,
                   tensor.halves, tensor.zero)

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
        shape = (pairs, blocks, segments, PAIR)
        return PackedTensor(self.values.view(torch.uint8).view(pairs, blocks, -1),
                            self.scales.view(shape), None if self.offsets is None else self.offsets.view(shape),
                            self.n, self.k, self.zero)

    @property
    def nbytes(self) -> int:
        """What a call streams of the packing: its values, scales and offsets."""
        return sum(t.nbytes for t in (self.values, self.scales, self.offsets) if t is not None)

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

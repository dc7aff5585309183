"""A narrow packing as a checkpoint stores it (packed_linear.h's layouts), and its compact forms: values in 4, 5,
6 or 8 bits (`PackedTensor.compact`), scales as float16 or int8 codes under a float32 factor per row and group of
blocks (`Scales.grouped`), each exact: the kernels read any of them back to the same weights, so the same bits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

BLOCK, PAIR, TILE = 32, 32, 16  # k per scale; weight rows per packed pair of tiles, per tile (packed_linear.h's)
SCALE_GROUP = 8  # blocks under one scale factor (packed_linear.h's): a GGUF K-quant's super-block
PLANE = 2 * TILE * BLOCK // 8  # bytes of a bit plane: one bit of each of a pair's block's values
# A pair's block's bits a value, by its bytes: nibbles, and a plane for each bit past 4.
CHUNK_BITS = {2 * TILE * BLOCK: 8} | {TILE * BLOCK + (bits - 4) * PLANE: bits for bits in (4, 5, 6)}
BYTE_ZERO = 128  # what an 8-bit packing adds to its values
CODE_TOP = 15  # a group's largest code is in [2^(CODE_TOP - 1), 2^CODE_TOP): float16 reaches 65504
_ENCODE_PAIRS = 4096  # pairs re-encoded at a time: the intermediates stay ~100 MB whatever the tensor


def _in_bits(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Values in the 8-bit layout (u = v + zero, uint8 [..., 2 * TILE * BLOCK]) in packed_linear.h's `bits` one."""
    lines = u.view(*u.shape[:-1], 2, BLOCK // 8, 2, 4 * TILE)  # [tile][k-quad pair][k-quad parity][line]
    nibbles = ((lines[..., 0, :] & 15) | (lines[..., 1, :] << 4)).reshape(*u.shape[:-1], TILE * BLOCK)
    places = torch.arange(8, dtype=torch.uint8)
    planes = [((u >> b & 1).view(*u.shape[:-1], -1, 8) << places).sum(-1, dtype=torch.uint8) for b in range(4, bits)]
    return torch.cat([nibbles, *planes], dim=-1)


def _bytes(chunks: torch.Tensor) -> torch.Tensor:
    """_in_bits undone: a compact layout's chunks in the 8-bit layout (u = v + zero, uint8)."""
    lead, bits = chunks.shape[:-1], CHUNK_BITS[chunks.shape[-1]]
    nibbles = chunks[..., :TILE * BLOCK].reshape(*lead, 2, BLOCK // 8, 1, 4 * TILE)
    u = torch.cat([nibbles & 15, nibbles >> 4], dim=-2).reshape(*lead, 2 * TILE * BLOCK)
    for bit in range(4, bits):
        at = TILE * BLOCK + (bit - 4) * PLANE
        plane = chunks[..., at:at + PLANE].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8) & 1
        u |= plane.reshape(u.shape) << bit
    return u


def _runs(values: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """values' pairs _ENCODE_PAIRS at a time (at least one run), each with its first pair's index."""
    return ((i, values[i:i + _ENCODE_PAIRS]) for i in range(0, max(len(values), 1), _ENCODE_PAIRS))


def _in_runs(values: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    return torch.cat([f(run) for _, run in _runs(values)])


def _segment_range(run: torch.Tensor, segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The least and the largest value of each block (or half block) of an 8-bit layout's run of pairs, as
    [pairs, blocks, segments, PAIR] (the scales' shape)."""
    v = run.view(*run.shape[:2], 2, segments, -1, TILE, 4)  # [pair][block][tile][segment][k-quad][row][4]
    low, high = v.amin(dim=(4, 6)), v.amax(dim=(4, 6))  # [pair][block][tile][segment][row]
    shape = (*run.shape[:2], segments, 2 * TILE)
    low, high = ((t.to(torch.int16) - BYTE_ZERO).permute(0, 1, 3, 2, 4).reshape(shape) for t in (low, high))
    return low, high


def _int8_codes(codes: torch.Tensor, factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float16 codes [pairs, groups, codes, PAIR] under factors as int8 ones, where every group's are integers
    that share a power of two leaving each within int8 (a K-quant's 6- or 8-bit block scales), the power (and a
    sign, where the codes reach 128) moved into the factors; else as they are."""
    c = codes.double()
    if not torch.equal(c, c.round()) or c.abs().max() >= 2**CODE_TOP:
        return codes, factors
    ints = c.long()
    low = torch.where(ints == 0, 1 << CODE_TOP, ints & -ints)  # each code's lowest set bit
    shift = low.amin(2).double().log2().round().long().clamp(max=CODE_TOP)  # the group's shared power of two
    sign = torch.where(ints.amax(2) >> shift > 127, -1, 1)  # Q6_K's d is negative where its codes reach -128
    small = (ints >> shift[:, :, None]) * sign[:, :, None]
    if small.min() < -128 or small.max() > 127:
        return codes, factors
    return small.to(torch.int8), factors * torch.ldexp(sign.float(), shift.to(torch.int32))


@dataclass(frozen=True)
class Scales:
    """A packing's scales (or offsets), one per row and block (or half block): `codes` float32 [pairs, blocks,
    halves, PAIR]; or, where `factors` [pairs, groups, PAIR] (float32, a group SCALE_GROUP blocks) is there,
    float16 or int8 codes, each scale exactly its code times its row's and group's factor."""

    codes: torch.Tensor
    factors: torch.Tensor | None = None

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.codes,) if self.factors is None else (self.codes, self.factors)

    def floats(self) -> torch.Tensor:
        """The scales as float32 [pairs, blocks, halves, PAIR]."""
        if self.factors is None:
            return self.codes
        per_block = self.factors.repeat_interleave(SCALE_GROUP, dim=1)[:, :self.codes.shape[1], None, :]
        return self.codes.float() * per_block

    def grouped(self) -> Scales:
        """The same scales as float16 codes under factors, where every group's have that form exactly (a GGUF's:
        a float16 times a small integer, and a power of two), else as they are; as int8 codes where those fit. A
        group's factor is its scales' greatest common odd divisor times the power of two that puts its largest
        code under 2^CODE_TOP (int8: its codes' greatest common power of two, times that)."""
        if self.factors is not None:
            return self
        pairs, blocks, halves, _ = self.codes.shape
        groups = -(-blocks // SCALE_GROUP)
        padding = self.codes.new_zeros(pairs, groups * SCALE_GROUP - blocks, halves, PAIR)
        s = torch.cat([self.codes, padding], dim=1).view(pairs, groups, SCALE_GROUP * halves, PAIR)
        bits = s.view(torch.int32)
        exponent = bits >> 23 & 0xFF
        if ((exponent == 0) & (s != 0)).any() or (exponent == 0xFF).any():  # subnormal, infinite or NaN
            return self
        significand = torch.where(s == 0, 0, bits & 0x7FFFFF | 0x800000).long()
        odd = significand // (significand & -significand).clamp(min=1)
        divisor = odd[:, :, 0]
        for i in range(1, odd.shape[2]):
            divisor = torch.gcd(divisor, odd[:, :, i])
        quotients = s.double() / divisor.clamp(min=1).double()[:, :, None]  # exact: the divisor divides each
        _, top = torch.frexp(quotients.abs().amax(2))  # the largest < 2^top
        power = torch.ldexp(torch.ones_like(quotients[:, :, 0]), top - CODE_TOP)
        factors = (divisor.clamp(min=1).double() * power).float()
        codes = (quotients / power[:, :, None]).half()
        codes, factors = _int8_codes(codes, factors)
        if not torch.equal(codes.float() * factors[:, :, None], s):  # the kernels' product, exactly the scale
            return self
        return Scales(codes.view(pairs, groups * SCALE_GROUP, halves, PAIR)[:, :blocks].contiguous(), factors)

    def pairs(self, cut: slice) -> Scales:
        return Scales(self.codes[cut], None if self.factors is None else self.factors[cut])

    def blocks(self, start: int, stop: int) -> Scales:
        """Blocks [start, stop) (a copy): as floats where start is within a group."""
        if self.factors is None or start % SCALE_GROUP:
            return Scales(self.floats()[:, start:stop].contiguous())
        groups = slice(start // SCALE_GROUP, -(-stop // SCALE_GROUP))
        return Scales(self.codes[:, start:stop].contiguous(), self.factors[:, groups].contiguous())

    def per_half(self) -> Scales:
        """Each block's scale for each of its halves."""
        return self if self.codes.shape[2] == 2 else Scales(self.codes.expand(-1, -1, 2, -1), self.factors)

    def padded(self, extra: int, fill: float) -> Scales:
        """`extra` pairs more, each scale `fill`."""
        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            return torch.cat([t, torch.full((extra, *t.shape[1:]), value, dtype=t.dtype)])
        return Scales(pad(self.codes, fill), None if self.factors is None else pad(self.factors, 1.0))

    @staticmethod
    def cat(parts: list[Scales]) -> Scales:
        """Parts' pairs one after another: grouped where all are, else as float32 (grouped where it can be)."""
        if all(p.factors is not None for p in parts):
            return Scales(torch.cat([p.codes for p in parts]), torch.cat([p.factors for p in parts]))
        floats = Scales(torch.cat([p.floats() for p in parts]))
        return floats.grouped() if any(p.factors is not None for p in parts) else floats


@dataclass(frozen=True)
class PackedTensor:
    """A narrow packing's buffers as a checkpoint stores them (packed_linear.h's layouts), of an [n, k] weight:
    `values` uint8 [pairs, blocks, bytes] (2 * TILE * BLOCK bytes: 8 bits a value; fewer: 6, 5 or 4, CHUNK_BITS),
    each value kept plus `zero`; `scales` and `offsets` (None: no offsets), one per half block where halves."""

    values: torch.Tensor
    scales: Scales
    offsets: Scales | None
    n: int
    k: int
    zero: int = BYTE_ZERO

    @property
    def halves(self) -> bool:
        return self.scales.codes.shape[2] == 2

    @property
    def bits(self) -> int:
        return CHUNK_BITS[self.values.shape[-1]]

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint keeps, by the name of their part (models/gguf.py's PACKED_PARTS)."""
        parts = {"values": self.values, "scales": self.scales.codes, "scale_factors": self.scales.factors}
        if self.offsets is not None:
            parts |= {"offsets": self.offsets.codes, "offset_factors": self.offsets.factors}
        return {name: t for name, t in parts.items() if t is not None}

    @classmethod
    def of_buffers(cls, buffers: dict[str, torch.Tensor], n: int, k: int, zero: int) -> PackedTensor:
        """`buffers` undone."""
        offsets = buffers.get("offsets")
        return cls(buffers["values"], Scales(buffers["scales"], buffers.get("scale_factors")),
                   None if offsets is None else Scales(offsets, buffers.get("offset_factors")), n, k, zero)

    @classmethod
    def of_integers(cls, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None) -> PackedTensor:
        """The weight whose row i, block (or half block) b is scales[i, b] * v (+ offsets[i, b]), given v +
        BYTE_ZERO (`values`, uint8 [n, k]), in the 8-bit layout (`compact` narrows it); rows past n as `padded`'s."""
        n, k = values.shape
        pairs, blocks = -(-n // PAIR), k // BLOCK
        extra, segments = pairs * PAIR - n, scales.shape[1] // blocks

        def per_block(t: torch.Tensor, fill: float) -> Scales:
            t = torch.cat([t.float(), t.new_full((extra, t.shape[1]), fill, dtype=torch.float32)])
            return Scales(t.view(pairs, PAIR, blocks, segments).permute(0, 2, 3, 1).contiguous())

        def layout(run: torch.Tensor) -> torch.Tensor:  # [pairs, PAIR, k] to [pair][block][tile][k-quad][row][4]
            lines = run.view(len(run), 2, TILE, blocks, BLOCK // 4, 4).permute(0, 3, 1, 4, 2, 5)
            return lines.reshape(len(run), blocks, 2 * TILE * BLOCK)

        rows = torch.cat([values, values.new_full((extra, k), BYTE_ZERO)]).view(pairs, PAIR, k)
        return cls(_in_runs(rows, layout), per_block(scales, 1.0), None if offsets is None else per_block(offsets, 0.0),
                   n, k)

    def _with(self, values: torch.Tensor, scales: Scales, offsets: Scales | None, n: int | None = None,
              k: int | None = None, zero: int | None = None) -> PackedTensor:
        return PackedTensor(values, scales, offsets, self.n if n is None else n, self.k if k is None else k,
                            self.zero if zero is None else zero)

    def compact(self) -> PackedTensor:
        """The same weight in its smallest exact form: scales grouped, and values in the fewest bits (4, 5, 6 or 8)
        that hold each block's values, or their negation (its scale negated too: the same products and sums,
        negated twice; GGUF's Q5_0 scales have either sign), and a padding row's 0 within one window
        [-zero, 2^bits - 1 - zero]."""
        tensor = self
        if self.bits == 8:
            segments = self.scales.codes.shape[2]
            lows, highs = zip(*(_segment_range(run, segments) for _, run in _runs(self.values)), strict=True)
            low, high = torch.cat(lows), torch.cat(highs)
            # A block of zero values takes any scale (the fit's is 1): 0 leaves its group's factor to the others.
            scales = Scales(torch.where((low == 0) & (high == 0), 0.0, self.scales.floats()))
            tensor = self._with(self.values, scales, self.offsets)._fewest_bits(low, high)
        return tensor._with(tensor.values, tensor.scales.grouped(),
                            None if tensor.offsets is None else tensor.offsets.grouped())

    def _fewest_bits(self, low: torch.Tensor, high: torch.Tensor) -> PackedTensor:
        """compact's values, given each block's (or half block's) least and largest value."""
        for bits in (4, 5, 6):
            span = 2**bits - 1
            for start in dict.fromkeys((min(int(low.min()), 0), -(span + 1) // 2, 0)):
                flip = ~((low >= start) & (high <= start + span))
                if ((-high >= start) & (-low <= start + span) | ~flip).all():
                    return self._encoded(bits, -start, flip)
        return self

    def _encoded(self, bits: int, zero: int, flip: torch.Tensor) -> PackedTensor:
        """_fewest_bits' form: `bits` a value, kept plus zero, the blocks (or half blocks) where `flip` negated."""
        sign = 1 - 2 * flip.to(torch.int16)  # [pairs, blocks, segments, PAIR]
        segments = sign.shape[2]

        def encode(i: int, run: torch.Tensor) -> torch.Tensor:
            v = run.view(*run.shape[:2], 2, segments, -1, TILE, 4).to(torch.int16) - BYTE_ZERO
            signs = sign[i:i + len(run)]
            per_value = signs.view(*signs.shape[:3], 2, TILE).permute(0, 1, 3, 2, 4)[..., None, :, None]
            return _in_bits((v * per_value + zero).to(torch.uint8).view(*run.shape), bits)

        values = torch.cat([encode(i, run) for i, run in _runs(self.values)])
        return self._with(values, Scales(self.scales.floats() * sign), self.offsets, zero=zero)

    def in_bytes(self) -> PackedTensor:
        """The same weight at 8 bits a value."""
        if self.bits == 8:
            return self
        values = _in_runs(self.values, lambda run: _bytes(run) + (BYTE_ZERO - self.zero) % 256)
        return self._with(values, self.scales, self.offsets, zero=BYTE_ZERO)

    def pairs(self, start: int, stop: int) -> PackedTensor:
        """Rows [start, stop) (start a multiple of PAIR; stop too, or n)."""
        if start % PAIR or (stop % PAIR and stop != self.n):
            raise ValueError(f"packed rows [{start}, {stop}) do not fall on pairs of {PAIR}")
        cut = slice(start // PAIR, -(-stop // PAIR))
        return self._with(self.values[cut], self.scales.pairs(cut),
                          None if self.offsets is None else self.offsets.pairs(cut), n=stop - start)

    def columns(self, start: int, stop: int) -> PackedTensor:
        """Columns [start, stop), both multiples of BLOCK (a copy)."""
        if start % BLOCK or stop % BLOCK:
            raise ValueError(f"packed columns [{start}, {stop}) do not fall on blocks of {BLOCK}")
        first, last = start // BLOCK, stop // BLOCK
        return self._with(self.values[:, first:last].contiguous(), self.scales.blocks(first, last),
                          None if self.offsets is None else self.offsets.blocks(first, last), k=stop - start)

    def widened(self, halves: bool, offsets: bool) -> PackedTensor:
        """The same weight in a wider form: scales per half block, offsets (zero ones where it has none)."""
        scales = self.scales.per_half() if halves else self.scales
        offs = self.offsets
        if offs is None and offsets:
            offs = Scales(torch.zeros_like(scales.codes, dtype=torch.float32))
        elif offs is not None and halves:
            offs = offs.per_half()
        return self._with(self.values, scales, offs)

    def padded(self, n: int) -> PackedTensor:
        """The weight with zero rows after its own, up to n (a rank's vocabulary rows past the vocabulary)."""
        extra = -(-n // PAIR) - self.values.shape[0]
        if extra <= 0:
            return self._with(self.values, self.scales, self.offsets, n=max(n, self.n))
        zeros = torch.full((extra, self.values.shape[1], 2 * TILE * BLOCK), self.zero, dtype=torch.uint8)
        values = torch.cat([self.values, zeros if self.bits == 8 else _in_bits(zeros, self.bits)])
        return self._with(values, self.scales.padded(extra, 1.0),
                          None if self.offsets is None else self.offsets.padded(extra, 0.0), n=n)

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
        tensor = PackedTensor(torch.cat([p.values for p in wide]), Scales.cat([p.scales for p in wide]),
                              Scales.cat([p.offsets for p in wide]) if offsets else None,
                              sum(p.n for p in parts), parts[0].k, wide[0].zero)
        return tensor.compact() if mixed else tensor

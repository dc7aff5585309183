"""Packed linears (quantization/packed_linear.py) and the AMX GEMM (kernels/amx_gemm.c): which weights pack, that the
products are exact and the sums as close to float64 as a float32 GEMM's, that a row's bits do not depend on its
batch, and the engine on them: parity with transformers and the fused decode step's bits. The packing (which
weights pack, in which form, the packed layout and its values; kernels/packed_linear.c) is checked wherever the
kernels build, against a torch reading of the layout; what runs AMX's tile instructions only where AMX does
(test_few_rows.py: the few-row kernel without AMX)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from slotserve.engine.model_runner import ModelRunner, ScheduledSeq, Want
from slotserve.kernels import native
from slotserve.layers.linear import Linear
from slotserve.models.loader import load_model
from slotserve.models.packing import PackingReport
from slotserve.quantization import packed_linear
from slotserve.quantization.packed_linear import (
    ALL_ROWS,
    AMX_MIN_ROWS,
    BLOCK,
    FEW_ROWS,
    PAIR,
    PANEL_ROWS,
    TILE,
    TILE_ROWS,
    PackedTensor,
    PackedWeight,
)
from tests.conftest import build_tiny_model

pytestmark = pytest.mark.skipif(not packed_linear.packs(), reason="native kernels not built here")
needs_amx = pytest.mark.skipif(not packed_linear.amx_available(), reason="no AMX here")


def _block_scaled(n: int, k: int, levels: int, seed: int = 0) -> torch.Tensor:
    """A GGUF-like weight: per block of 32 along a row, an fp16 scale times integers in [-levels, levels)."""
    g = torch.Generator().manual_seed(seed)
    scale = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    return (scale * torch.randint(-levels, levels, (n, k // 32, 32), generator=g).float()).reshape(n, k)


def _q4_k(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A Q4_K-like weight: per block of 32 along a row, a * q - c with a and c fp16 scales times 6-bit
    integers and q in [0, 16): a scale times one bfloat16 plus an offset. (Blocks where a * q - c is not
    exactly a float32 drop their c, as GGUF's dequantized blocks are exact where they pack.)"""
    g = torch.Generator().manual_seed(seed)

    def scale() -> torch.Tensor:
        fp16 = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().double()
        return fp16 * torch.randint(1, 64, (n, k // 32, 1), generator=g).double()

    a, c = scale(), scale()
    w = a * torch.randint(0, 16, (n, k // 32, 32), generator=g).double() - c
    exact = (w.float().double() == w).all(-1, keepdim=True)
    return torch.where(exact, w, w + c).float().reshape(n, k)


def _q6_k(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A Q6_K-like weight: per 16 along a row, an fp16 scale times a signed 8-bit integer, times integers in
    [-32, 32): no scale per block of 32 makes those integers, but half blocks do."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, 1, 1, generator=g) * 0.002 + 1e-4).half().float()
    sc = torch.randint(-128, 128, (n, k // 16, 1), generator=g).float()
    return (d * sc * torch.randint(-32, 32, (n, k // 16, 16), generator=g).float()).reshape(n, k)


WEIGHTS = {"q5_0": lambda n, k: _block_scaled(n, k, 16), "q4_k": _q4_k}  # what AMX runs
FEW_ROW_WEIGHTS = {**WEIGHTS, "q6_k": _q6_k}  # what the few-row kernel runs


def _offsets(w: torch.Tensor) -> bool | None:
    """Whether the packed weight has offsets (None: it does not pack)."""
    packed = PackedWeight.pack(w)
    return None if packed is None else packed.offsets is not None


def _pack(w: torch.Tensor, narrow: bool, halves: bool = False, offsets: bool = False):
    """slotserve_pack_weight called in one form (PackedWeight.pack tries them in turn, and bfloat16 values only where
    AMX runs): its answer, and the values, scales and offsets (None without) it wrote."""
    pack = native.require(native.function(packed_linear.PACK_SOURCE, "slotserve_pack_weight", packed_linear._PACK_ARGS),
                          packed_linear.PACK_SOURCE)
    n, k = w.shape
    scalars = -(-n // PAIR) * PAIR * (k // BLOCK) * (2 if halves else 1)
    values = torch.zeros(-(-n // PAIR) * PAIR * k, dtype=torch.int8 if narrow else torch.int16)
    scales, offs = torch.zeros(scalars), torch.zeros(scalars) if offsets else None
    fit = pack(w.data_ptr(), n, k, None if offs is None else offs.data_ptr(), values.data_ptr(), scales.data_ptr(),
               narrow, halves, torch.get_num_threads())
    return fit, values, scales, offs


def _unpack(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, k: int, halves: bool):
    """A packing read back in torch as packed_linear.h lays it out, for all rows (padding included): each
    value [rows, k] (int8 ones less their 128, bfloat16 ones as floats), and its scale and offset [rows, k]."""
    rows, blocks, segments = values.numel() // k, k // BLOCK, 2 if halves else 1
    pairs, tile = rows // PAIR, PAIR // 2
    if values.dtype == torch.int8:  # per pair and block: [2 tiles][8 k-quads][16 rows][4], plus 128
        v = values.view(torch.uint8).double() - 128
        v = v.reshape(pairs, blocks, 2, BLOCK // 4, tile, 4)
    else:  # [2 tiles][16 k-pairs][16 rows][2], bfloat16 bits
        v = values.view(torch.bfloat16).double().reshape(pairs, blocks, 2, BLOCK // 2, tile, 2)
    v = v.permute(0, 2, 4, 1, 3, 5).reshape(rows, k)  # to [pair][tile][row][block][k-group][k]

    def per_value(t: torch.Tensor) -> torch.Tensor:  # [pair][block][half][PAIR] to one per value
        t = t.double().reshape(pairs, blocks, segments, PAIR).permute(0, 3, 1, 2)
        return t.reshape(rows, blocks * segments).repeat_interleave(BLOCK // segments, dim=1)

    return v, per_value(scales), torch.zeros_like(v) if offsets is None else per_value(offsets)


def _packing_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"q8_0": _block_scaled(70, 128, 128), "q5_0": _block_scaled(70, 128, 16), "q4_k": _q4_k(70, 128),
            "q6_k": _q6_k(70, 128), "bf16": torch.randn(70, 128, generator=g).bfloat16().float(),
            "float32": torch.randn(70, 128, generator=g)}


# Forms (narrow, halves, offsets), and what slotserve_pack_weight answers for each weight in each: 0 packed,
# -1 some block has no such form, -2 every block has but not in int8.
FORMS = [(True, False, False), (True, True, False), (False, False, False), (True, False, True), (True, True, True),
         (False, False, True)]
FITS = {"q8_0": [0, 0, 0, -2, -2, 0], "q5_0": [0, 0, 0, 0, 0, 0], "q4_k": [-1, -1, -1, 0, 0, 0],
        "q6_k": [-1, 0, -1, -1, 0, -1], "bf16": [-2, -2, 0, -1, -1, -1], "float32": [-1] * 6}


@pytest.mark.parametrize("kind", FITS)
def test_each_weight_packs_in_its_forms_and_reads_back_exactly(kind):
    """Every form a weight has packs it exactly: scale * value + offset, in float64, is the weight; the padding
    rows past N are zero values under a scale of 1 and no offset."""
    w = _packing_weights()[kind]
    n, k = w.shape
    fits = []
    for narrow, halves, offsets in FORMS:
        fit, values, scales, offs = _pack(w, narrow, halves, offsets)
        fits.append(fit)
        if fit:
            continue
        v, scale, offset = _unpack(values, scales, offs, k, halves)
        assert torch.equal(v[:n] * scale[:n] + offset[:n], w.double()), (narrow, halves, offsets)
        assert not v[n:].any() and (scale[n:] == 1).all() and not offset[n:].any()
    assert fits == FITS[kind]


def test_the_packed_bytes_are_where_the_layout_puts_them():
    """A weight of integers with a 1 in each half block (so every scale is 1, every offset 0): its bytes, built
    in torch from the layout (tile pairs of 32 rows, blocks of 32 along K, 16-row tiles, k-quads of int8 values
    plus 128 or k-pairs of bfloat16 bits), are the packing's."""
    n, k = 40, 96  # a second, partial pair of tiles: rows 40..63 are padding
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-128, 128, (n, k), generator=g).float()
    w[:, ::16] = 1.0
    rows, pairs, blocks = 64, 2, k // BLOCK
    padded = torch.cat([w, torch.zeros(rows - n, k)])
    quads = padded.reshape(pairs, 2, 16, blocks, 8, 4).permute(0, 3, 1, 4, 2, 5)  # [pair][block][tile][quad][row]
    pairs_of_k = padded.reshape(pairs, 2, 16, blocks, 16, 2).permute(0, 3, 1, 4, 2, 5)
    for narrow, halves in ((True, False), (True, True), (False, False)):
        fit, values, scales, offsets = _pack(w, narrow, halves)
        assert fit == 0 and offsets is None and (scales == 1).all()
        assert scales.numel() == pairs * blocks * PAIR * (2 if halves else 1)
        if narrow:
            assert torch.equal(values.view(torch.uint8), (quads + 128).to(torch.uint8).flatten())
        else:
            assert torch.equal(values, pairs_of_k.bfloat16().flatten().view(torch.int16))


@pytest.mark.parametrize("kind", ["q8_0", "q5_0", "q4_k", "q6_k"])
def test_a_packed_weight_holds_its_form(kind):
    """PackedWeight.pack's buffers: the first form that fits (int8 values where they can be, no offsets where none
    are needed, scales per half block only where whole blocks do not fit), read back to the weight exactly; what
    a call streams is those buffers' bytes."""
    w = _packing_weights()[kind]
    n, k = w.shape
    packed = PackedWeight.pack(w)
    assert (packed.narrow, packed.halves, packed.offsets is not None) == {
        "q8_0": (True, False, False), "q5_0": (True, False, False), "q4_k": (True, False, True),
        "q6_k": (True, True, False)}[kind]
    v, scale, offset = _unpack(packed.values, packed.scales, packed.offsets, k, packed.halves)
    assert torch.equal(v[:n] * scale[:n] + offset[:n], w.double())
    rows, scalars = 3 * PAIR, 3 * PAIR * k // BLOCK * (2 if packed.halves else 1)
    assert packed.nbytes == rows * k + 4 * scalars * (2 if packed.offsets is not None else 1)


def test_packs_block_scaled_weights_and_nothing_else():
    assert _offsets(_block_scaled(40, 96, 16)) is False  # Q5_0-like
    assert _offsets(_block_scaled(40, 96, 127)) is False  # Q8_0-like
    # bfloat16 values: 2 bytes a value, packed where AMX runs them (the few-row kernel takes int8 alone)
    assert _offsets(torch.randn(40, 96).bfloat16().float()) is (False if packed_linear.amx_available() else None)
    assert _offsets(_q4_k(40, 96)) is True
    assert _offsets(torch.randn(40, 96).half().float()) is None  # float16 values have 11 bits
    assert PackedWeight.pack(torch.randn(40, 96)) is None  # float32 values need more than 8 bits
    assert PackedWeight.pack(torch.randn(40, 100).bfloat16().float()) is None  # K not in blocks of 32
    w = _block_scaled(40, 96, 16)
    w[7, 50] = 1e-40  # a subnormal (AMX reads those as zero)
    assert PackedWeight.pack(w) is None
    w = _block_scaled(40, 96, 16)
    w[3, 3] += w[3, 3] * 2**-20  # one value off its block's grid
    assert PackedWeight.pack(w) is None
    w = _q4_k(40, 96)
    w[5, 40] = w[5, 41] + w[5, 41] * 2**-20  # one value off its block's grid, above the block's offset
    assert PackedWeight.pack(w) is None


@needs_amx
@pytest.mark.parametrize("weight,narrow", [
    (_block_scaled(70, 128, 128), True),  # Q8_0-like, -128 included
    (_block_scaled(70, 128, 16), True),  # Q5_0-like
    (_q4_k(70, 128), True),  # with offsets
    (_block_scaled(70, 128, 16) * 2.0**-60, True),  # tiny and huge scales: the power of two moves to the scale
    (_block_scaled(70, 128, 16) * 2.0**100, True),
    (torch.randn(70, 128).bfloat16().float(), False),  # bfloat16 values: not all integers times a power of two
    (torch.cat([_block_scaled(35, 128, 16), torch.randn(35, 128).bfloat16().float()]), False),  # one form for all
])
def test_integer_blocks_pack_in_a_byte_a_value_with_the_same_bits(weight, narrow):
    packed, wide = PackedWeight.pack(weight), PackedWeight.pack(weight, narrow=False)
    assert packed.narrow == narrow and packed.values.element_size() == (1 if narrow else 2) and not wide.narrow
    x = torch.randn(PANEL_ROWS - 1, 128)
    # AMX's bfloat16 path for both: one row tile (prefetching), a few, one per thread
    for rows in (max(AMX_MIN_ROWS, packed.min_rows), 45, x.shape[0]):
        assert torch.equal(packed(x[:rows]), wide(x[:rows]))


def _signed(w: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """w with each block of 32 negated or not at random: GGUF's Q5_0 and Q4_0 scales have either sign."""
    g = torch.Generator().manual_seed(seed)
    n, k = w.shape
    return (w.view(n, k // BLOCK, BLOCK) * (torch.rand(n, k // BLOCK, 1, generator=g) < 0.5).float().mul(2).sub(1)
            ).view(n, k)


def _k_quant(n: int, k: int, levels: int, offsets: bool, seed: int = 0) -> torch.Tensor:
    """A GGUF K-quant-like weight: per super-block of 256 along a row fp16 factors d (and m), per block (of 32,
    or 16 where levels > 16: Q6_K) a 6-bit integer (8-bit signed for Q6_K) times d, times integers in [0, levels)
    (less levels / 2 without offsets), less another 6-bit one times m (a zero one here and there: blocks of
    zeros)."""
    g = torch.Generator().manual_seed(seed)
    per = 16 if levels > 16 else 32
    d, m = ((torch.rand(n, k // 256, 1, 1, generator=g) * 0.002 + 1e-4).half().double() for _ in range(2))
    codes = (torch.randint(-128, 128, (n, k // 256, 256 // per, 1), generator=g) if levels > 16 else
             torch.randint(0, 64, (n, k // 256, 256 // per, 1), generator=g)).double()
    q = torch.randint(0, levels, (n, k // 256, 256 // per, per), generator=g).double() - (0 if offsets else levels // 2)
    w = d * codes * q
    if offsets:  # where the difference is not a float32, the block drops its offset (as in _q4_k)
        c = m * torch.randint(0, 64, codes.shape, generator=g).double()
        w = torch.where(((w - c).float().double() == w - c).all(-1, keepdim=True), w - c, w)
    return w.float().reshape(n, k)


# GGUF-like weights: the bits and zero pack_narrow keeps them in (the fewest that hold every block's values),
# and their scales' (and offsets') dtypes: float16 or int8 codes under factors where the blocks share factors.
F16, I8, F32 = torch.float16, torch.int8, torch.float32
COMPACT = {"q4_0": (lambda n, k: _signed(_block_scaled(n, k, 8)), 4, 8, (F16, None)),
           "q5_0": (lambda n, k: _signed(_block_scaled(n, k, 16)), 5, 16, (F16, None)),
           "q4_k": (lambda n, k: _k_quant(n, k, 16, True), 4, 0, (I8, F32)),
           "q4_k, scales of their own": (_q4_k, 4, 0, (F32, F32)),
           "q8_0": (lambda n, k: _block_scaled(n, k, 128), 8, 128, (F16, None)),
           "q6_k": (lambda n, k: _k_quant(n, k, 64, False), 6, 32, (F16, None)),
           "7-bit values": (lambda n, k: _block_scaled(n, k, 64), 8, 128, (F16, None))}


@pytest.mark.parametrize("kind", COMPACT)
def test_integer_blocks_pack_in_their_smallest_form_with_the_bytes_bits(kind):
    """A checkpoint's packing (pack_narrow) keeps 4, 5, 6 or 8 bits a value (a block negated, scale and values,
    where its values fit so), and float16 or int8 scale codes under factors where they fit: read back exactly, and every
    kernel gives the bits of the 8-bit float32-scaled packing. (Fitted Q6_K-like blocks keep float16 codes: a half
    block of even values moves a factor of 2 into its scale; a GGUF's are read from its bytes, gguf_blocks.py.)"""
    make, bits, zero, grouped = COMPACT[kind]
    n, k = 1000, 1024
    w = make(n, k)
    tensor = packed_linear.pack_narrow(w)
    assert (tensor.bits, tensor.zero) == (bits, zero)
    assert (tensor.scales.codes.dtype, None if tensor.offsets is None else tensor.offsets.codes.dtype) == grouped
    compact = PackedWeight.of(tensor, torch.randn(n))
    full = PackedWeight.of(PackedWeight.pack(w).tensor(), compact.bias)
    assert torch.equal(compact.dequantize(), w) and torch.equal(PackedWeight.of(tensor.in_bytes()).dequantize(), w)
    value_bytes = -(-n // 32) * 32 * k * bits // 8
    assert compact.nbytes == value_bytes + sum(t.nbytes for t in compact.buffers[1:])
    x = torch.randn(PANEL_ROWS + 9, k)
    for rows in (1, FEW_ROWS, FEW_ROWS + 1, AMX_MIN_ROWS + 1, PANEL_ROWS - 1, x.shape[0]):
        assert torch.equal(compact(x[:rows]), full(x[:rows])), rows


def test_the_compact_bytes_are_where_the_layout_puts_them():
    """packed_linear.h's 4-, 5- and 6-bit layouts, built in torch from the 8-bit one: k-quads 2i and 2i + 1 of a
    line in one byte's low and high nibbles, then a plane of each value's fifth bit at its 8-bit byte's place,
    then one of its sixth bits."""
    n, k = 40, 64
    g = torch.Generator().manual_seed(6)
    for levels, bits in ((8, 4), (16, 5), (32, 6)):
        w = torch.randint(-levels, levels, (n, k), generator=g).float()
        w[:, ::16] = 1.0  # every scale 1
        tensor = packed_linear.pack_narrow(w)
        scales = tensor.scales.floats().permute(0, 3, 1, 2).reshape(64, -1)  # [row][block]
        assert tensor.bits == bits and tensor.zero == levels and (scales[:n] == 1).all()
        u = torch.cat([w, torch.zeros(64 - n, k)]) + levels  # rows past n are zeros
        lines = u.reshape(2, 2, 16, k // BLOCK, 8, 4).permute(0, 3, 1, 4, 2, 5).to(torch.uint8)
        lines = lines.reshape(2, k // BLOCK, 2, 4, 2, 64)  # [pair][block][tile][k-quad pair][parity][line]
        nibbles = (lines[..., 0, :] % 16 + lines[..., 1, :] % 16 * 16).reshape(2, k // BLOCK, -1)
        assert torch.equal(tensor.values[..., :TILE * BLOCK], nibbles)
        for bit in range(4, bits):
            set_bits = (lines.reshape(2, k // BLOCK, -1) >> bit & 1).to(torch.uint8)
            plane = (set_bits.view(2, k // BLOCK, -1, 8) * 2 ** torch.arange(8, dtype=torch.uint8)).sum(-1)
            at = TILE * BLOCK + (bit - 4) * TILE * BLOCK // 4
            assert torch.equal(tensor.values[..., at:at + TILE * BLOCK // 4], plane.to(torch.uint8))


def test_compact_parts_stack_and_pad_in_a_form_that_holds_them_all():
    """Parts of one form stack as they are; of different bits or zeros, in the fewest bits that hold all;
    padding rows are zeros in any form."""
    q4, q5, q4_k = (packed_linear.pack_narrow(make(64, 256)) for make, *_ in
                    (COMPACT["q4_0"], COMPACT["q5_0"], COMPACT["q4_k"]))
    q6_k, q8 = (packed_linear.pack_narrow(make(64, 256)) for make in (COMPACT["q6_k"][0], COMPACT["q8_0"][0]))
    for parts, bits in (([q4, q4], 4), ([q4, q5], 5), ([q4_k, q4], 5), ([q4_k, q6_k], 6), ([q5, q8], 8)):
        stacked = PackedTensor.cat(parts).padded(200)
        assert stacked.bits == bits and stacked.n == 200
        rows = PackedWeight.of(stacked).dequantize()
        assert torch.equal(rows[:128], torch.cat([PackedWeight.of(p).dequantize() for p in parts]))
        assert not rows[128:].any()


@pytest.mark.parametrize("kind", FEW_ROW_WEIGHTS)
@pytest.mark.parametrize("n,k", [(40, 96), (1000, 4864)])  # one panel; several, the last of a partial pair
def test_panels_are_as_close_to_float64_as_torchs_gemm_in_their_dtype(kind, n, k):
    """From PANEL_ROWS rows on, a narrow packing multiplies unpacked panels in panel_dtype()."""
    g = torch.Generator().manual_seed(n)
    w, bias, x = FEW_ROW_WEIGHTS[kind](n, k), torch.randn(n, generator=g), torch.randn(PANEL_ROWS + 3, k, generator=g)
    dtype = packed_linear.panel_dtype()
    exact = x.double() @ w.double().T + bias.double()
    ours = PackedWeight.pack(w, bias)(x)
    reference = torch.mm(x.to(dtype), w.to(dtype).T).float() + bias
    err, reference_err = ((y.double() - exact).abs().max().item() for y in (ours, reference))
    assert err <= 2 * reference_err + 1e-6


@pytest.mark.parametrize("kind", WEIGHTS)
@pytest.mark.parametrize("n,k", [(40, 96), (1152, 896), (70, 4864)])
@pytest.mark.parametrize("rows", [pytest.param(rows, marks=needs_amx if rows > FEW_ROWS else ())
                                  for rows in (1, 3, 4, 5, 13, 32, 45)])  # a narrow packing's few-row kernel, then AMX
def test_as_close_to_float64_as_a_float32_gemm(kind, n, k, rows):
    assert_as_close_to_float64_as_a_float32_gemm(kind, n, k, rows)


def assert_as_close_to_float64_as_a_float32_gemm(kind: str, n: int, k: int, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, bias, x = FEW_ROW_WEIGHTS[kind](n, k), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
    exact = x.double() @ w.double().T + bias.double()
    ours = PackedWeight.pack(w, bias)(x)
    fp32 = torch.nn.functional.linear(x, w, bias)
    err, fp32_err = ((y.double() - exact).abs().max().item() for y in (ours, fp32))
    assert err <= 2 * fp32_err + 1e-6


@needs_amx
@pytest.mark.parametrize("kind", WEIGHTS)
def test_a_row_gets_the_same_bits_in_any_batch(kind):
    packed = PackedWeight.pack(WEIGHTS[kind](100, 128), torch.randn(100))
    # Enough row tiles that each thread splits its own (amx_gemm.c's TILES_PER_THREAD); the slices split first.
    x = torch.randn(PAIR * 4 * torch.get_num_threads() + 13, 128)
    whole = packed(x[:PANEL_ROWS - 1])  # from PANEL_ROWS on, a narrow packing's calls take panels
    for rows in (packed.min_rows, 31, 32, 33):  # fewer take few_rows.c's bits
        assert torch.equal(packed(x[:rows]), whole[:rows])
    assert torch.equal(packed(x[40:40 + packed.min_rows])[0], whole[40])
    if not packed.narrow:
        for rows in (64, 70):
            assert torch.equal(packed(x[:rows]), packed(x)[:rows])


@pytest.mark.parametrize("kind", WEIGHTS)
def test_a_row_gets_the_same_bits_in_any_batch_of_few_rows(kind):
    """Fewer rows take a narrow packing's few-row kernel (vector units, AMX's int8 tiles or not): the same bits in
    any batch of those."""
    packed = PackedWeight.pack(WEIGHTS[kind](100, 128), torch.randn(100))
    x = torch.randn(min(packed.min_rows - 1, TILE_ROWS.stop - 1), 128)
    few = packed(x)
    for rows in range(1, x.shape[0]):
        assert torch.equal(packed(x[:rows]), few[:rows])
    assert torch.equal(packed(x[3:4])[0], few[3]) and torch.equal(packed(x[1:3]), few[1:3])


@needs_amx
@pytest.mark.parametrize("narrow", [False, True])
def test_a_linear_runs_on_amx_from_min_rows_on_and_on_a_narrow_packing_always(narrow):
    layer = Linear(96, 64, bias=False).requires_grad_(False)
    layer.weight.data.copy_(_q4_k(64, 96) if narrow else torch.randn(64, 96).bfloat16().float())
    assert layer.pack() and layer.packed.narrow == narrow
    row_counts = (1, AMX_MIN_ROWS - 1, AMX_MIN_ROWS, 300)
    assert [layer.packed.runs(rows) for rows in row_counts] == [narrow, narrow, True, True]
    assert_a_linear_runs_packed_where_its_packing_runs(layer, row_counts)


def assert_a_linear_runs_packed_where_its_packing_runs(layer: Linear, row_counts) -> None:
    """Each call gives the packing's result where it runs those rows, else the float32 weight's."""
    packed = layer.packed
    for rows in row_counts:
        x = torch.randn(rows, layer.weight.shape[1])
        with torch.no_grad():
            ours = layer(x)
            layer.packed = None
            unpacked = layer(x)
            layer.packed = packed
        assert torch.equal(ours, packed(x) if packed.runs(rows) else unpacked)


@needs_amx
@pytest.mark.parametrize("narrow", [False, True])
def test_a_linear_says_what_bytes_a_call_reads(narrow):
    layer = Linear(96, 64, bias=False).requires_grad_(False)
    layer.weight.data.copy_(_block_scaled(64, 96, 16) if narrow else torch.randn(64, 96).bfloat16().float())
    assert layer.streamed_bytes(1) == layer.weight.nbytes  # not packed yet
    assert layer.pack()
    scales = 64 * 96 // BLOCK * 4
    packed_bytes = 64 * 96 * (1 if narrow else 2) + scales
    assert layer.packed.nbytes == packed_bytes and layer.streamed_bytes(AMX_MIN_ROWS) == packed_bytes
    assert layer.streamed_bytes(1) == (packed_bytes if narrow else layer.weight.nbytes)


@pytest.mark.parametrize("weight", [_q4_k(64, 96),
                                    pytest.param(torch.randn(64, 96).bfloat16().float(), marks=needs_amx)])
def test_no_rows_give_no_rows(weight):
    packed = PackedWeight.pack(weight)
    assert packed(torch.empty(0, 96)).shape == (0, 64) and not packed.runs(0)


def test_scales_per_half_block_pack_for_the_vector_units_only():
    """AMX has no int8 form for a scale per 16: every call below PANEL_ROWS takes few_rows.c."""
    packed = PackedWeight.pack(_q6_k(64, 96), torch.randn(64))
    assert packed.narrow and packed.halves and packed.offsets is None and packed.scales.numel() == 2 * 64 * 96 // 32
    assert packed.min_rows == ALL_ROWS
    assert [packed.runs(r) for r in (0, 1, FEW_ROWS, FEW_ROWS + 1, AMX_MIN_ROWS)] == [False] + [True] * 4
    x = torch.randn(AMX_MIN_ROWS, 96)
    assert torch.equal(packed(x)[:FEW_ROWS + 1], packed(x[:FEW_ROWS + 1]))


@pytest.mark.parametrize("weight", [_block_scaled(64, 64, 16),
                                    pytest.param(torch.randn(64, 64).bfloat16().float(), marks=needs_amx)])
def test_bad_input_is_refused(weight):
    packed = PackedWeight.pack(weight)
    with pytest.raises(ValueError, match="x"):
        packed(torch.randn(3, 65))
    with pytest.raises(ValueError, match="bias"):
        PackedWeight.pack(weight, torch.randn(63))


def test_the_packing_report_is_the_load_lines_words():
    assert PackingReport(10).summary() == ""
    assert PackingReport(10, 4).summary() == "packed on the vector units: 4 of 10 linears"
    assert PackingReport(10, 4, 3).summary() == "packed on the AMX and vector units: 4 of 10 linears"
    assert PackingReport(10, 4, 3, 4).summary() == (
        "packed on the AMX and vector units: 4 of 10 linears, 4 without a float32 copy")


def _runner(path) -> ModelRunner:
    return ModelRunner(*load_model(path, torch.float32, torch.device("cpu")), num_blocks=64, block_size=4)


@needs_amx
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_bfloat16_checkpoint_runs_on_amx_and_matches_transformers(tmp_path, arch):
    hf = build_tiny_model(tmp_path, arch, dtype=torch.bfloat16)
    runner = _runner(tmp_path)
    assert runner.packing_report.packed == runner.packing_report.linears > 0 and runner.fused is not None
    prompt = [9707, 11, 1879, 0, 358, 1079, 264, 1632, 17, 151644, 77091, 198, 40, 2776]  # 14 rows: AMX
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(AMX_MIN_ROWS)]
    ours = runner.execute([ScheduledSeq(prompt, 0, tables[0], want=Want.ALL)])[0].logits
    assert (ours - ref).abs().max().item() <= 1e-4
    # A decode step of AMX_MIN_ROWS sequences (the fused step, on AMX): each row as transformers has it.
    for table in tables[1:]:
        runner.execute([ScheduledSeq(prompt[:10], 0, table, want=Want.NONE)])
    runner.execute([ScheduledSeq(prompt[10:13], 10, tables[0], want=Want.NONE)])
    rows = [r.logits for r in runner.execute([ScheduledSeq([prompt[13]], 13, tables[0])]
                                             + [ScheduledSeq([prompt[10]], 10, t) for t in tables[1:]])]
    assert (rows[0][0] - ref[13]).abs().max().item() <= 1e-4
    with torch.no_grad():
        short = hf(torch.tensor([prompt[:11]])).logits[0, -1]
    assert all((r[0] - short).abs().max().item() <= 1e-4 for r in rows[1:])


@needs_amx
def test_the_fused_step_on_amx_has_the_layer_paths_bits(tmp_path):
    build_tiny_model(tmp_path, "qwen2", dtype=torch.bfloat16)
    weights = load_file(tmp_path / "model.safetensors")
    for i, make in ((0, _q6_k), (1, _q4_k)):  # as GGUF's Q6_K (a scale per 16) and Q4_K (with offsets) are
        name = f"model.layers.{i}.mlp.down_proj.weight"
        weights[name] = make(*weights[name].shape)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    fused, layers = _runner(tmp_path), _runner(tmp_path)
    downs = [layer.mlp.down_proj.packed for layer in fused.model.model.layers]
    assert [(a.halves, a.offsets is not None) for a in downs] == [(True, False), (False, True)]
    assert fused.packing_report.on_amx == fused.packing_report.packed - 1 == fused.packing_report.linears - 1
    # The FMA kernels (and the down projections' few-row kernel), then AMX (and the Q6_K layer's float32 path).
    assert_fused_steps_have_the_layer_paths_bits(fused, layers, (1, AMX_MIN_ROWS - 1, AMX_MIN_ROWS, 20))


def assert_fused_steps_have_the_layer_paths_bits(fused: ModelRunner, layers: ModelRunner, row_counts) -> None:
    """Decode steps of each row count through the fused step and through the layers (and the same caches)."""
    layers.fused = None
    for rows in row_counts:
        tables = [list(range(3 * i, 3 * i + 3)) for i in range(rows)]
        for runner in (fused, layers):
            runner.execute([ScheduledSeq([100 + i, 7, 9], 0, t, want=Want.NONE) for i, t in enumerate(tables)])
        step = [ScheduledSeq([5 + i], 3, t) for i, t in enumerate(tables)]
        a, b = fused.execute(step), layers.execute(step)
        assert all(torch.equal(x.logits, y.logits) for x, y in zip(a, b, strict=True))
    assert torch.equal(fused.k_cache, layers.k_cache) and torch.equal(fused.v_cache, layers.v_cache)

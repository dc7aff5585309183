"""The few-row kernel (few_rows.c) where AMX is not: a narrow packing (GGUF's integer blocks, 1 byte a value)
serves every step below PANEL_ROWS rows on the vector units of any CPU, FEW_ROWS rows at a time, its AVX2 build
with the AVX-512 build's bits, as close to float64 as a float32 GEMM, each row's bits the same in any batch;
weights of other forms keep the float32 path."""

from __future__ import annotations

import ctypes
import functools

import pytest
import torch
from safetensors.torch import load_file, save_file

from slotserve.engine.model_runner import ModelRunner
from slotserve.kernels import native
from slotserve.layers.linear import Linear
from slotserve.models.loader import load_model
from slotserve.quantization import packed_linear
from slotserve.quantization.packed_linear import (
    AMX_MIN_ROWS,
    BLOCK,
    FEW_ROWS,
    PAIR,
    PANEL_ROWS,
    TILE_ROWS,
    PackedWeight,
)
from tests.conftest import build_tiny_model
from tests.test_packed_linear import (
    FEW_ROW_WEIGHTS,
    _block_scaled,
    _q4_k,
    _q6_k,
    assert_a_linear_runs_packed_where_its_packing_runs,
    assert_as_close_to_float64_as_a_float32_gemm,
    assert_fused_steps_have_the_layer_paths_bits,
)

pytestmark = pytest.mark.skipif(not packed_linear.packs(), reason="native kernels not built here")


@pytest.fixture
def no_amx(monkeypatch):
    """The engine as on a CPU without AMX."""
    monkeypatch.setenv("SLOTSERVE_AMX", "0")
    packed_linear.amx_available.cache_clear()
    yield
    monkeypatch.undo()
    packed_linear.amx_available.cache_clear()


def test_without_amx_integer_blocks_pack_for_every_row_count(no_amx):
    """Below PANEL_ROWS on few_rows.c; from there on in panels, unless those would be float32 panels of the
    float32 weight a float32 checkpoint keeps beside its packing."""
    assert not packed_linear.amx_available()
    panels = packed_linear.panel_dtype() != torch.float32
    for w in (_block_scaled(64, 96, 16), _block_scaled(64, 96, 127), _q4_k(64, 96), _q6_k(64, 96)):
        packed = PackedWeight.pack(w)
        assert packed.narrow and [packed.runs(r) for r in range(7)] == [False] + [True] * 6
        assert packed.runs(AMX_MIN_ROWS) and packed.runs(PANEL_ROWS - 1)
        assert packed.runs(PANEL_ROWS) == packed.runs(300) == panels
    # bfloat16 values would need AMX to be worth their 2 bytes: float32 stays.
    assert PackedWeight.pack(torch.randn(64, 96).bfloat16().float()) is None


def test_without_amx_a_linear_runs_packed_where_its_packing_runs(no_amx):
    layer = Linear(96, 64, bias=True).requires_grad_(False)
    layer.weight.data.copy_(_q4_k(64, 96))
    assert layer.pack()
    assert layer.streamed_bytes(1) == layer.streamed_bytes(FEW_ROWS + 1) == layer.packed.nbytes < layer.weight.nbytes
    panels = packed_linear.panel_dtype() != torch.float32
    assert layer.streamed_bytes(PANEL_ROWS) == (layer.packed.nbytes if panels else layer.weight.nbytes)
    assert_a_linear_runs_packed_where_its_packing_runs(layer, (1, FEW_ROWS, FEW_ROWS + 1, 40, PANEL_ROWS))


def test_without_amx_a_row_gets_the_same_bits_in_any_batch_below_panel_rows(no_amx):
    packed = PackedWeight.pack(_q4_k(100, 128), torch.randn(100))
    x = torch.randn(PANEL_ROWS - 1, 128)
    whole = packed(x)
    for rows in (1, FEW_ROWS - 1, FEW_ROWS + 1, 2 * FEW_ROWS + 3):
        assert torch.equal(packed(x[:rows]), whole[:rows])
    assert torch.equal(packed(x[7:13]), whole[7:13])


@pytest.mark.parametrize("kind", FEW_ROW_WEIGHTS)
@pytest.mark.parametrize("n,k", [(40, 96), (1152, 896), (70, 4864)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_few_rows_are_as_close_to_float64_as_a_float32_gemm(no_amx, kind, n, k, rows):
    assert_as_close_to_float64_as_a_float32_gemm(kind, n, k, rows)


# What CPUs without AVX-512 run (8 lanes, not 16), built here: AVX2 with VNNI's byte products, AVX2 with its
# 16-bit ones, and the plain C integer code (AVX without AVX2; multiply-adds still fused: where there are
# none, a * b + c rounds twice and the bits differ).
OTHER_BUILDS = {"avx2 vnni": ("-mno-avx512f",), "avx2": ("-mno-avx512f", "-mno-avxvnni"), "plain": ("-mno-avx2",)}


def assert_builds_agree(packed: PackedWeight, build: str, x: torch.Tensor, rows: range | tuple[int, ...]) -> None:
    """The `build` of few_rows.c gives this machine's bits on `packed`, for each row count (skips where it does not
    build here)."""
    gemm = native.function(packed_linear.FEW_ROWS_SOURCE, "slotserve_few_rows_gemm", packed_linear._GEMM_ARGS,
                           OTHER_BUILDS[build])
    if gemm is None:
        pytest.skip(f"no {build} build here")
    here = native.function(packed_linear.FEW_ROWS_SOURCE, "slotserve_few_rows_gemm", packed_linear._GEMM_ARGS)
    bias = None if packed.bias is None else packed.bias.data_ptr()
    for count in rows:
        out, expected = torch.empty(count, packed.n), torch.empty(count, packed.n)
        for f, y in ((gemm, out), (here, expected)):
            assert f(x.data_ptr(), ctypes.byref(packed.packing), bias, y.data_ptr(), count, packed.n, packed.k, 2) == 0
        assert torch.equal(out, expected), count


@pytest.mark.parametrize("build", OTHER_BUILDS)
@pytest.mark.parametrize("kind", FEW_ROW_WEIGHTS)
def test_other_builds_give_the_same_bits(kind, build):
    """The same integers and the same float operations lane by lane, whatever the vector width and products."""
    n, k = 1000, 896  # pairs of weight tiles and a last, partial one
    w = FEW_ROW_WEIGHTS[kind](n, k)
    packed = PackedWeight.pack(w, torch.randn(n))
    compact = PackedWeight.of(packed_linear.pack_narrow(w), packed.bias)  # 4 and 5 bits a value: q4_k, q5_0
    x = torch.randn(2 * FEW_ROWS + 1, k)
    for p in (packed, compact):
        assert_builds_agree(p, build, x, range(1, 2 * FEW_ROWS + 2))  # groups of FEW_ROWS and a last, partial one


def test_without_amx_the_fused_step_has_the_layer_paths_bits(no_amx, tmp_path):
    build_tiny_model(tmp_path, "qwen2")
    weights = load_file(tmp_path / "model.safetensors")
    for name, w in weights.items():  # GGUF-like integer blocks: Q8_0 for the MLPs, Q6_K and Q4_K for the downs
        if name.endswith(("mlp.gate_up_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")):
            weights[name] = _block_scaled(*w.shape, 127)
    for i, make in ((0, _q6_k), (1, _q4_k)):
        name = f"model.layers.{i}.mlp.down_proj.weight"
        weights[name] = make(*weights[name].shape)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    fused, layers = (ModelRunner(*load_model(tmp_path, torch.float32, torch.device("cpu")), num_blocks=64,
                                 block_size=4) for _ in range(2))
    report = fused.packing_report
    assert (report.packed, report.on_amx) == (4, 0) and fused.fused is not None  # gate/up, down
    assert report.summary() == f"packed on the vector units: 4 of {report.linears} linears"
    assert_fused_steps_have_the_layer_paths_bits(fused, layers, (1, FEW_ROWS, FEW_ROWS + 1))


@functools.cache
def _packing_cases() -> dict[str, torch.Tensor]:
    """Weights that pack and weights that do not, with the blocks the vectorised fit leaves to the scalar one
    (a zero offset; values whose least odd part does not divide the others)."""
    g = torch.Generator().manual_seed(1)
    zeros = torch.rand(96, 896, generator=g) < 0.3
    cases = {**{kind: make(96, 896) for kind, make in FEW_ROW_WEIGHTS.items()},
             "q8_0": _block_scaled(96, 896, 128), "bf16": torch.randn(96, 896, generator=g).bfloat16().float(),
             "float32": torch.randn(96, 896, generator=g), "q4_k with zeros": torch.where(zeros, 0.0, _q4_k(96, 896)),
             "q5_0 times 3": _block_scaled(96, 896, 2) * 3, "subnormal": _block_scaled(96, 896, 16) * 1e-36}
    for name, bad in (("nan", float("nan")), ("inf", float("inf"))):
        cases[name] = _block_scaled(96, 896, 16)
        cases[name][5, 70] = bad
    return cases


@pytest.mark.parametrize("kind", list(_packing_cases()))
def test_packing_gives_the_scalar_builds_bits(kind):
    """pack's AVX-512 build fits 16 weights a vector; the AVX2 build is the scalar code: the same answer and
    the same buffers in every form tried."""
    pack, scalar = (native.function(packed_linear.PACK_SOURCE, "slotserve_pack_weight", packed_linear._PACK_ARGS, flags)
                    for flags in ((), ("-mno-avx512f",)))
    if scalar is None:
        pytest.skip("no AVX2 build here")
    w = _packing_cases()[kind]
    n, k = w.shape
    for offsets in (False, True):
        for narrow, halves in ((True, False), (True, True), (False, False)):
            scalars = -(-n // PAIR) * PAIR * (k // BLOCK) * (2 if halves else 1)
            outputs = []
            for f in (pack, scalar):
                values = torch.zeros(scalars * BLOCK // (2 if halves else 1), dtype=torch.int8 if narrow
                                     else torch.int16)
                scales, offs = torch.zeros(scalars), torch.zeros(scalars) if offsets else None
                fit = f(w.data_ptr(), n, k, offs.data_ptr() if offsets else None, values.data_ptr(),
                        scales.data_ptr(), narrow, halves, 2)
                outputs.append((fit, values, scales.view(torch.int32), offs))
            (fit, *buffers), (scalar_fit, *scalar_buffers) = outputs
            assert fit == scalar_fit
            if fit == 0:
                assert all(a is b or torch.equal(a.view(torch.int32), b.view(torch.int32))
                           for a, b in zip(buffers, scalar_buffers, strict=True))


@pytest.mark.parametrize("kind", FEW_ROW_WEIGHTS)
def test_few_rows_take_x_of_any_range(no_amx, kind):
    """The kernel writes x as integers per block of 32 (few_rows.c): NaN and infinity still give NaN, in their
    row alone; values 30 binary orders apart in one block stay as close to float64 as a float32 GEMM; all-zero
    rows give the bias; rows of tiny values (under 2^-97) keep 16 bits at least."""
    n, k = 70, 256
    g = torch.Generator().manual_seed(7)
    w, bias = FEW_ROW_WEIGHTS[kind](n, k), torch.randn(n, generator=g)
    packed = PackedWeight.pack(w, bias)
    x = torch.randn(4, k, generator=g)
    x[1, 40], x[2, 200] = float("nan"), float("-inf")
    out = packed(x)
    assert out[1:3].isnan().all() and not out[[0, 3]].isnan().any()
    assert torch.equal(out[0], packed(x[:1])[0]) and torch.equal(out[3], packed(x[3:])[0])
    spread = torch.randn(3, k, generator=g) * torch.pow(2.0, torch.randint(-30, 1, (3, k), generator=g).float())
    exact = spread.double() @ w.double().T + bias.double()
    err, fp32_err = ((y.double() - exact).abs().max().item()
                     for y in (packed(spread), torch.nn.functional.linear(spread, w, bias)))
    assert err <= 2 * fp32_err + 1e-6
    assert torch.equal(packed(torch.zeros(2, k)), bias.expand(2, n))
    tiny = torch.randn(1, k, generator=g) * 2.0**-110
    exact = (tiny.double() @ w.double().T) * 2.0**110
    ours = PackedWeight.pack(w)(tiny).double() * 2.0**110
    assert (ours - exact).abs().max() <= 2**-16 * exact.abs().max()


@pytest.mark.skipif(not packed_linear.digit_tiles_available(), reason="no AMX int8 tiles here")
@pytest.mark.parametrize("kind", FEW_ROW_WEIGHTS)
def test_tile_products_give_the_vector_units_bits(kind):
    """Where AMX runs, few_rows.c takes calls of TILE_ROWS on its int8 tiles: the same integer sums and the same
    float operations as on the vector units, so the same bits for any rows (padded tiles, passes of 32 rows), any
    width (8, 5 or 4 bits a value, halves), a last partial pair of weight tiles, tiny and NaN inputs."""
    n, k = 1000, 896
    w = FEW_ROW_WEIGHTS[kind](n, k)
    packed = PackedWeight.pack(w, torch.randn(n))
    assert (packed.tile_rows, packed.min_rows) == (
        (TILE_ROWS.start, TILE_ROWS.stop if not packed.halves else packed_linear.ALL_ROWS))
    compact = PackedWeight.of(packed_linear.pack_narrow(w), packed.bias)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, k, generator=g)
    x[3, :40] *= 2.0**-40
    x[5, 100] = float("nan")
    gemm = native.function(packed_linear.FEW_ROWS_SOURCE, "slotserve_few_rows_gemm", packed_linear._GEMM_ARGS)
    for p in (packed, compact):
        for rows in (*range(1, 18), 31, 32, 33, 70):
            outs = []
            for tile_rows in (0, 1):  # the vector units for every row count, then the tiles for every one
                p.packing.tile_rows = tile_rows
                out = torch.empty(rows, n)
                assert gemm(x.data_ptr(), ctypes.byref(p.packing), p.bias.data_ptr(), out.data_ptr(), rows, n, k,
                            2) == 0
                outs.append(out)
            p.packing.tile_rows = p.tile_rows
            torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0, equal_nan=True, msg=f"{p.bits} bits {rows}")
            assert rows <= 6 or (outs[1][5].isnan().all() and not outs[1][[4, 6]].isnan().any())

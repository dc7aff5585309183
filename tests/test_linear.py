"""The model's Linear and the native small GEMM behind it: F.linear's results for every batch size,
bitwise the same row whatever batch it is in, and torch's path wherever the kernel does not apply."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from slotserve.kernels import native, small_gemm
from slotserve.layers import linear
from slotserve.layers.linear import NATIVE_ROWS, TRANSPOSED_ROWS, Linear

needs_kernel = pytest.mark.skipif(not small_gemm.available(), reason="no C compiler with OpenMP here")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 100])
@pytest.mark.parametrize(("k", "n"), [(1, 1), (7, 5), (64, 13), (96, 25), (896, 131), (2100, 9)])
def test_small_gemm_matches_float64(rows, k, n):
    torch.manual_seed(rows * 1000 + n)
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    atol = 1e-4 * max(1, k // 512)  # float32 rounding grows with the length of the sum
    torch.testing.assert_close(small_gemm.small_gemm(x, w, b), _reference(x, w, b), rtol=1e-5, atol=atol)
    torch.testing.assert_close(small_gemm.small_gemm(x, w), _reference(x, w, None), rtol=1e-5, atol=atol)


@needs_kernel
@pytest.mark.parametrize("sizes", [(1, 2, 3, 6, 7, 11), (12, 16, 17, 32, 47, 64)])  # the two forms of the kernel
# 901: a tail past the last full vector; 2100: K in blocks from 17 rows on (whole up to 16), so the bits
# must not depend on the blocking either
@pytest.mark.parametrize("k", [901, 64, 2100])
def test_a_row_gets_the_same_bits_in_any_batch(sizes, k):
    """N = 301 leaves a narrower last tile of weight rows for every tile shape: where the compiler chose
    which products to fuse, that tile's rows came out differently alone and in a batch (AVX2, gcc 12)."""
    torch.manual_seed(0)
    w, b = torch.randn(301, k), torch.randn(301)
    x = torch.randn(64, k)
    results = []
    for rows in sizes:
        batch = torch.cat([x[1:rows], x[:1]])  # the row last, at a different offset each time
        results.append(small_gemm.small_gemm(batch, w, b)[-1])
    assert all(torch.equal(r, results[0]) for r in results), sizes


@needs_kernel
def test_small_gemm_uses_every_thread_count_the_same_way():
    torch.manual_seed(0)
    x, w = torch.randn(32, 200), torch.randn(1000, 200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = small_gemm.small_gemm(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(small_gemm.small_gemm(x, w), one)


@needs_kernel
def test_small_gemm_rejects_bad_input():
    with pytest.raises(ValueError, match="does not multiply"):
        small_gemm.small_gemm(torch.randn(4, 8), torch.randn(3, 9))
    with pytest.raises(ValueError, match="do not fit together"):
        small_gemm.small_gemm(torch.randn(4, 8), torch.randn(3, 8), torch.randn(4))
    with pytest.raises(ValueError, match="weight must be a contiguous float32"):
        small_gemm.small_gemm(torch.randn(4, 8), torch.randn(3, 8, dtype=torch.float64))
    x = torch.randn(8, 4).t()  # non-contiguous input is copied, not misread
    w = torch.randn(3, 8)
    torch.testing.assert_close(small_gemm.small_gemm(x, w), _reference(x, w, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("native_kernel", [True, False])
def test_every_batch_size_matches_nn_linear(bias, native_kernel, monkeypatch):
    if not native_kernel:
        monkeypatch.setattr(linear, "NATIVE_ROWS", range(0))
    elif not small_gemm.available():
        pytest.skip("no C compiler with OpenMP here")
    torch.manual_seed(0)
    layer = Linear(96, 80, bias=bias)
    for rows in (1, 2, 3, NATIVE_ROWS.start, TRANSPOSED_ROWS.start - 1, TRANSPOSED_ROWS.start, 33,
                 NATIVE_ROWS.stop - 1, NATIVE_ROWS.stop, 200):
        x = torch.randn(rows, 96)
        with torch.inference_mode():
            out = layer(x)
        assert out.shape == (rows, 80)
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert torch.equal(out.view(rows, 8, 10).reshape(rows, 80), out)  # views work on any result layout


@pytest.mark.parametrize("onednn", [True, False])
def test_prefill_rows_match_nn_linear_through_onednn_or_mkl(onednn, monkeypatch):
    if onednn and not linear.ONEDNN:
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setattr(linear, "ONEDNN", onednn)
    torch.manual_seed(0)
    for bias in (True, False):
        layer = Linear(96, 80, bias=bias)
        wide = torch.randn(300, 128)
        for x in (wide[:, :96], wide[:, :96].contiguous(), wide[:200, :96].t().contiguous().t()):
            with torch.inference_mode():
                out = layer(x)
            torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_decode_sized_batches_go_through_the_kernel():
    torch.manual_seed(0)
    layer = Linear(64, 48)
    x = torch.randn(8, 64)
    with torch.inference_mode():
        assert torch.equal(layer(x), small_gemm.small_gemm(x, layer.weight, layer.bias))


@needs_kernel
def test_a_replaced_weight_is_the_one_multiplied():
    """The layer binds the kernel to its weight once; a new weight (moved to huge pages, reloaded) rebinds it."""
    torch.manual_seed(0)
    layer = Linear(64, 48)
    x = torch.randn(4, 64)
    with torch.inference_mode():
        layer(x)
        layer.weight = nn.Parameter(torch.randn(48, 64), requires_grad=False)
        layer.bias = None
        assert torch.equal(layer(x), small_gemm.small_gemm(x, layer.weight))


def test_training_and_other_dtypes_take_nn_linear():
    layer = Linear(16, 8)
    out = layer(torch.randn(8, 16))  # grad enabled, weight requires grad: autograd's path
    assert out.grad_fn is not None
    layer = Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(32, 16, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    x3 = torch.randn(2, 32, 16, dtype=torch.bfloat16)
    assert layer(x3).shape == (2, 32, 8)


def test_a_kernel_that_cannot_be_built_leaves_torch_in_charge(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLOTSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING):
        assert native.load.__wrapped__(small_gemm.SOURCE) is None
    assert "unavailable, using torch's" in caplog.text
    monkeypatch.setenv("SLOTSERVE_NATIVE_KERNELS", "0")
    assert native.load.__wrapped__(small_gemm.SOURCE) is None


@needs_kernel
def test_the_build_lands_in_the_cache_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOTSERVE_CACHE", str(tmp_path))
    assert native.load.__wrapped__(small_gemm.SOURCE) is not None
    built = list((tmp_path / "kernels").glob("*/small_gemm.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert native.load.__wrapped__(small_gemm.SOURCE) is not None
    assert built[0].stat().st_mtime_ns == stamp


@needs_kernel
def test_builds_unused_for_a_month_are_pruned_by_the_next_build(tmp_path, monkeypatch):
    monkeypatch.setenv("SLOTSERVE_CACHE", str(tmp_path))
    old, recent = tmp_path / "kernels" / "old", tmp_path / "kernels" / "recent"
    for build in (old, recent):
        build.mkdir(parents=True)
        (build / "small_gemm.so").write_bytes(b"")
    month_ago = time.time() - (native.STALE_DAYS + 1) * 86400
    os.utime(old, (month_ago, month_ago))
    assert native.load.__wrapped__(small_gemm.SOURCE) is not None
    assert not old.exists() and recent.exists()
    (current,) = (d for d in (tmp_path / "kernels").iterdir() if d != recent)
    os.utime(current, (month_ago, month_ago))
    native.load.__wrapped__(small_gemm.SOURCE)  # a load marks its build as in use
    assert current.stat().st_mtime > month_ago + 86400

"""RMSNorm, rotary embedding, SwiGLU, argmax: the native row kernels against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch

from slotserve.kernels import norm_rotary_swiglu_argmax as kernels
from slotserve.layers.activation import silu_mul
from slotserve.layers.norm import RMSNorm
from slotserve.layers.rotary import apply_rotary

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="no C compiler with OpenMP here")


def _norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).float()


def _rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.double().chunk(2, dim=-1)
    cos, sin = cos.double(), sin.double()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).float()


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 896), (32, 896), (100, 13), (5, 14, 64), (1, 1)])
def test_rms_norm_matches_reference(shape):
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = torch.randn(shape[-1])
    x = torch.randn(*shape)
    with torch.inference_mode():
        out = norm(x)
    torch.testing.assert_close(out, _norm_reference(x, norm.weight, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("shape", [(1, 896), (100, 13), (1, 1)])
def test_add_and_norm_adds_the_residual_then_normalizes(shape, native, monkeypatch):
    if native and not kernels.available():
        pytest.skip("no C compiler with OpenMP here")
    if not native:
        monkeypatch.setattr(kernels, "applies", lambda *t: False)
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = torch.randn(shape[-1])
    x, residual = torch.randn(*shape), torch.randn(*shape)
    total = residual + x
    with torch.inference_mode():
        out, stream = norm.add_and_norm(x, residual.clone())
        separate = norm(total)
    assert torch.equal(stream, total)  # the same bits as the separate add
    assert torch.equal(out, separate)
    torch.testing.assert_close(out, _norm_reference(total, norm.weight, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize(("tokens", "inner"), [(1, 4864), (70, 19), (3, 1)])
def test_silu_mul_matches_reference(tokens, inner, native, monkeypatch):
    if native and not kernels.available():
        pytest.skip("no C compiler with OpenMP here")
    if not native:
        monkeypatch.setattr(kernels, "applies", lambda *t: False)
    torch.manual_seed(0)
    x = torch.randn(tokens, 2 * inner) * 4
    x[0, :3] = torch.tensor([-200.0, 200.0, 0.0])[: min(3, inner)]  # exp's overflow and underflow
    with torch.inference_mode():
        out = silu_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    torch.testing.assert_close(out, (gate * torch.sigmoid(gate) * up).float(), rtol=1e-5, atol=1e-5)
    if native:
        with torch.inference_mode():
            assert torch.equal(silu_mul(x[-1:]), out[-1:])  # a row's bits do not depend on the batch


@needs_kernel
@pytest.mark.parametrize(("tokens", "heads", "dim"), [(1, 14, 64), (33, 2, 64), (100, 3, 10), (70, 8, 128)])
def test_rotary_matches_reference(tokens, heads, dim):
    torch.manual_seed(0)
    x = torch.randn(tokens, heads, dim)
    cos, sin = torch.randn(tokens, 1, dim // 2), torch.randn(tokens, 1, dim // 2)
    with torch.inference_mode():
        out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out, _rotary_reference(x, cos, sin), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_rotary_reads_a_column_slice_of_wider_rows():
    """q and k rotated in place in a merged q/k/v row: the tokens lie a whole row apart."""
    torch.manual_seed(0)
    qkv = torch.randn(33, (14 + 2 + 2) * 64)
    qk = qkv[:, : 16 * 64].view(33, 16, 64)
    assert not qk.is_contiguous()
    cos, sin = torch.randn(33, 1, 32), torch.randn(33, 1, 32)
    with torch.inference_mode():
        out = apply_rotary(qk, cos, sin)
        assert out.is_contiguous() and torch.equal(out, apply_rotary(qk.contiguous(), cos, sin))
    torch.testing.assert_close(out, _rotary_reference(qk, cos, sin), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="dense heads"):
        kernels.rotary(torch.randn(4, 16, 2).transpose(1, 2), torch.randn(4, 8), torch.randn(4, 8))


@needs_kernel
def test_a_row_gets_the_same_bits_in_any_batch():
    torch.manual_seed(0)
    norm = RMSNorm(896, 1e-6)
    x = torch.randn(100, 896)  # 100 rows: the kernel splits them over the threads
    cos, sin = torch.randn(100, 1, 32), torch.randn(100, 1, 32)
    q = torch.randn(100, 14, 64)
    with torch.inference_mode():
        assert torch.equal(norm(x)[7], norm(x[7:8])[0])
        assert torch.equal(apply_rotary(q, cos, sin)[7], apply_rotary(q[7:8], cos[7:8], sin[7:8])[0])


def test_autograd_and_other_dtypes_keep_the_torch_path():
    norm = RMSNorm(16, 1e-6)
    out = norm(torch.randn(4, 16))  # grad enabled, weight requires grad
    assert out.grad_fn is not None
    x = torch.randn(4, 2, 16, dtype=torch.bfloat16)
    cos, sin = torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    assert apply_rotary(x, cos, sin).dtype == torch.bfloat16


@needs_kernel
def test_row_kernels_reject_shapes_that_do_not_fit():
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(torch.randn(4, 16), torch.randn(15), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        kernels.rms_norm(torch.randn(4, 16), torch.randn(16), 1e-6, torch.randn(3, 16))
    with pytest.raises(ValueError, match="silu_mul"):
        kernels.silu_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.rotary(torch.randn(4, 2, 16), torch.randn(4, 7), torch.randn(4, 7))


@needs_kernel
@pytest.mark.parametrize("shape", [(32, 151936), (1, 151936), (3, 5), (4, 8), (2, 17), (7, 1), (200, 40)])
def test_argmax_matches_torch(shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))


@needs_kernel
def test_argmax_takes_the_first_of_equals_and_nan_as_torch_does():
    x = torch.zeros(7, 43)  # 43: a tail past the last full vector of 8 or 16
    x[1, 7] = x[1, 30] = 3.0  # equals in different vector lanes
    x[2, 3] = x[2, 11] = x[2, 41] = 2.0  # equals in the same lane of two vectors, and one in the tail
    x[3] = float("-inf")
    x[4, 9] = x[4, 20] = float("nan")
    x[4, 30] = float("inf")
    x[5, 33] = x[5, 39] = float("inf")
    x[6, 42] = 1.0  # the largest only in the tail
    assert kernels.argmax(x).tolist() == x.max(dim=-1).indices.tolist() == [0, 7, 3, 0, 9, 33, 42]


@needs_kernel
def test_argmax_rejects_what_has_no_largest_value():
    with pytest.raises(ValueError, match="argmax"):
        kernels.argmax(torch.zeros(3, 0))
    with pytest.raises(ValueError, match="argmax"):
        kernels.argmax(torch.zeros(8))

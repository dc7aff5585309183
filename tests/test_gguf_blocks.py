"""K-quant tensors packed from their bytes (quantization/gguf_blocks.py): the weights gguf-py dequantizes, bit for bit,
in 4, 5 or 6 bits a value under int8 scale and offset codes, and products as close to float64 as float32's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from slotserve.quantization import packed_linear
from slotserve.quantization.gguf_blocks import packed_k_quant
from slotserve.quantization.packed_linear import FEW_ROWS, PackedWeight
from tests.test_few_rows import OTHER_BUILDS, assert_builds_agree

pytestmark = pytest.mark.skipif(not packed_linear.built(), reason="native kernels not built here")

# Where each super-block keeps its float16 factors (d, dmin) and its block scales (and minimums).
FACTORS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
SCALES = {Q.Q4_K: slice(4, 16), Q.Q5_K: slice(4, 16), Q.Q6_K: slice(192, 208)}


def _random_k_quant(n: int, k: int, qtype: Q, seed: int) -> np.ndarray:
    """[n, bytes] of random blocks: any bytes, but the factors small float16s (Q6_K's of either sign)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n * k // 256, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    sign = rng.choice([-1, 1], len(raw)) if qtype == Q.Q6_K else 1
    for at in FACTORS[qtype]:
        factors = sign * (rng.random(len(raw)) * 1e-3 + 1e-5)
        raw[:, at:at + 2] = factors.astype(np.float16).view(np.uint8).reshape(-1, 2)
    raw[::7, SCALES[qtype]] = 0  # super-blocks whose scales (and minimums) are all zero
    raw[1::7, SCALES[qtype]] = 128 if qtype == Q.Q6_K else 63  # ... all the largest (Q6_K's: -128)
    return raw.reshape(n, -1)


@pytest.mark.parametrize(("qtype", "bits", "zero"), [(Q.Q4_K, 4, 0), (Q.Q5_K, 5, 0), (Q.Q6_K, 6, 32)])
def test_k_quants_pack_from_their_bytes_exactly(qtype, bits, zero):
    n, k = 70, 1024  # a partial pair at the end
    raw = _random_k_quant(n, k, qtype, seed=bits)
    tensor = packed_k_quant(raw, qtype)
    w = torch.from_numpy(dequantize(raw, qtype).reshape(n, k))
    assert (tensor.bits, tensor.zero, tensor.halves) == (bits, zero, qtype == Q.Q6_K)
    codes = [tensor.scales] + ([] if tensor.offsets is None else [tensor.offsets])
    assert all(c.codes.dtype == torch.int8 and c.factors is not None for c in codes)
    assert (tensor.offsets is None) == (qtype == Q.Q6_K)
    packed = PackedWeight.of(tensor)
    assert torch.equal(packed.dequantize(), w)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(0))
    for rows in (1, FEW_ROWS, FEW_ROWS + 1, len(x)):
        exact = x[:rows].double() @ w.double().T
        ours, float32 = ((y.double() - exact).abs().max().item() for y in (packed(x[:rows]), x[:rows] @ w.T))
        assert ours <= 2 * float32 + 1e-6, rows


@pytest.mark.parametrize("build", OTHER_BUILDS)
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_other_builds_read_int8_codes_to_the_same_bits(qtype, build):
    packed = PackedWeight.of(packed_k_quant(_random_k_quant(70, 1024, qtype, seed=1), qtype))
    assert_builds_agree(packed, build, torch.randn(FEW_ROWS + 1, 1024), (1, FEW_ROWS + 1))

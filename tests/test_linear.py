"""The model's Linear: the small-batch product taken as W @ x^T gives nn.Linear's result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slotserve.layers.linear import SMALL_BATCH, Linear


@pytest.mark.parametrize("bias", [True, False])
def test_every_batch_size_matches_nn_linear(bias):
    torch.manual_seed(0)
    layer = Linear(96, 80, bias=bias)
    for rows in (1, 2, SMALL_BATCH.start - 1, SMALL_BATCH.start, 33, SMALL_BATCH.stop - 1, SMALL_BATCH.stop, 200):
        x = torch.randn(rows, 96)
        with torch.inference_mode():
            out = layer(x)
        assert out.shape == (rows, 80)
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert torch.equal(out.view(rows, 8, 10).reshape(rows, 80), out)  # views work on the transposed result


def test_other_shapes_and_dtypes_take_nn_linear():
    layer = Linear(16, 8).to(torch.bfloat16)
    x = torch.randn(32, 16, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    x3 = torch.randn(2, 32, 16, dtype=torch.bfloat16)
    assert layer(x3).shape == (2, 32, 8)

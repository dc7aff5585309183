"""GGUF conversion of Qwen3-MoE (`qwen3moe`, llama.cpp's stacked expert tensors): tiny synthetic GGUFs
from random `transformers` models, converted, loaded by slotserve, and compared with the source."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from slotserve.config import ModelConfig
from slotserve.engine.model_runner import ModelRunner, ScheduledSeq, Want
from slotserve.models import gguf_reader
from slotserve.models.gguf import convert_gguf, hf_config
from slotserve.models.gguf_reader import GGUFError, read_gguf
from slotserve.models.loader import load_model
from slotserve.models.qwen3_moe import SparseMoeBlock
from slotserve.parallel.threadpool import ThreadPool
from tests.gguf_fixtures import TinyGGUF, converted_arrays, hf_checkpoint, hf_model_of, tiny_gguf

IDS = [3, 70, 200, 5, 99, 264, 1, 42, 17, 250, 128, 7, 64, 33, 180, 9]


def _convert(tg: TinyGGUF, tmp_path: Path, **kwargs) -> Path:
    out = tmp_path / "out"
    convert_gguf(tg.write(tmp_path / "m.gguf"), out, **kwargs)
    return out


def _logits_diff(out: Path, reference) -> float:
    """Max |logit difference| between slotserve on the converted directory and a transformers model."""
    model, cfg = load_model(out, torch.float32, torch.device("cpu"))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == [
        hasattr(layer.mlp, "experts") for layer in reference.model.layers]
    runner = ModelRunner(model, cfg, num_blocks=4, block_size=4)
    ours = runner.execute([ScheduledSeq(IDS, 0, [0, 1, 2, 3], want=Want.ALL)])[0].logits
    with torch.no_grad():
        ref = reference(torch.tensor([IDS])).logits[0]
    return (ours - ref).abs().max().item()


def test_f32_gguf_gives_the_source_checkpoint_and_logits(tmp_path):
    tg, source = tiny_gguf("qwen3moe", mixed=False, mlp_only_layers=(1,))  # sparse, dense, sparse
    assert tg.tensors["blk.0.ffn_gate_exps.weight"].shape == (8, 32, 64)  # [n_expert, n_ff_exp, n_embd]
    assert tg.tensors["blk.0.ffn_down_exps.weight"].shape == (8, 64, 32)  # [n_expert, n_embd, n_ff_exp]
    out = _convert(tg, tmp_path)

    cfg = ModelConfig.from_dir(out)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
        "Qwen3MoeForCausalLM", 8, 2, 32)
    assert (cfg.norm_topk_prob, cfg.decoder_sparse_step, cfg.mlp_only_layers, cfg.qk_norm) == (True, 1, (1,), True)

    # Tensor for tensor what transformers saves, which pins the experts' orientation and order.
    expected, got = hf_checkpoint(source), converted_arrays(out)
    assert set(got) == set(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)
    assert _logits_diff(out, source) <= 1e-4


def test_q8_0_experts_dequantized_in_chunks_across_expert_boundaries(tmp_path, monkeypatch):

    # Chunks of 5 rows of 64 (10 of 32): most cross from one expert's slice into the next one's.
    monkeypatch.setattr(gguf_reader, "_DEQUANT_CHUNK_ELEMENTS", 64 * 5)
    tg, source = tiny_gguf("qwen3moe", tie=True, mixed=False)
    tg.types = {name: gguf.GGMLQuantizationType.Q8_0 for name in tg.tensors if name.endswith("_exps.weight")}
    out = _convert(tg, tmp_path, pool=ThreadPool(2))

    got = converted_arrays(out)
    assert len([n for n in got if ".experts." in n]) == 3 * 8 * 3
    for name, array in got.items():
        np.testing.assert_array_equal(array, tg.expected_hf(name), err_msg=name)
    # The same logits as transformers on the converted weights; close to the source's (|logits| <= ~6)
    # within Q8_0's error, which a near-tie in routing can amplify.
    assert _logits_diff(out, hf_model_of(out)) <= 1e-4
    assert _logits_diff(out, source) <= 0.15


def test_missing_expert_tensor(tmp_path):
    tg, _ = tiny_gguf("qwen3moe", mixed=False)
    del tg.tensors["blk.2.ffn_down_exps.weight"]
    path = tg.write(tmp_path / "bad.gguf")
    with pytest.raises(GGUFError, match=r"bad\.gguf: missing tensors: blk\.2\.ffn_down_exps\.weight$"):
        convert_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_expert_count_must_match_the_stacked_tensors(tmp_path):
    tg, _ = tiny_gguf("qwen3moe", mixed=False)
    tg.tensors["blk.0.ffn_up_exps.weight"] = tg.tensors["blk.0.ffn_up_exps.weight"][:7]
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_up_exps\.weight' has shape \[7, 32, 64\], "
                                        r"the config implies \[8, 32, 64\]"):
        convert_gguf(tg.write(tmp_path / "bad.gguf"), tmp_path / "out")


@pytest.mark.parametrize(("metadata", "expected"), [
    ({}, {"norm_topk_prob": True}),  # absent: every Qwen3-MoE release renormalises
    ({"qwen3moe.expert_weights_norm": False}, {"norm_topk_prob": False}),
    ({"qwen3moe.expert_used_count": 9}, "expert_used_count 9 must be between 1 and expert_count 8"),
    ({"qwen3moe.expert_gating_func": 2}, "expert gating function 2 is not supported"),
])
def test_moe_metadata(tmp_path, metadata, expected):
    tg, _ = tiny_gguf("qwen3moe", mixed=False)
    tg.metadata.update(metadata)
    g = read_gguf(tg.write(tmp_path / "m.gguf"))
    if isinstance(expected, str):
        with pytest.raises(GGUFError, match=expected):
            hf_config(g)
    else:
        assert hf_config(g).items() >= expected.items()

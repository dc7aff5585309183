"""Int8 weights (quantization="int8") on tiny random models: close to float32, every linear swapped,
the tied embedding left in float, greedy output the same alone or batched, bad settings refused."""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from slotserve import LLM, SamplingParams
from slotserve.bench.quality import add_arguments, run_quality
from slotserve.config import EngineConfig, ModelConfig
from slotserve.engine.model_runner import ScheduledSeq, Want
from slotserve.layers.linear import FloatLinear
from slotserve.models.qwen3_moe import SparseMoeBlock
from slotserve.quantization.int8 import Int8Linear, quantize_int8
from tests.helpers import assert_figures

PROMPTS = ["Hello there", "def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]
# 24 tokens: batched sequences outgrow their first block, so decode reads non-consecutive blocks.
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SMALL_CACHE = dict(kv_cache_memory=8 << 20)
# Relative error of the logits, ||int8 - fp32|| / ||fp32||. One int8 linear is off by ~1 % of its
# output's norm; the random tiny model compounds that to 4.4 % (qwen2 fixture) through its layers.
LOGITS_REL_TOL = 0.08


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    engine = llm.engine
    blocks = engine.kv.pool.allocate(engine.kv.blocks_for(len(ids)))
    try:
        return engine.runner.execute([ScheduledSeq(ids, 0, blocks, want=Want.ALL)])[0].logits
    finally:
        engine.kv.pool.free(blocks)


@pytest.fixture(scope="module")
def llms(tiny_qwen2):
    return LLM(str(tiny_qwen2), **SMALL_CACHE), LLM(str(tiny_qwen2), quantization="int8", **SMALL_CACHE)


def test_int8_linear_close_to_float_and_batch_invariant():
    torch.manual_seed(0)
    linear = nn.Linear(96, 80)
    quantized = Int8Linear(linear)
    x = torch.randn(9, 96)
    x[2] *= 1000  # an outlier token must not cost the other rows their resolution
    x[4] = 0
    with torch.no_grad():
        ref = linear(x)
    out = quantized(x)
    for row in range(len(x)):
        assert _relative_error(out[row], ref[row]) < 0.02, row  # ~1 % measured
    alone = torch.cat([quantized(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(alone, out)  # bitwise: a row's result does not depend on its batch


def test_int8_logits_close_to_float32(llms):
    fp32, int8 = llms
    ids = fp32.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. def f(x): return x * 2")
    ref, out = _logits(fp32, ids), _logits(int8, ids)
    assert _relative_error(out, ref) < LOGITS_REL_TOL


def test_every_linear_replaced(llms):
    model = llms[1].engine.core.model
    assert not any(type(m) is nn.Linear for m in model.modules())
    layers = model.config.num_hidden_layers
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 4 * layers + 1  # qkv o gate_up down, head


def test_tied_embedding_stays_float(tiny_qwen3):
    llm = LLM(str(tiny_qwen3), quantization="int8", **SMALL_CACHE)
    model = llm.engine.core.model
    assert isinstance(model.lm_head, Int8Linear)
    embedding = model.model.embed_tokens.weight
    assert embedding.dtype == torch.float32 and not embedding.is_meta
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids


def test_moe_router_stays_float():
    cfg = ModelConfig.from_dict(dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=32, hidden_size=16,
        intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8))
    block = quantize_int8(SparseMoeBlock(cfg))
    assert type(block.gate) is FloatLinear  # expert choices stay those of float32
    assert all(isinstance(m, Int8Linear) for e in block.experts.values() for m in (e.gate_up_proj, e.down_proj))


def test_int8_greedy_same_alone_and_batched(llms):
    int8 = llms[1]
    alone = [int8.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    together = [o.outputs[0].token_ids for o in int8.generate(PROMPTS, GREEDY)]
    assert together == alone and all(len(t) == GREEDY.max_tokens for t in alone)


@pytest.mark.parametrize("settings, message", [
    (dict(quantization="int4"), "unknown value 'int4'"),
    (dict(quantization="int8", device="cuda"), "CPU only"),
    (dict(quantization="int8", dtype="bfloat16"), "float32"),
])
def test_bad_quantization_settings_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_quality_bench_runs(tiny_qwen2):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--new-tokens", "4", "--decode-steps", "2", "--batch", "2", "--context-len", "8",
                              "--repeats", "1"])
    result = run_quality(EngineConfig(model=str(tiny_qwen2), quantization="int8", **SMALL_CACHE), args)
    assert (result["reference"]["quantization"], result["engine"]["quantization"]) == (None, "int8")
    assert result["reference"]["perplexity"] > 1 and result["engine"]["perplexity"] > 1
    assert 0 <= result["comparison"]["greedy_identical_fraction"] <= 1
    assert result["comparison"]["engine_greedy_same_alone_and_batched"]
    assert_figures(result, "engine.decode_batch1_tokens_per_s")


@pytest.mark.parametrize("which", ["float32", "int8"])
def test_decode_logits_bitwise_the_same_alone_and_batched(llms, which):
    """A decode row's logits do not depend on its company or on how its blocks lie (scattered here).
    int8 linears are exact per row; float32 ones, where the native small GEMM runs, sum every row in an
    order fixed by its length for batches of 1..11 rows. And each way of reading the cache gives a row
    the same bits: the paged kernel by construction, torch's SDPA because every read is padded to the
    same key count class."""
    engine = llms[which == "int8"].engine
    if which == "float32" and not engine.runner.native_gemm:
        pytest.skip("float32 rows are batch-invariant only through the native small GEMM")
    runner, pool = engine.runner, engine.kv.pool
    default_mode = runner.decode_mode
    lengths = [5, 19, 33, 12]
    tables: list[list[int]] = [[] for _ in lengths]
    for _ in range(max(engine.kv.blocks_for(n + 1) for n in lengths)):  # round-robin: non-consecutive
        for table in tables:
            table.extend(pool.allocate(1))
    results: dict[str, list[list[torch.Tensor]]] = {}
    try:
        with torch.inference_mode():
            for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
                runner.execute([ScheduledSeq([100 + 7 * i + j for j in range(n)], 0, table, want=Want.NONE)])
            step = [ScheduledSeq([42 + i], n, table) for i, (n, table) in enumerate(zip(lengths, tables, strict=True))]
            for mode in dict.fromkeys([default_mode, "batched", "per_seq"]):
                runner.decode_mode = mode
                alone = [runner.execute([seq])[0].logits for seq in step]
                results[mode] = [alone, [r.logits for r in runner.execute(step)]]
    finally:
        runner.decode_mode = default_mode
        for table in tables:
            pool.free(table)
    for alone, together in results.values():
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(results["batched"][1], results["per_seq"][1], strict=True))

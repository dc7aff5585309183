"""Qwen3-MoE: logit parity with `transformers` on tiny random configs, through the batching engine,
and the loader's refusal of weights that cannot fit in memory (Qwen3-30B-A3B in float32)."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from slotserve import SamplingParams
from slotserve.config import EngineConfig, ModelConfig
from slotserve.engine.llm_engine import LLMEngine
from slotserve.layers.linear import MergedLinear
from slotserve.models import loader, qwen3_moe
from slotserve.models.loader import (
    InsufficientMemoryError,
    MemoryInfo,
    WeightsError,
    available_memory,
    build_meta_model,
    check_memory,
    checkpoint_dtypes,
    load_model,
    weight_files,
    weight_footprint,
)
from slotserve.models.qwen3_moe import SparseMoeBlock
from slotserve.parallel import threadpool as tp
from tests.conftest import QWEN_TOKENIZER_DIR
from tests.helpers import run_to_completion
from tests.test_model_parity import _check_flat_batch, _check_prefill_and_decode, _runner

CPU = torch.device("cpu")
GIB = 1 << 30
TINY_MOE = dict(
    vocab_size=151936, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=1024, initializer_range=0.2, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1e6,
    tie_word_embeddings=False,
)


def build_tiny_moe(path, seed=0, **overrides):
    """Saves a tiny random Qwen3-MoE checkpoint with the real tokenizer; returns the HF model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(**{**TINY_MOE, **overrides})
    cfg.eos_token_id = 151645
    model = Qwen3MoeForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = [151645, 151643]
    model.save_pretrained(path)
    if QWEN_TOKENIZER_DIR is not None:
        for f in QWEN_TOKENIZER_DIR.iterdir():
            shutil.copy(f, path / f.name)
    return model


# ---- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_topk_prob,decoder_sparse_step,mlp_only_layers,tie", [
    (True, 1, [], False),  # every layer sparse
    (False, 1, [1], False),  # sparse, dense, sparse
    (True, 2, [], True),  # only layer 1 is on the cadence
    (False, 2, [], False),
])
def test_prefill_and_decode_match_transformers(tmp_path, norm_topk_prob, decoder_sparse_step, mlp_only_layers, tie):
    hf = build_tiny_moe(tmp_path, norm_topk_prob=norm_topk_prob, decoder_sparse_step=decoder_sparse_step,
                        mlp_only_layers=mlp_only_layers, tie_word_embeddings=tie)
    runner = _runner(tmp_path)
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in runner.model.model.layers]
    assert ours == [hasattr(layer.mlp, "experts") for layer in hf.model.layers]

    # The parity must not be vacuous: each sparse layer routes the prompt's tokens to many experts.
    chosen: dict[int, set[int]] = {}

    def record(layer_idx):
        def hook(module, args, router_logits):
            chosen.setdefault(layer_idx, set()).update(router_logits.topk(2).indices.flatten().tolist())
        return hook

    for i, layer in enumerate(runner.model.model.layers):
        if ours[i]:
            layer.mlp.gate.register_forward_hook(record(i))
    _check_prefill_and_decode(hf, runner, block_table=list(range(8)))
    assert chosen and all(len(experts) >= 5 for experts in chosen.values()), chosen


def test_flat_batch_equals_separate_runs(tmp_path):
    """Routing is per token: a prefill and a decode in one flat batch each get their solo logits."""
    build_tiny_moe(tmp_path, norm_topk_prob=True)
    _check_flat_batch(_runner(tmp_path))


def test_experts_on_the_pool_equal_the_serial_loop(monkeypatch):
    """The pool runs the loop's per-expert matmuls, one torch thread each, into disjoint rows, and the
    combine stays in the caller: bit-identical to the loop run on one torch thread. (Against a loop on
    2 torch threads it is not: MKL's sgemm rounds differently by thread count for some shapes.)"""
    cfg = ModelConfig.from_dict({**QWEN3_30B_A3B, "hidden_size": 64, "moe_intermediate_size": 32,
                                 "num_experts": 16, "num_experts_per_tok": 4})
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg)
    with torch.inference_mode():  # an inference tensor, as the engine's hidden states are
        x = torch.randn(100, 64)
    executors: set[int] = set()
    for expert in block.experts.values():
        expert.register_forward_hook(lambda *_: executors.add(tp.worker_id()))

    def forward(min_rows: int) -> torch.Tensor:
        executors.clear()
        monkeypatch.setattr(qwen3_moe, "POOL_MIN_ROWS", min_rows)
        with torch.inference_mode():  # a per-thread mode in torch: the workers must run in it too
            return block(x)

    saved = torch.get_num_threads()
    pool = tp.configure_pool(threads=2)
    try:
        torch.set_num_threads(1)
        serial = forward(len(x) * cfg.num_experts_per_tok + 1)  # more rows than there are
        assert executors == {-1}  # the loop, outside any pool region
        pooled = forward(1)
        assert executors == {0, 1}  # the worker and the caller
        assert torch.get_num_threads() == 1  # torch_parfor restores the caller's count
    finally:
        torch.set_num_threads(saved)
        pool.shutdown()
    assert torch.equal(pooled, serial)


# ---- through the engine ------------------------------------------------------------------------

BLOCK = 4
KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 32 * 4  # K and V, 3 layers, 2 kv heads, head_dim 32, float32
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(1000, 50_000) for _ in range(n)] for n in (5, 17, 33, 8, 60, 12, 41, 3)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    hf = build_tiny_moe(path, norm_topk_prob=True, mlp_only_layers=[1])
    return path, hf


def make_engine(path, blocks=512, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), block_size=BLOCK,
                                  kv_cache_memory=blocks * BLOCK * KV_BYTES_PER_TOKEN, **kwargs))


def run(engine: LLMEngine, prompts) -> dict[str, list[int]]:
    return run_to_completion(engine, prompts, GREEDY)


@pytest.fixture(scope="module")
def solo(moe_dir):
    engine = make_engine(moe_dir[0], enable_prefix_caching=False)
    return {f"r{i}": run(engine, [p])["r0"] for i, p in enumerate(PROMPTS)}


def test_greedy_matches_transformers_generate(moe_dir, solo):
    _, hf = moe_dir
    for i in (0, 1, 4):
        ids = torch.tensor([PROMPTS[i]])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=12, min_new_tokens=12)
        assert solo[f"r{i}"] == ref[0, ids.shape[1]:].tolist(), i


def test_batched_with_prefix_hits_and_preemption_equal_solo(moe_dir, solo):
    engine = make_engine(moe_dir[0])
    assert run(engine, PROMPTS) == solo
    assert run(engine, PROMPTS) == solo and engine.stats().prefix_cache_hit_rate > 0.4
    tight = make_engine(moe_dir[0], blocks=24, max_num_batched_tokens=16)  # 96 tokens: preemption
    assert run(tight, PROMPTS) == solo and tight.stats().num_preemptions > 0


# ---- loading -----------------------------------------------------------------------------------


def test_config_names_transformers_writes(moe_dir):
    cfg = ModelConfig.from_dir(moe_dir[0])  # transformers 5 saves num_experts as num_local_experts
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert (cfg.norm_topk_prob, cfg.decoder_sparse_step, cfg.mlp_only_layers) == (True, 1, (1,))
    dense = ModelConfig.from_dict({k: v for k, v in QWEN3_30B_A3B.items() if "expert" not in k})
    assert dense.num_experts == 0


def test_checkpoint_with_other_expert_count_is_rejected(tmp_path):
    build_tiny_moe(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.7.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"lacks 1 tensors: model\.layers\.2\.mlp\.experts\.7\.up_proj"):
        load_model(tmp_path, torch.float32, CPU)
    tensors["model.layers.0.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"experts\.8\.up_proj\.weight' has no place"):
        load_model(tmp_path, torch.float32, CPU)


# ---- memory check ------------------------------------------------------------------------------


def test_qwen3_30b_a3b_in_float32_is_refused_on_24_gib():
    model = build_meta_model(ModelConfig.from_dict(QWEN3_30B_A3B))
    assert 30.4e9 < sum(p.numel() for p in model.parameters()) < 30.6e9
    fp32 = weight_footprint(model, torch.float32, CPU)  # no checkpoint: every weight counts as a copy
    assert fp32.mapped == 0 and 120e9 < fp32.copied < 123e9
    this_machine = MemoryInfo(available=22 * GIB, total=24 * GIB)
    with pytest.raises(InsufficientMemoryError, match=r"need 113\.7 GiB of new memory on cpu, but only 22\.0 GiB"):
        check_memory(fp32, CPU, this_machine)
    if available_memory(CPU).total < fp32.copied:
        with pytest.raises(InsufficientMemoryError):
            check_memory(fp32, CPU)

    # A bfloat16 checkpoint loaded as bfloat16 is mapped, not copied, yet 57 GiB still exceed the RAM.
    bf16 = weight_footprint(model, torch.bfloat16, CPU, {name: torch.bfloat16 for name, _ in model.named_parameters()})
    assert bf16.copied == 0 and bf16.mapped == fp32.copied // 2
    with pytest.raises(InsufficientMemoryError, match=r"56\.9 GiB \(56\.9 GiB memory-mapped.*24\.0 GiB of RAM"):
        check_memory(bf16, CPU, this_machine)
    check_memory(bf16, CPU, MemoryInfo(available=8 * GIB, total=64 * GIB))  # mapped: RAM, not free memory


def test_mapped_and_copied_weights_are_counted_apart(moe_dir):
    path = moe_dir[0]
    model = build_meta_model(ModelConfig.from_dir(path))
    stored = checkpoint_dtypes(weight_files(path))
    size = sum(p.numel() for p in model.parameters())
    # Attention's q, k and v are copied into one merged weight; everything else maps from the file.
    merged = sum(p.numel() for m in model.modules() if isinstance(m, MergedLinear) for p in m.parameters())
    assert merged > 0
    assert weight_footprint(model, torch.float32, CPU, stored) == loader.WeightFootprint(
        mapped=4 * (size - merged), copied=4 * merged)
    assert weight_footprint(model, torch.bfloat16, CPU, stored) == loader.WeightFootprint(mapped=0, copied=2 * size)
    cuda = torch.device("cuda")
    assert weight_footprint(model, torch.float32, cuda, stored) == loader.WeightFootprint(mapped=0, copied=4 * size)


def test_load_model_refuses_before_loading(moe_dir, monkeypatch):
    monkeypatch.setattr(loader, "available_memory", lambda device: MemoryInfo(available=1 << 20, total=1 << 20))
    monkeypatch.setattr(loader, "load_weights", lambda *a: pytest.fail("weights loaded"))
    with pytest.raises(InsufficientMemoryError, match=r"more than the 0\.0 GiB of RAM"):
        load_model(moe_dir[0], torch.float32, CPU)
    with pytest.raises(InsufficientMemoryError, match="of new memory on cpu"):
        load_model(moe_dir[0], torch.bfloat16, CPU)


def test_memory_is_read_from_meminfo_and_the_container_limit(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:         1048576 kB\nMemAvailable:   20971520 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text("max\n")
    monkeypatch.setattr(loader, "_MEMINFO", meminfo)
    monkeypatch.setattr(loader, "_CGROUP", cgroup)
    assert available_memory(CPU) == MemoryInfo(available=20 * GIB, total=24 * GIB)

    (cgroup / "memory.max").write_text(f"{8 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{7 * GIB}\n")
    (cgroup / "memory.stat").write_text(f"anon {3 * GIB}\nfile {4 * GIB}\n")  # page cache is reclaimable
    assert available_memory(CPU) == MemoryInfo(available=5 * GIB, total=8 * GIB)

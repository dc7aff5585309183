"""Tensor and expert parallel against the single-process engine: logits within 1e-4 and the same greedy tokens
through continuous batching with prefix hits and preemption, for dense Qwen3 and Qwen2 (KV heads split, and
replicated when the ranks outnumber them) and Qwen3-MoE (experts split by TP, or across ranks by either
exchange). Every engine here starts real worker processes and stops them."""

from __future__ import annotations

import gc
import os
import random

import pytest
import torch

from slotserve.config import EngineConfig, ModelConfig
from slotserve.engine.engine_core import check_split
from slotserve.engine.executor import WorkerError
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.model_runner import ModelRunner, ScheduledSeq, Want
from slotserve.sampling_params import SamplingParams
from tests.conftest import build_tiny_model
from tests.helpers import run_to_completion
from tests.test_qwen3_moe import build_tiny_moe

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
_rng = random.Random(1)
PROMPTS = [[_rng.randrange(1000, 50_000) for _ in range(n)] for n in (5, 17, 33, 8, 60, 12)]
PROBE = [[_rng.randrange(1000, 50_000) for _ in range(n)] for n in (23, 9)]  # the logits' prompts


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_qwen3) -> dict[str, str]:
    qwen2 = tmp_path_factory.mktemp("tp-qwen2")
    build_tiny_model(qwen2, "qwen2", tie=False)
    moe = tmp_path_factory.mktemp("tp-moe")
    build_tiny_moe(moe, norm_topk_prob=True, mlp_only_layers=[1])
    return {"qwen3": str(tiny_qwen3), "qwen2": str(qwen2), "moe": str(moe)}


def make_engine(path: str, blocks: int, **kwargs) -> LLMEngine:
    """An engine whose cache holds `blocks` blocks on every rank, however many KV heads each holds."""
    tp = kwargs.get("tensor_parallel_size", 1)
    per_token = ModelRunner.cache_bytes_per_token(ModelConfig.from_dir(path), torch.float32, tp)
    return LLMEngine(EngineConfig(model=path, block_size=BLOCK, kv_cache_memory=blocks * BLOCK * per_token,
                                  **{"distributed_timeout": 60, **kwargs}))


def run(engine: LLMEngine, prompts) -> dict[str, list[int]]:
    return run_to_completion(engine, prompts, GREEDY)


def probe_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """Every position's logits of two prompts prefilled in one step, then of a decode step of both (which
    reads their cached keys and values), straight through the core; the cache is empty otherwise."""
    blocks = [list(range(0, 8)), list(range(8, 16))]
    prefill = [ScheduledSeq(p, 0, b, want=Want.ALL) for p, b in zip(PROBE, blocks, strict=True)]
    decode = [ScheduledSeq([p[0]], len(p), b, want=Want.ALL) for p, b in zip(PROBE, blocks, strict=True)]
    return [r.logits for step in (prefill, decode) for r in engine.core.execute(step)]


@pytest.fixture(scope="module")
def reference(models) -> dict[str, tuple[list[torch.Tensor], dict[str, list[int]]]]:
    """Per model: the single-process logits, and each prompt's greedy tokens alone."""
    out = {}
    for name, path in models.items():
        engine = make_engine(path, blocks=256, enable_prefix_caching=False)
        solo = {f"r{i}": run(engine, [p])["r0"] for i, p in enumerate(PROMPTS)}
        out[name] = (probe_logits(engine), solo)
    return out


# The fast tier keeps one case of each kind (dense with and without q/k/v bias, experts across ranks); four ranks
# on two cores, which take turns at every collective, and the other exchanges are the slow tier's.
SLOW = pytest.mark.slow
CASES = [
    ("qwen3", dict(tensor_parallel_size=2)),
    pytest.param("qwen3", dict(tensor_parallel_size=4), marks=SLOW),  # 2 KV heads: each on two ranks
    ("qwen2", dict(tensor_parallel_size=2)),
    pytest.param("qwen2", dict(tensor_parallel_size=4), marks=SLOW),
    pytest.param("moe", dict(tensor_parallel_size=2), marks=SLOW),  # each expert split
    pytest.param("moe", dict(tensor_parallel_size=4), marks=SLOW),
    ("moe", dict(tensor_parallel_size=2, enable_expert_parallel=True)),
    pytest.param("moe", dict(tensor_parallel_size=4, enable_expert_parallel=True), marks=SLOW),
    pytest.param("moe", dict(tensor_parallel_size=2, enable_expert_parallel=True, expert_comm="all-gather"),
                 marks=SLOW),
    pytest.param("moe", dict(tensor_parallel_size=4, enable_expert_parallel=True, expert_comm="all-gather"),
                 marks=SLOW),
]


@pytest.mark.parametrize(("model", "split"), CASES, ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{k}={v}" for k, v in c.items()))
def test_split_model_equals_one_process(models, reference, model, split):
    logits, solo = reference[model]
    engine = make_engine(models[model], blocks=24, max_num_batched_tokens=16, **split)  # 96 tokens: preemption
    try:
        for got, want in zip(probe_logits(engine), logits, strict=True):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert run(engine, PROMPTS) == solo
        assert engine.stats().num_preemptions > 0
        assert run(engine, PROMPTS) == solo and engine.stats().prefix_cache_hit_rate > 0.2
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in engine.core.workers.processes.values())


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16), "6 attention heads"),
    (dict(num_key_value_heads=3, num_attention_heads=6, head_dim=16), "3 KV heads"),
    (dict(intermediate_size=102), "an MLP width of 102"),
])
def test_a_model_that_does_not_split_is_refused_before_any_worker_starts(overrides, field):
    cfg = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64,
                                 "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, **overrides})
    with pytest.raises(ValueError, match=f"tensor_parallel_size: 4 ranks cannot split .*{field}"):
        check_split(cfg, EngineConfig(tensor_parallel_size=4))


def test_expert_parallel_needs_several_ranks():
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        EngineConfig(enable_expert_parallel=True)
    with pytest.raises(ValueError, match="distributed_executor_backend: unknown value 'slurm'"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="slurm")


def test_a_killed_worker_fails_the_next_step_at_once(models):
    """Offline (no watchdog thread): the driver, waiting in a collective for a rank whose process is gone, learns
    so from the process's exit (the error names its exit code), not at the collective's timeout."""
    engine = make_engine(models["qwen3"], blocks=64, tensor_parallel_size=2)
    try:
        engine.add_request("r", PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        engine.step()
        (worker,) = engine.core.workers.processes.values()
        worker.kill()
        with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.shutdown()


def _allowed_cores(pid: int | str) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":")[1].strip() for line in f if line.startswith("Cpus_allowed_list"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to give each rank its own")
@pytest.mark.parametrize("given", [False, True], ids=["all-cores", "cpu-affinity"])
def test_each_rank_runs_on_its_own_cores_and_the_driver_gets_them_back(models, given):
    """The workers start before the driver is pinned to rank 0's share, so each takes its own share of the
    host's cores (or of the given `cpu_affinity`); at shutdown the driver may use all of them again."""
    host = _allowed_cores("self")
    cores = {"cpu_affinity": tuple(sorted(os.sched_getaffinity(0))[:2])} if given else {}
    engine = make_engine(models["qwen3"], blocks=16, tensor_parallel_size=2, **cores)
    try:
        (worker,) = engine.core.workers.processes.values()
        driver, rank1 = _allowed_cores("self"), _allowed_cores(worker.pid)
        assert driver != rank1 and driver != host and rank1 != host
    finally:
        engine.shutdown()
    assert _allowed_cores("self") == host


def test_a_dropped_llm_releases_its_ranks_for_the_next(models):
    """An `LLM` collected without `shutdown()` stops its worker processes and leaves its process group, so a
    second one in the same process starts (torch.distributed's default group can exist once) and agrees."""
    from slotserve import LLM

    per_token = ModelRunner.cache_bytes_per_token(ModelConfig.from_dir(models["qwen3"]), torch.float32, 2)
    args = {"tensor_parallel_size": 2, "block_size": BLOCK, "kv_cache_memory": 64 * BLOCK * per_token,
            "distributed_timeout": 60}
    llm = LLM(models["qwen3"], **args)
    first = run(llm.engine, PROMPTS[:2])
    processes = list(llm.engine.core.workers.processes.values())
    del llm
    gc.collect()
    assert all(p.poll() is not None for p in processes)
    assert not torch.distributed.is_initialized()
    again = LLM(models["qwen3"], **args)
    try:
        assert run(again.engine, PROMPTS[:2]) == first
    finally:
        again.shutdown()

"""Micro-batch overlap on real ranks: with --ubatches 2 and 3 the tiny dense model at TP=2 and the tiny MoE at
EP=2 give the single-process engine's logits and greedy tokens, steps split where they should (a piece of one
token of a straddling prompt included) and not below the thresholds; a micro-batch that raises or never
arrives, on the driver or on a worker, fails the step with one clear error within the timeout, leaves no
thread behind and the KV pool whole; with the gate on, a kind of step measured slower split is not split."""

from __future__ import annotations

import os
import re
import threading

import pytest
import torch

from slotserve.engine.executor import WorkerError
from slotserve.engine.model_runner import ScheduledSeq, Want
from slotserve.envs import FAULT_ENV
from slotserve.faults import FaultPoint, fault_spec
from slotserve.parallel import timeline
from slotserve.parallel.ubatch import OverlapGate, UbatchError
from tests.conftest import build_tiny_model
from tests.test_qwen3_moe import build_tiny_moe
from tests.test_tensor_parallel import GREEDY, PROMPTS, make_engine, run

SPLITS = {"dense": dict(tensor_parallel_size=2), "moe": dict(tensor_parallel_size=2, enable_expert_parallel=True)}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    dense = tmp_path_factory.mktemp("ub-qwen3")
    build_tiny_model(dense, "qwen3")
    moe = tmp_path_factory.mktemp("ub-moe")
    build_tiny_moe(moe, norm_topk_prob=True, mlp_only_layers=[1])
    return {"dense": str(dense), "moe": str(moe)}


def probe_steps(n: int) -> list[list[ScheduledSeq]]:
    """A prefill of four prompts whose first ends one token into micro-batch 1 (10 tokens per micro-batch); a
    decode step of all four (4 tokens: split); one of two (below the thresholds of 4: not split)."""
    lens = (11, 3, 3, 10 * n - 17)
    prompts = [[1000 + 37 * i + j for j in range(k)] for i, k in enumerate(lens)]
    blocks = [list(range(16 * i, 16 * i + 16)) for i in range(len(lens))]
    prefill = [ScheduledSeq(p, 0, b, want=Want.ALL) for p, b in zip(prompts, blocks, strict=True)]
    decode = [ScheduledSeq([p[0]], len(p), b, want=Want.ALL) for p, b in zip(prompts, blocks, strict=True)]
    again = [ScheduledSeq([p[1]], len(p) + 1, b, want=Want.ALL) for p, b in zip(prompts[:2], blocks[:2], strict=True)]
    return [prefill, decode, again]


def lanes_of_each_step(engine, steps) -> tuple[list[torch.Tensor], list[set[str]]]:
    """Every row's logits of each step, and the micro-batch lanes the driver ran it on."""
    logits, lanes = [], []
    for step in steps:
        recorded = timeline.Timeline()
        timeline.record(recorded)
        try:
            logits += [r.logits for r in engine.core.execute(step)]
        finally:
            timeline.record(None)
        lanes.append({s.lane for s in recorded.spans if s.lane.startswith("ubatch")})
    return logits, lanes


@pytest.fixture(scope="module")
def reference(models) -> dict[str, tuple[dict[int, list[torch.Tensor]], dict[str, list[int]]]]:
    out = {}
    for name, path in models.items():
        engine = make_engine(path, blocks=256, enable_prefix_caching=False)
        logits = {n: lanes_of_each_step(engine, probe_steps(n))[0] for n in (2, 3)}
        solo = {f"r{i}": run(engine, [p])["r0"] for i, p in enumerate(PROMPTS)}
        out[name] = (logits, solo)
    return out


@pytest.mark.parametrize(("model", "n"), [  # the fast tier keeps one of each model
    ("dense", 2), pytest.param("dense", 3, marks=pytest.mark.slow),
    pytest.param("moe", 2, marks=pytest.mark.slow), ("moe", 3),
])
def test_micro_batches_give_the_single_process_outputs(models, reference, model, n):
    want_logits, solo = reference[model]
    # Thresholds of 4 tokens: prefills and decode steps of 4+ running prompts split, decode steps of fewer do not.
    engine = make_engine(models[model], blocks=256, ubatches=n, ubatch_decode_threshold=4,
                         ubatch_prefill_threshold=4, ubatch_adaptive=False, **SPLITS[model])
    try:
        got, lanes = lanes_of_each_step(engine, probe_steps(n))
        everyone = {f"ubatch-{i}" for i in range(n)}
        assert lanes == [everyone, everyone, set()]
        for a, b in zip(want_logits[n], got, strict=True):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
        assert run(engine, PROMPTS) == solo  # continuous batching: prefills, decodes above and below 4 rows
    finally:
        engine.shutdown()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ubatch-")]


def _pool_whole_after(engine, failing) -> Exception:
    """Runs `failing` (steps of the engine that must fail); the error, once every request is aborted and the
    pool is whole again."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    with pytest.raises((UbatchError, WorkerError)) as info:
        failing()
    engine.abort_request([f"r{i}" for i in range(len(PROMPTS))])
    engine.kv.pool.check_whole()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    assert not engine.has_unfinished_requests()
    return info.value


def _steps_until_done(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize(("point", "message"), [
    (FaultPoint.UBATCH_RAISE, r"rank 0: micro-batch \d of 2 failed: InjectedFault: .*ubatch-raise"),
    (FaultPoint.UBATCH_STALL, r"rank 0: micro-batch \d of 2 failed: TimeoutError: micro-batches \[\d\] did not "
                              r"reach the start within 3 s"),
])
def test_a_failing_micro_batch_on_the_driver_fails_the_step_within_the_timeout(models, monkeypatch, point, message):
    engine = make_engine(models["dense"], blocks=64, ubatches=2, ubatch_decode_threshold=2,
                         ubatch_prefill_threshold=2, distributed_timeout=3, ubatch_adaptive=False,
                         **SPLITS["dense"])
    try:
        monkeypatch.setenv(FAULT_ENV, fault_spec(point, 3)[FAULT_ENV])  # the workers started without it
        error = _pool_whole_after(engine, lambda: _steps_until_done(engine))
        assert isinstance(error, UbatchError)
        assert re.search(message, str(error)), error
    finally:
        monkeypatch.delenv(FAULT_ENV)
        engine.shutdown()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ubatch-")]


def test_a_worker_micro_batch_that_raises_ends_the_step_with_the_ranks_reason(models, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, fault_spec(FaultPoint.UBATCH_RAISE, 5)[FAULT_ENV])
    engine = make_engine(models["moe"], blocks=64, ubatches=2, ubatch_decode_threshold=2,
                         ubatch_prefill_threshold=2, distributed_timeout=600, ubatch_adaptive=False,
                         **SPLITS["moe"])
    monkeypatch.delenv(FAULT_ENV)  # the worker keeps it; the driver does not
    try:
        # A timeout of 600 s: the driver learns from the worker's reply that the rank failed, not from a wait.
        error = _pool_whole_after(engine, lambda: _steps_until_done(engine))
        assert isinstance(error, WorkerError)
        assert "rank 1: UbatchError: rank 1: micro-batch" in str(error) and "InjectedFault" in str(error), error
    finally:
        engine.shutdown()
    assert os.environ.get(FAULT_ENV) is None


def test_the_gate_keeps_a_kind_of_step_whole_where_it_measured_slower_split(models):
    engine = make_engine(models["dense"], blocks=256, ubatches=2, ubatch_decode_threshold=4,
                         ubatch_prefill_threshold=4, **SPLITS["dense"])
    try:
        gate = engine.core.runner.gate
        for split in (True, False) * (OverlapGate.SAMPLES + 1):  # decode steps of 4: split twice as slow
            gate.record(True, 4, split, 2.0 if split else 1.0)
        prefill, decode, _ = probe_steps(2)
        _, lanes = lanes_of_each_step(engine, [prefill, decode])
        # The prefill's kind is untried: it splits (every rank's gate starts that way); the decode step does not,
        # since the driver votes against it.
        assert lanes == [{"ubatch-0", "ubatch-1"}, set()]
        assert gate.choices() == {"decode <= 4 tokens": False}
    finally:
        engine.shutdown()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ubatch-")]

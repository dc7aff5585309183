"""`slotserve serve -tp 2` against real servers: answers equal to the single-process engine through the official
openai client, and a worker that dies, hangs or raises ends the engine with the reason (every stream told,
/health 503, exit 1), never a wedge; SIGTERM stops every rank; no worker outlives its server."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from slotserve import LLM, SamplingParams
from slotserve.faults import FaultPoint, fault_spec
from tests.servers import MODEL, Server

LONG = {"max_tokens": 900, "temperature": 0, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 5, 8,"]


def _gone(pids: list[int]) -> bool:
    def dead(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return all(dead(pid) for pid in pids)


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _gone(pids):
        assert time.monotonic() < deadline, f"workers {pids} outlived their engine"
        time.sleep(0.1)


def _health_turns_503(srv: Server, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while srv.proc.poll() is None and time.monotonic() < deadline:
        if httpx.get(f"{srv.url}/health", timeout=5).status_code == 503:
            return
        time.sleep(0.05)
    pytest.fail("health never turned 503")


def test_tp2_server_answers_as_the_single_process_engine(tiny_qwen3):
    with LLM(model=str(tiny_qwen3), kv_cache_memory=16 << 20) as llm:
        want = [o.outputs[0].text for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
    srv = Server(tiny_qwen3, "-tp", "2")
    try:
        assert len(srv.worker_pids()) == 1
        client = srv.client()
        got = [client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        assert got == want
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=8, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    finally:
        workers = srv.worker_pids()
        assert srv.stop() == 0  # SIGTERM: every rank stops
        _wait_gone(workers, 10)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigkill", "raises", "hangs"])
def test_a_failed_worker_ends_the_engine_with_the_reason(tiny_qwen3, how):
    env = {"raises": fault_spec(FaultPoint.WORKER_STEP, 40), "hangs": fault_spec(FaultPoint.WORKER_HANG, 40)}
    srv = Server(tiny_qwen3, "-tp", "2", "--engine-death-exit-delay", "2", "--distributed-timeout", "3",
                 env=env.get(how))
    try:
        workers = srv.worker_pids()
        streams = [srv.sse("/v1/completions", {"prompt": f"p{i}", "stream": True, **LONG}) for i in range(3)]
        for events in streams:
            next(events)
        if how == "sigkill":
            os.kill(workers[0], signal.SIGKILL)
        for events in streams:  # every stream ends with the error: none is left open
            tail = list(events)
            assert tail[-1] == "[DONE]" and "error" in tail[-2], tail[-3:]
        message = tail[-2]["error"]["message"]
        reason = {"sigkill": "exited with code -9", "raises": "rank 1: InjectedFault", "hangs": "no worker said why"}
        assert reason[how] in message, message
        _health_turns_503(srv, 5)
        assert srv.wait_exit(timeout=30) == 1
        _wait_gone(workers, 10)
    finally:
        srv.stop()


@pytest.mark.slow
def test_sigkill_of_the_engine_leaves_no_worker(tiny_qwen3):
    srv = Server(tiny_qwen3, "-tp", "2", "--engine-death-exit-delay", "1")
    try:
        workers = srv.worker_pids()
        os.kill(srv.engine_pid(), signal.SIGKILL)
        _wait_gone(workers, 10)
        assert srv.wait_exit(timeout=30) == 1
    finally:
        srv.stop()


# Split every step that qualifies: the adaptive gate could choose by measured times not to, and then no
# micro-batch would run (or raise).
UBATCHES = ("-tp", "2", "--ubatches", "2", "--ubatch-decode-threshold", "2", "--ubatch-prefill-threshold", "2",
            "--no-ubatch-adaptive")


def test_a_server_with_micro_batches_answers_as_the_single_process_engine(tiny_qwen3):
    """Thresholds of 2 tokens: every prefill and every decode step of 2+ streams runs as two micro-batches."""
    with LLM(model=str(tiny_qwen3), kv_cache_memory=16 << 20) as llm:
        want = [o.outputs[0].text for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
    srv = Server(tiny_qwen3, *UBATCHES)
    try:
        got = srv.client().completions.create(model=MODEL, prompt=PROMPTS, max_tokens=24, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    finally:
        workers = srv.worker_pids()
        assert srv.stop() == 0
        _wait_gone(workers, 10)


@pytest.mark.slow
def test_a_micro_batch_that_raises_ends_the_engine_with_the_reason(tiny_qwen3):
    srv = Server(tiny_qwen3, *UBATCHES, "--engine-death-exit-delay", "2", "--distributed-timeout", "3",
                 env=fault_spec(FaultPoint.UBATCH_RAISE, 400))
    try:
        workers = srv.worker_pids()
        streams = [srv.sse("/v1/completions", {"prompt": f"p{i}", "stream": True, **LONG}) for i in range(3)]
        firsts = [next(events) for events in streams]  # all three running: decode steps of 3 tokens split
        for first, events in zip(firsts, streams, strict=True):
            tail = [first, *events]
            assert tail[-1] == "[DONE]" and "error" in tail[-2], tail[-3:]
        message = tail[-2]["error"]["message"]
        assert "micro-batch" in message and "InjectedFault" in message, message
        _health_turns_503(srv, 5)
        assert srv.wait_exit(timeout=30) == 1
        _wait_gone(workers, 10)
    finally:
        srv.stop()

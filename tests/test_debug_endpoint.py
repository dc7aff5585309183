"""GET /debug/engine and the stall watchdog against a real server: the engine's three named threads with their
stacks (waiting on the queue when idle, in the model while generating), the queues back at 0 after load, and a
core loop stalled on purpose reported within the watchdog's limit, naming the stalled thread."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest

from slotserve.faults import FaultPoint, fault_spec
from tests.servers import Server

ENGINE_THREADS = {"IPCLoop", "EngineCoreLoop", "OutputProcessor"}


def snapshot(server: Server) -> dict:
    response = httpx.get(f"{server.url}/debug/engine", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def core_stack(snap: dict) -> list[str]:
    return next(t["stack"] for t in snap["engine"]["threads"] if t["name"] == "EngineCoreLoop")


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    s = Server(tiny_qwen3)
    yield s
    s.stop()


def test_the_snapshot_shows_the_engine_threads_and_where_they_are(server):
    idle = snapshot(server)
    names = {t["name"] for t in idle["engine"]["threads"]}
    assert names >= ENGINE_THREADS
    assert all(t["stack"] for t in idle["engine"]["threads"] if t["name"] in ENGINE_THREADS)
    assert any("get" in frame for frame in core_stack(idle)[-3:]), core_stack(idle)  # parked on its queue
    assert idle["engine"]["queues"] == {"input": 0, "output_processor": 0}
    assert idle["front_end"]["threads"] and idle["engine"]["watchdog"]["stalled_since"] is None

    done = threading.Event()

    def generate() -> None:
        httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "prompt": "hello " * 200, "max_tokens": 400, "ignore_eos": True, "temperature": 0})
        done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    stacks, busy = [], []
    while not done.is_set() and len(stacks) < 200:
        snap = snapshot(server)
        stacks.append(core_stack(snap))
        busy.append(snap["engine"]["scheduler"]["running"])
    worker.join()
    assert any(any("forward" in f or "execute" in f for f in stack) for stack in stacks), stacks[:3]
    assert max(busy) == 1
    after = snapshot(server)["engine"]
    assert after["queues"] == {"input": 0, "output_processor": 0} and after["scheduler"]["running"] == 0
    step = after["steps"][-1]
    assert step["sequences"] == 1 and step["model_seconds"] > 0
    phases = step["schedule_seconds"] + step["model_seconds"] + step["sample_seconds"]
    assert abs(step["seconds"] - phases) < 1e-6  # the step's own time is its phases' sum


def test_the_watchdog_reports_a_stalled_core_loop(tiny_qwen3):
    """The core loop sleeps in one step (a fault hook) for longer than --stall-timeout: the watchdog logs every
    thread's stack once, naming EngineCoreLoop, and /debug/engine shows the stall; the request then finishes."""
    s = Server(tiny_qwen3, "--stall-timeout", "1", env=fault_spec(FaultPoint.CORE_STALL, 3))
    try:
        result = {}
        worker = threading.Thread(target=lambda: result.update(r=httpx.post(
            f"{s.url}/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True})))
        worker.start()
        while "without finishing a step" not in s.output():  # reported while the step is still stalled
            assert worker.is_alive(), s.output()
            time.sleep(0.1)
        report = s.output().split("EngineCoreLoop has had work for 1 s without finishing a step")[1]
        assert "thread IPCLoop" in report and "thread OutputProcessor" in report
        stalled = report.split("thread EngineCoreLoop")[1].split("thread ")[0]
        assert stalled.strip().splitlines()[-1].endswith("_core_loop")  # in the hook's sleep, inside the loop
        snap = snapshot(s)["engine"]
        assert snap["watchdog"]["stalled_since"] is not None and snap["watchdog"]["stalls"] == 1
        assert core_stack({"engine": snap})[-1].endswith("_core_loop")
        worker.join()
        assert result["r"].status_code == 200
    finally:
        s.stop()


@pytest.mark.slow
def test_the_endpoint_is_off_when_asked(tiny_qwen3):
    s = Server(tiny_qwen3, "--debug-endpoints", "off")
    try:
        assert httpx.get(f"{s.url}/debug/engine", timeout=10).status_code == 404
    finally:
        s.stop()


def test_metrics_show_queues_threads_and_step_histograms(server):
    httpx.post(f"{server.url}/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 4})
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    assert 'slotserve:engine_queue_depth{model_name="tiny",queue="input"} 0.0' in text
    assert 'slotserve:thread_cpu_share{model_name="tiny",process="engine",thread="EngineCoreLoop"}' in text
    assert 'slotserve:engine_stalled{model_name="tiny"} 0.0' in text
    for phase in ("step", "schedule", "model", "sample"):
        assert f'slotserve:engine_step_seconds_count{{model_name="tiny",phase="{phase}"}}' in text
    assert 'vllm:iteration_tokens_total_bucket{le="+Inf",model_name="tiny"}' in text


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux for a real terminal")
def test_slotserve_top_in_a_real_terminal(server):
    """`slotserve top` in a tmux pane against the running server: the screen shows the three engine threads with
    their hints, the queues and the scheduler lines, and refreshes."""
    session = f"slotserve-top-{os.getpid()}"
    command = f"{sys.executable} -m slotserve.entrypoints.cli top --url {server.url} --interval 0.5"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "140", "-y", "40", command], check=True)
    try:
        screen = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "scheduler:" not in screen:
            time.sleep(0.5)
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                    text=True).stdout
        for name in ENGINE_THREADS:
            assert name in screen, screen
        assert "queues: input 0, output processor 0" in screen and "waiting for requests: idle" in screen
        print(screen)  # the capture, for the record
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_top_once_prints_one_view(server):
    out = subprocess.run([sys.executable, "-m", "slotserve.entrypoints.cli", "top", "--url", server.url, "--once"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "EngineCoreLoop" in out.stdout and "scheduler:" in out.stdout

"""The engine's CPU settings: --threads / --cpu-affinity size torch and the pool; torch_parfor."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from slotserve import envs
from slotserve.config import EngineConfig
from slotserve.parallel import threadpool as tp
from slotserve.parallel.cpu import apply_cpu_settings, restrict_process, torch_parfor
from tests.helpers import assert_figures

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")


@pytest.fixture
def restore_cpu():
    cores, threads = (sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                      torch.get_num_threads())
    yield
    if cores is not None:
        restrict_process(cores)
    tp.configure_pool()
    torch.set_num_threads(threads)


def test_threads_size_torch_and_the_pool(restore_cpu):
    settings = apply_cpu_settings(threads=3)
    assert settings.threads == 3 and settings.cpu_affinity is None
    assert torch.get_num_threads() == 3 and tp.get_pool().threads == 3


def test_threads_default_from_the_environment(restore_cpu, monkeypatch):
    monkeypatch.setenv(envs.THREADS_ENV, "2")
    assert apply_cpu_settings().threads == 2 and tp.get_pool().threads == 2


@linux_only
def test_cpu_affinity_restricts_every_thread_and_pins_the_workers(restore_cpu):
    core = min(os.sched_getaffinity(0))
    seen: dict[str, set[int]] = {}
    settings = apply_cpu_settings(cpu_affinity=[core])
    assert settings.threads == 1 and settings.cpu_affinity == (core,)
    assert os.sched_getaffinity(0) == {core}
    # A thread started afterwards inherits it; so does every pool worker.
    t = threading.Thread(target=lambda: seen.setdefault("thread", os.sched_getaffinity(0)))
    t.start()
    t.join()
    assert seen["thread"] == {core}
    apply_cpu_settings(threads=2, cpu_affinity=[core])
    workers: list[set[int]] = []
    tp.get_pool().parfor(0, 2, lambda _c, _i: workers.append(os.sched_getaffinity(0)))
    assert workers == [{core}, {core}]


def test_engine_config_checks_the_cpu_settings():
    with pytest.raises(ValueError, match="threads"):
        EngineConfig(threads=0)
    with pytest.raises(ValueError, match="cpu_affinity"):
        EngineConfig(cpu_affinity=(10_000,))
    with pytest.raises(ValueError, match="cpu_affinity"):
        EngineConfig(cpu_affinity="0-x")
    with pytest.raises(ValueError, match="cpu_affinity"):
        EngineConfig(cpu_affinity=())
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    assert EngineConfig(cpu_affinity=f"{cores[0]}").cpu_affinity == (cores[0],)


def test_torch_parfor_runs_bodies_single_threaded_in_the_callers_mode(restore_cpu):
    apply_cpu_settings(threads=3)
    out = torch.zeros(12)
    seen: list[tuple[int, bool]] = []

    def body(_ctx, i: int) -> None:
        seen.append((torch.get_num_threads(), torch.is_inference_mode_enabled()))
        out[i] = i  # an in-place write to an inference tensor fails outside inference mode

    with torch.inference_mode():
        out = torch.zeros(12)
        torch_parfor(0, 12, body)
    assert out.tolist() == list(range(12))
    assert set(seen) == {(1, True)} and len(seen) == 12
    assert torch.get_num_threads() == 3  # the caller's count is back


def test_torch_parfor_reraises_and_restores(restore_cpu):
    apply_cpu_settings(threads=2)

    def body(_ctx, i: int) -> None:
        if i == 5:
            raise KeyError("item 5")

    with pytest.raises(KeyError, match="item 5"):
        torch_parfor(0, 8, body)
    assert torch.get_num_threads() == 2


def test_bench_threads_times_the_engine_on_each_setting(tiny_qwen2, restore_cpu):
    import argparse

    from slotserve import LLM
    from slotserve.bench.dev.threads import add_arguments, run_threads

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    core = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    args = parser.parse_args(["--threads", "1,2", "--cpu-affinity", str(core), "--regions", "10", "--matmul-size",
                              "8", "--items", "2", "--repeats", "1", "--engine-batch", "3", "--engine-context", "20"])
    result = run_threads(args, lambda: LLM(str(tiny_qwen2), kv_cache_memory=8 << 20).engine)
    steps = result["engine"]["steps"]
    pinned = hasattr(os, "sched_setaffinity")
    assert [(s["threads"], s["pinned"]) for s in steps] == [(1, False), *([(1, True)] if pinned else []), (2, False)]
    for s in steps:
        assert_figures(s, "batch1_ms", "batch3_ms")
    assert tp.get_pool().threads == tp.default_threads()  # the engine's defaults are back afterwards

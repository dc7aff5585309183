"""The `ray` executor backend against the single-process engine: logits within 1e-4 and the same greedy tokens,
with the worker ranks as Ray actors on a local Ray and on a simulated two-node cluster (both started and
stopped here); after `shutdown` the actors are gone, their placement group removed, the caller's Ray kept.
Also: ranks that cannot be placed, a Ray the executor starts (and stops) itself, and an actor that dies."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'slotserve[ray]')")
pytestmark = pytest.mark.slow  # each test starts a Ray (seconds of processes on 2 cores)

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group_table  # noqa: E402

from slotserve import LLM, SamplingParams  # noqa: E402
from slotserve.engine.executor import WorkerError  # noqa: E402
from slotserve.engine.model_runner import ScheduledSeq, Want  # noqa: E402
from slotserve.engine.ray_executor import RayExecutor  # noqa: E402
from slotserve.parallel import threadpool  # noqa: E402
from slotserve.parallel.cpu import restrict_process  # noqa: E402

KV = 1 << 24
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
PROMPTS = ["Hello there, how are", "The capital of France is", "1 2 3 4"]
PROBE = list(range(100, 140))  # the logits' prompt: three blocks of 16


def probe_logits(llm: LLM) -> torch.Tensor:
    """Every position's logits of one prefilled prompt, straight through the core."""
    return llm.engine.core.execute([ScheduledSeq(PROBE, 0, [0, 1, 2], want=Want.ALL)])[0].logits


def greedy(llm: LLM) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_qwen3: Path) -> tuple[torch.Tensor, list[list[int]]]:
    llm = LLM(model=str(tiny_qwen3), kv_cache_memory=KV)
    return probe_logits(llm), greedy(llm)


@pytest.fixture(autouse=True)
def restore_cpu():
    """A TP engine pins this process (its rank 0) to its share of the cores: the tests after get them all back."""
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    yield
    restrict_process(cores)
    threadpool.configure_pool()
    torch.set_num_threads(threads)


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2)
    yield
    ray.shutdown()


@pytest.fixture
def two_nodes():
    """A head with no CPUs and two nodes of 1 and 2 CPUs, all on this machine."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = [cluster.add_node(num_cpus=1), cluster.add_node(num_cpus=2)]
        ray.init(address=cluster.address)
        yield {node.node_id for node in nodes}
    finally:
        ray.shutdown()
        cluster.shutdown()


def rank_actor_pids() -> list[int]:
    """This test process's RankActor processes (their raylets are its children): those alive or just ending."""
    def descends_from_us(pid: int) -> bool:
        while pid > 1:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[1])
            if pid == os.getpid():
                return True
        return False

    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"ray::RankActor" in (proc / "cmdline").read_bytes() \
                    and descends_from_us(int(proc.name)):
                pids.append(int(proc.name))
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
    return pids


def wait_gone(timeout_s: float = 15) -> None:
    """Until no RankActor process is left (a killed actor's process ends soon after `ray.kill`) and, on a Ray
    still connected, every CPU is free again."""
    def busy() -> bool:
        return bool(rank_actor_pids()) or (ray.is_initialized()
                                          and ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"])
    deadline = time.monotonic() + timeout_s
    while busy() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank_actor_pids() == []
    if ray.is_initialized():
        assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]


def ray_llm(path: Path, tp: int, **kwargs) -> LLM:
    return LLM(model=str(path), tensor_parallel_size=tp, distributed_executor_backend="ray", kv_cache_memory=KV,
               **kwargs)


def check_parity_and_shutdown(llm: LLM, reference, workers: int, nodes: set[str] | None = None) -> None:
    """The TP engine's logits and tokens are the single-process ones (its bundles on `nodes` when given);
    after `shutdown` its actors exited on the driver's word and are gone, their placement group removed."""
    executor = llm.engine.core.workers
    try:
        assert isinstance(executor, RayExecutor)
        assert len(rank_actor_pids()) == workers
        if nodes is not None:
            assert set(placement_group_table(executor.pg)["bundles_to_node_id"].values()) == nodes
        logits, tokens = reference
        assert torch.allclose(probe_logits(llm), logits, atol=1e-4, rtol=0)
        assert greedy(llm) == tokens
        assert executor.exited() == []
    finally:
        llm.shutdown()
    assert executor.exited() == [f"worker rank {r} (ray actor) exited with code 0" for r in range(1, workers + 1)]
    if ray.is_initialized():  # the caller's
        assert placement_group_table(executor.pg)["state"] == "REMOVED"
    wait_gone()


def wait_for_failure(executor: RayExecutor, timeout_s: float = 15) -> str | None:
    deadline = time.monotonic() + timeout_s
    while (failure := executor.failure()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return failure


def test_local_ray(tiny_qwen3, reference, local_ray):
    check_parity_and_shutdown(ray_llm(tiny_qwen3, 2), reference, workers=1)
    assert ray.is_initialized()  # the caller's Ray stays

    # Three ranks of one CPU cannot be placed on two CPUs: said at once, nothing left behind.
    with pytest.raises(WorkerError, match=r"\(3 CPUs\) within 1 s: the cluster has 2 CPUs"):
        ray_llm(tiny_qwen3, 4, distributed_timeout=1)
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
    assert ray.is_initialized()


def test_two_node_cluster(tiny_qwen3, reference, two_nodes):
    check_parity_and_shutdown(ray_llm(tiny_qwen3, 4), reference, workers=3, nodes=two_nodes)  # both nodes
    assert ray.is_initialized()


def test_a_ray_of_its_own_and_a_killed_rank(tiny_qwen3, reference, monkeypatch):
    """With no Ray connected (and no RAY_ADDRESS) the executor starts a local one, and shuts it down with it. A
    rank whose actor dies is a failure with its reason, seen from another thread than the engine's."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    try:
        llm = ray_llm(tiny_qwen3, 2)
        executor = llm.engine.core.workers
        try:
            assert ray.is_initialized()
            assert torch.allclose(probe_logits(llm), reference[0], atol=1e-4, rtol=0)
            assert executor.failure() is None
            executor.kill()
            seen: list[str | None] = []
            watcher = threading.Thread(target=lambda: seen.append(wait_for_failure(executor)))
            watcher.start()
            watcher.join()
            assert re.match(r"worker rank 1 \(ray actor\) failed: \w*Actor\w*Error", seen[0] or ""), seen
        finally:
            llm.shutdown()
        assert not ray.is_initialized()
        wait_gone()
    finally:
        ray.shutdown()


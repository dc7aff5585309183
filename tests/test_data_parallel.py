"""Data-parallel replicas behind one front end: the router's choices, the cores each replica gets, greedy output
equal to the offline engine's, and a killed replica failing its own requests only (the others, and new
requests, served by the replicas left). Real engine-core processes on a tiny random model; the server test
kills a replica of a real `slotserve serve`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from slotserve import LLM, SamplingParams
from slotserve.config import EngineConfig, ExecutorBackend
from slotserve.engine.async_llm import AsyncLLM, EngineDeadError, replica_configs
from slotserve.engine.router import RouteChoice, Router
from tests.servers import MODEL, Server

PROMPTS = ["Hello there", "def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
BLOCK = 16


# ---- the router ---------------------------------------------------------------------------------


def test_equal_loads_take_turns_and_the_least_loaded_wins():
    router = Router(3, BLOCK)
    assert [router.choose([1, 2, 3], [0, 0, 0]).replica for _ in range(3)] == [0, 1, 2]
    assert router.choose([4], [5, 2, 7]).replica == 1


def test_a_cached_prefix_goes_back_to_its_replica():
    router = Router(2, BLOCK)
    system = list(range(100, 100 + 3 * BLOCK))
    first = router.choose([*system, 1, 2], [0, 0])
    assert first.cached_blocks == 0
    again = router.choose([*system, 7, 8, 9], [3, 1] if first.replica == 0 else [1, 3])
    assert (again.replica, again.cached_blocks) == (first.replica, 3)
    other = router.choose(list(range(500, 500 + 2 * BLOCK)), [0, 0])
    assert other.cached_blocks == 0


def test_affinity_yields_to_a_much_busier_replica():
    router = Router(2, BLOCK, max_imbalance=4)
    prompt = list(range(3 * BLOCK))
    assert router.choose(prompt, [0, 0]).replica == 0
    assert router.choose(prompt, [4, 0]).replica == 0
    assert router.choose(prompt, [5, 0]).replica == 1  # and the prefix is remembered there now
    assert router.choose(prompt, [0, 0]).replica == 1


def test_a_gone_replica_is_never_chosen_and_its_prefixes_are_forgotten():
    router = Router(2, BLOCK)
    prompt = list(range(2 * BLOCK))
    assert router.choose(prompt, [0, 0]).replica == 0
    assert router.choose(prompt, [None, 3]) == RouteChoice(1, 0)
    assert router.choose(prompt, [None, 3]) == RouteChoice(1, 2)
    router.forget(1)
    assert router.choose(prompt, [0, 0]).cached_blocks == 0
    with pytest.raises(ValueError, match="no replica"):
        router.choose(prompt, [None, None])


def test_the_remembered_prefixes_are_bounded():
    router = Router(2, BLOCK, capacity=8)
    for i in range(20):
        router.choose(list(range(i * 1000, i * 1000 + 4 * BLOCK)), [0, 0])
    assert len(router._owner) == 8


# ---- the replicas' settings ------------------------------------------------------------------------


def test_the_cores_split_between_the_replicas():
    cores = sorted(os.sched_getaffinity(0))
    configs = replica_configs(EngineConfig(data_parallel_size=len(cores), cpu_affinity=tuple(cores)))
    assert [c.cpu_affinity for c in configs] == [(c,) for c in cores]
    assert all(c.data_parallel_size == 1 for c in configs)
    shared = replica_configs(EngineConfig(data_parallel_size=2 * len(cores)))
    assert all(c.cpu_affinity is None and c.threads == 1 for c in shared)
    ray = replica_configs(EngineConfig(data_parallel_size=2, threads=3, distributed_executor_backend="ray"))
    assert all(c.threads == 3 and c.distributed_executor_backend is ExecutorBackend.RAY for c in ray)


def test_bad_sizes_and_an_offline_engine_of_replicas_are_refused(tiny_qwen3):
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(str(tiny_qwen3), data_parallel_size=2)


# ---- two replicas behind one front end -----------------------------------------------------------------


async def _collect(engine: AsyncLLM, request_id: str, prompt, params) -> list[int]:
    tokens = []
    async for out in engine.generate(request_id, prompt, params):
        tokens += out.outputs[0].token_ids
    return tokens


def test_two_replicas_answer_as_one_engine_and_survive_one_killed(tiny_qwen3):
    offline = LLM(str(tiny_qwen3), kv_cache_memory=8 << 20)
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, GREEDY)]
    long_expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, LONG)]

    async def main():
        engine = await AsyncLLM.create(EngineConfig(model=str(tiny_qwen3), kv_cache_memory=8 << 20,
                                                    data_parallel_size=2))
        try:
            got = await asyncio.gather(*[_collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
            assert list(got) == expected
            each = [await r.stats() for r in engine.replicas]
            assert all(s.prefix_cache_queried_tokens > 0 for s in each)  # both served some
            assert (await engine.stats()).prefix_cache_queried_tokens == sum(
                s.prefix_cache_queried_tokens for s in each)

            streams = [await engine.add_request(f"long{i}", p, LONG) for i, p in enumerate(PROMPTS)]
            victim, survivor = engine.replicas
            doomed = [s for s in streams if s.core is victim]
            assert len(doomed) == 2
            firsts = [(await s.__anext__()).outputs[0].token_ids for s in streams]  # all under way before the kill
            os.kill(victim.process.pid, signal.SIGKILL)

            async def finish(stream, tokens: list[int]) -> list[int] | Exception:
                try:
                    async for out in stream:
                        tokens += out.outputs[0].token_ids
                except EngineDeadError as e:
                    return e
                return tokens

            results = await asyncio.gather(*[finish(s, list(f)) for s, f in zip(streams, firsts, strict=True)])
            for i, (stream, result) in enumerate(zip(streams, results, strict=True)):
                if stream.core is victim:
                    assert isinstance(result, EngineDeadError) and "replica 0" in str(result)
                else:
                    assert result == long_expected[i]
            assert not engine.is_dead and engine.replicas_alive == 1
            after = await asyncio.gather(*[_collect(engine, f"a{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
            assert list(after) == expected
            stats = await engine.stats()
            assert stats.running == 0 and stats.kv_cache_usage == 0.0

            os.kill(survivor.process.pid, signal.SIGKILL)
            await asyncio.wait_for(engine.dead.wait(), 10)
            assert engine.is_dead and "every replica is gone" in engine.dead_reason
            with pytest.raises(EngineDeadError):
                await engine.add_request("late", PROMPTS[0], GREEDY)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def _engine_pids(server: Server) -> list[int]:
    return [child.pid for child in psutil.Process(server.proc.pid).children()
            if any("spawn_main" in part for part in child.cmdline())]


def test_server_with_two_replicas_fails_only_the_killed_ones_requests(tiny_qwen3):
    server = Server(tiny_qwen3, "--data-parallel-size", "2", "--engine-death-exit-delay", "0")
    try:
        pids = _engine_pids(server)
        assert len(pids) == 2
        debug = httpx.get(f"{server.url}/debug/engine", timeout=10).json()
        assert len(debug["replicas"]) == 2 and {r["pid"] for r in debug["replicas"]} == set(pids)
        assert "slotserve:engine_replicas_alive" in httpx.get(f"{server.url}/metrics").text

        outcomes: dict[int, list] = {}

        def stream(i: int) -> None:
            events = []
            try:
                for event in server.sse("/v1/completions", {"prompt": PROMPTS[i], "max_tokens": 400,
                                                            "temperature": 0, "ignore_eos": True, "stream": True}):
                    events.append(event)
            except Exception as e:
                events.append(e)
            outcomes[i] = events

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            snap = httpx.get(f"{server.url}/debug/engine", timeout=10).json()["replicas"]
            if all(r["scheduler"]["running"] == 2 for r in snap):
                break
            time.sleep(0.2)
        os.kill(pids[0], signal.SIGKILL)
        for t in threads:
            t.join(timeout=120)
        errors = [i for i, ev in outcomes.items() if any(isinstance(e, dict) and "error" in e for e in ev)]
        done = [i for i, ev in outcomes.items() if ev and ev[-1] == "[DONE]" and not any(
            isinstance(e, dict) and "error" in e for e in ev)]
        assert len(errors) == 2 and len(done) == 2, outcomes
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        answer = server.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0)
        assert answer.choices[0].text is not None
        assert 'slotserve:engine_replicas_alive{model_name="tiny"} 1.0' in httpx.get(f"{server.url}/metrics").text

        os.kill(pids[1], signal.SIGKILL)
        assert server.wait_exit(timeout=30) == 1
    finally:
        server.stop()


@pytest.mark.slow  # a simulated two-node Ray cluster: seconds of processes on 2 cores
def test_replicas_on_ray_spread_over_the_nodes_and_answer_as_one_engine(tiny_qwen3):
    ray = pytest.importorskip("ray", reason="the ray backend needs ray (pip install 'slotserve[ray]')")
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table

    offline = LLM(str(tiny_qwen3), kv_cache_memory=8 << 20)
    expected = [o.outputs[0].token_ids for o in offline.generate(PROMPTS, GREEDY)]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        nodes = {cluster.add_node(num_cpus=1).node_id, cluster.add_node(num_cpus=1).node_id}
        ray.init(address=cluster.address)

        async def main():
            engine = await AsyncLLM.create(EngineConfig(model=str(tiny_qwen3), kv_cache_memory=8 << 20,
                                                        data_parallel_size=2, distributed_executor_backend="ray"))
            try:
                table = placement_group_table(engine._placement.pg)
                assert set(table["bundles_to_node_id"].values()) == nodes
                got = await asyncio.gather(*[_collect(engine, f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
                assert list(got) == expected
                each = [await r.stats() for r in engine.replicas]
                assert all(s.prefix_cache_queried_tokens > 0 for s in each)
                ray.kill(engine.replicas[0].process.actor, no_restart=True)
                await asyncio.wait_for(engine.replicas[0].dead.wait(), 20)
                assert not engine.is_dead and "ray actor" in engine.replicas[0].dead_reason
                assert await _collect(engine, "after", PROMPTS[1], GREEDY) == expected[1]
            finally:
                await engine.shutdown()
            assert ray.is_initialized()  # the caller's Ray is left to the caller

        asyncio.run(main())
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.slow  # two servers, one after the other
def test_the_replicas_bench_runs_both_configurations_and_prints_their_ratio(tiny_qwen3):
    out = subprocess.run(
        [sys.executable, "-m", "slotserve.entrypoints.cli", "--log-level", "WARNING", "bench", "replicas", "-m",
         str(tiny_qwen3), "--rounds", "1", "--num-prompts", "4", "--max-concurrency", "4", "--input-len", "8",
         "--output-len", "4", "--kv-cache-memory", "16M"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert [(r["replicas"], r["completed"], r["failed"]) for r in result["rounds"]] == [(1, 4, 0), (2, 4, 0)]
    assert result["ratio"] == result["ratios"][0] > 0

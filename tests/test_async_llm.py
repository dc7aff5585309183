"""The front-end engine against a real engine-core process (spawned), on a tiny random model."""

from __future__ import annotations

import asyncio

import pytest

from slotserve import LLM, SamplingParams
from slotserve.config import EngineConfig
from slotserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineStartError
from slotserve.envs import FAULT_ENV
from slotserve.faults import FaultPoint

PROMPTS = ["Hello there", "def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _config(path) -> EngineConfig:
    return EngineConfig(model=str(path), kv_cache_memory=8 << 20)


async def _collect(engine: AsyncLLM, request_id: str, prompt, params) -> tuple[str, list[int]]:
    text, tokens = "", []
    async for out in engine.generate(request_id, prompt, params):
        text += out.outputs[0].text
        tokens += out.outputs[0].token_ids
    return text, tokens


def _offline(path) -> list[tuple[str, list[int]]]:
    """Each prompt's greedy (text, token ids) from the offline engine: what serving must reproduce."""
    offline = LLM(str(path), kv_cache_memory=8 << 20)
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in offline.generate(PROMPTS, GREEDY)]


async def _all_at_once(engine: AsyncLLM, tag: str) -> list[tuple[str, list[int]]]:
    return list(await asyncio.gather(*[_collect(engine, f"{tag}{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]))


def test_concurrent_requests_match_offline_and_aborts_free_blocks(tiny_qwen3):
    expected = _offline(tiny_qwen3)

    async def main():
        engine = await AsyncLLM.create(_config(tiny_qwen3))
        try:
            assert await _all_at_once(engine, "r") == expected

            long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
            stream = engine.generate("cancel-me", PROMPTS[0], long)
            await stream.__anext__()
            await stream.aclose()  # the consumer goes away mid-stream
            for _ in range(100):
                stats = await engine.stats()
                if stats.running == 0 and stats.waiting == 0:
                    break
                await asyncio.sleep(0.02)
            assert stats.running == 0 and stats.kv_cache_usage == 0.0

            with pytest.raises(ValueError, match="prompt"):
                await _collect(engine, "bad", "", GREEDY)
        finally:
            await engine.shutdown()
        assert not engine.replicas[0].process.is_alive()

    asyncio.run(main())


def test_a_flood_of_aborts_does_not_starve_new_requests(tiny_qwen3):
    async def main():
        engine = await AsyncLLM.create(_config(tiny_qwen3))
        try:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            streams = [await engine.add_request(f"flood-{i}", PROMPTS[i % 4], params) for i in range(300)]
            for stream in streams:
                await stream.aclose()
            _, tokens = await asyncio.wait_for(_collect(engine, "after", PROMPTS[1], GREEDY), timeout=30)
            assert len(tokens) == 12
            stats = await engine.stats()
            assert stats.running == 0 and stats.waiting == 0 and stats.kv_cache_usage == 0.0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_engine_death_fails_in_flight_requests(tiny_qwen3, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, f"{FaultPoint.CORE_STEP.value}:5")

    async def main():
        engine = await AsyncLLM.create(_config(tiny_qwen3))
        try:
            params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
            results = await asyncio.gather(*[_collect(engine, f"r{i}", p, params) for i, p in enumerate(PROMPTS)],
                                           return_exceptions=True)
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert engine.is_dead and "fails on purpose" in engine.dead_reason
            with pytest.raises(EngineDeadError):
                await _collect(engine, "late", PROMPTS[0], params)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_start_failure_is_reported(tmp_path):
    async def main():
        with pytest.raises((EngineStartError, FileNotFoundError, ValueError)):
            await AsyncLLM.create(EngineConfig(model=str(tmp_path / "missing")))

    asyncio.run(main())


def test_moe_model_serves_like_a_dense_one(tmp_path):
    """Qwen3-MoE through the engine-core process: concurrent streams equal the offline outputs."""
    from tests.test_qwen3_moe import build_tiny_moe

    build_tiny_moe(tmp_path)
    expected = _offline(tmp_path)

    async def main():
        engine = await AsyncLLM.create(_config(tmp_path))
        try:
            assert await _all_at_once(engine, "m") == expected
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_reader_that_falls_behind_gets_one_merged_delta(tiny_qwen3):
    """Nothing is read until the engine has finished: the deltas of every step arrive as one output, with the
    whole text, every token and logprob, and each sequence's finish once; repeated ids do not mix."""
    expected = _offline(tiny_qwen3)

    async def main():
        engine = await AsyncLLM.create(_config(tiny_qwen3))
        try:
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
            stream = await engine.add_request("same", PROMPTS[1], params)
            other = await engine.add_request("same", PROMPTS[2], params)  # a caller's id may repeat
            # Unread, each stream holds one merged delta; wait until its last one has arrived.
            for _ in range(500):
                if all(s._stream._pending is not None and s._stream._pending.finished for s in (stream, other)):
                    break
                await asyncio.sleep(0.02)
            outputs = [out async for out in stream]
            assert len(outputs) == 1 and outputs[0].finished and outputs[0].request_id == "same"
            completion = outputs[0].outputs[0]
            assert (completion.text, completion.token_ids) == expected[1]
            assert len(completion.logprobs) == 12 and completion.finish_reason == "length"
            assert outputs[0].prompt_token_ids == stream.prompt_token_ids and outputs[0].prompt == PROMPTS[1]
            assert [out.outputs[0].text async for out in other] == [expected[2][0]]
        finally:
            await engine.shutdown()

    asyncio.run(main())

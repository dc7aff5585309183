"""Continuous batching over the paged, prefix-cached KV cache: batch invariance, slot isolation,
prefix reuse, preemption and block accounting, on a tiny random Qwen3."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotserve import SamplingParams
from slotserve.config import EngineConfig
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.model_runner import ModelRunner, ScheduledSeq
from slotserve.engine.sequence import Sequence
from slotserve.layers.sampler import SamplingState
from tests.helpers import run_to_completion

BLOCK = 4
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 kv heads, head_dim 32, float32
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(1000, 50_000) for _ in range(n)] for n in (5, 17, 33, 8, 60, 12, 41, 3)]


def make_engine(path, blocks=512, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), block_size=BLOCK,
                                  kv_cache_memory=blocks * BLOCK * KV_BYTES_PER_TOKEN, **kwargs))


def run(engine: LLMEngine, prompts, params=GREEDY, arrivals=None) -> dict[str, list[int]]:
    return run_to_completion(engine, prompts, params, arrivals=arrivals)


@pytest.fixture(scope="module")
def solo(tiny_qwen3):
    """Each prompt's greedy tokens computed alone, without prefix caching: the reference."""
    engine = make_engine(tiny_qwen3, enable_prefix_caching=False)
    return {f"r{i}": run(engine, [p])["r0"] for i, p in enumerate(PROMPTS)}


def test_all_together(tiny_qwen3, solo):
    engine = make_engine(tiny_qwen3)
    assert run(engine, PROMPTS) == solo


def test_staggered_arrivals_and_small_chunks(tiny_qwen3, solo):
    engine = make_engine(tiny_qwen3, max_num_batched_tokens=16)
    assert run(engine, PROMPTS, arrivals=[0, 0, 3, 5, 5, 9, 20, 21]) == solo


def test_after_prefix_cache_hits(tiny_qwen3, solo):
    engine = make_engine(tiny_qwen3)
    run(engine, PROMPTS)
    assert run(engine, PROMPTS) == solo
    assert engine.stats().prefix_cache_hit_rate > 0.4


def test_forced_preemption(tiny_qwen3, solo):
    engine = make_engine(tiny_qwen3, blocks=24)  # 96 tokens: the requests cannot all stay resident
    assert run(engine, PROMPTS) == solo
    assert engine.stats().num_preemptions > 0


def test_seeded_sampling_survives_preemption(tiny_qwen3):
    # top_k: recomputing a decoded token as part of a prompt rounds differently (1e-6), which over the
    # random model's near-uniform 151k-token distribution could move the sampled token to a neighbour.
    params = SamplingParams(temperature=1.0, top_k=50, seed=5, max_tokens=12, ignore_eos=True)
    roomy = run(make_engine(tiny_qwen3), PROMPTS, params)
    tight = make_engine(tiny_qwen3, blocks=24)
    assert run(tight, PROMPTS, params) == roomy and tight.stats().num_preemptions > 0


def test_slot_isolation_interleaved_decode(tiny_qwen3):
    """Seed 004's test: two sequences advanced in an arbitrary interleaving each produce exactly the
    logits they produce alone."""
    engine = make_engine(tiny_qwen3)
    runner: ModelRunner = engine.runner
    a, b = PROMPTS[2], PROMPTS[4]

    def solo_logits(prompt, blocks, steps):
        out = [runner.execute([ScheduledSeq(prompt, 0, blocks)])[0].logits[0]]
        tokens = list(prompt)
        for _ in range(steps):
            tokens.append(int(out[-1].argmax()))
            out.append(runner.execute([ScheduledSeq(tokens[-1:], len(tokens) - 1, blocks)])[0].logits[0])
        return out

    ref_a, ref_b = solo_logits(a, list(range(0, 30)), 6), solo_logits(b, list(range(30, 60)), 6)
    slots = {"a": (list(a), list(range(100, 130)), ref_a, []), "b": (list(b), list(range(200, 230)), ref_b, [])}
    for name in ["b", "a", "a", "b", "b", "b", "a", "b", "a", "a", "a", "b", "a", "b"]:
        tokens, blocks, ref, got = slots[name]
        if len(got) == len(ref):
            continue
        start = 0 if not got else len(tokens) - 1
        logits = runner.execute([ScheduledSeq(tokens[start:], start, blocks)])[0].logits[0]
        assert (logits - ref[len(got)]).abs().max().item() <= 1e-4, name
        got.append(logits)
        tokens.append(int(logits.argmax()))
    assert all(len(s[3]) == len(s[2]) for s in slots.values())


def test_prefix_cache_computes_only_new_tokens(tiny_qwen3):
    shared = PROMPTS[4][: 3 * BLOCK]
    first, second = [*shared, 11, 12, 13], [*shared, 21, 22, 23, 24, 25]
    engine = make_engine(tiny_qwen3)
    run(engine, [first])
    engine.add_request("second", second, GREEDY)
    plan = engine.scheduler.schedule()
    (req, num_new), = plan.scheduled
    assert req.num_cached_tokens == 3 * BLOCK and num_new == len(second) - 3 * BLOCK
    engine.abort_request("second")
    with_cache = run(engine, [second])["r0"]
    without = run(make_engine(tiny_qwen3, enable_prefix_caching=False), [second])["r0"]
    assert with_cache == without


def test_abort_in_every_state_returns_every_block(tiny_qwen3):
    engine = make_engine(tiny_qwen3, blocks=20, max_num_batched_tokens=8, max_num_seqs=3)
    long_params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, long_params)
    engine.step()  # r0 prefilled, r1 mid-prefill (8-token budget), the rest waiting
    states = {r.request_id: r.status.value for r in engine.scheduler.running + list(engine.scheduler.waiting)}
    assert "waiting" in states.values() and "running" in states.values()
    engine.abort_request(["r1", "r5"])  # mid-prefill and waiting
    for _ in range(30):
        engine.step()
    assert engine.stats().num_preemptions > 0
    engine.abort_request([f"r{i}" for i in range(len(PROMPTS))])  # decoding, preempted and waiting ones
    assert not engine.has_unfinished_requests()
    engine.kv.pool.check_whole()


def test_rejects_requests_that_can_never_fit(tiny_qwen3):
    engine = make_engine(tiny_qwen3, blocks=8)  # 32 tokens in the whole pool
    assert engine.max_model_len == 32
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("big", list(range(1000, 1040)), GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("long", list(range(1000, 1010)), SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    assert not engine.has_unfinished_requests()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    blocks=st.integers(min_value=20, max_value=80),
    budget=st.sampled_from([4, 7, 16, 64]),
    caching=st.booleans(),
)
def test_random_workloads_keep_blocks_whole_and_outputs_invariant(tiny_qwen3, solo, data, blocks, budget, caching):
    engine = make_engine(tiny_qwen3, blocks=blocks, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    count = data.draw(st.integers(1, len(PROMPTS)))
    chosen = data.draw(st.permutations(range(len(PROMPTS))))[:count]
    arrivals = data.draw(st.lists(st.integers(0, 12), min_size=count, max_size=count))
    aborts = data.draw(st.dictionaries(st.sampled_from(chosen), st.integers(0, 15), max_size=2))
    done: dict[int, list[int]] = {}
    step = 0
    while step < 400 and (len(done) + len(aborts) < count or engine.has_unfinished_requests()):
        for i, when in zip(chosen, arrivals, strict=True):
            if when == step:
                engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
        for i, when in aborts.items():
            if when == step and i not in done:
                engine.abort_request(f"r{i}")
        for out in engine.step():
            if out.finished:
                done[int(out.request_id[1:])] = out.outputs[0].token_ids
        step += 1
    assert not engine.has_unfinished_requests()
    engine.kv.pool.check_whole()
    for i, tokens in done.items():
        assert tokens == solo[f"r{i}"], i


def test_running_requests_keep_streaming_while_a_long_prompt_prefills(tiny_qwen3):
    engine = make_engine(tiny_qwen3, max_num_batched_tokens=8)
    engine.add_request("short", PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()  # "short" prefilled (5 tokens) and decoding from here on
    engine.add_request("long", PROMPTS[4], GREEDY)  # 60 tokens: 9 chunks of at most 7 beside the decode
    long_req = engine.scheduler.waiting[0]
    computed = []
    for _ in range(8):
        produced = {out.request_id for out in engine.step()}
        assert "short" in produced  # a token every step, prefill or not
        computed.append(long_req.num_computed_tokens)
    assert computed == [7 * (i + 1) for i in range(8)]
    engine.abort_request(["short", "long"])
    engine.kv.pool.check_whole()


def test_a_requests_token_slices_read_across_its_prompt_and_output():
    """What a scheduled chunk reads (its prompt, the output a preempted request recomputes, or both): every
    slice as of the whole list."""
    prompt = [11, 12, 13, 14, 15]
    params = SamplingParams(max_tokens=8)
    req = Sequence("r", prompt, params, SamplingState.new(params, prompt, [], 32), 8,
                  output_token_ids=[21, 22, 23])
    whole = prompt + req.output_token_ids
    assert all(req.token_ids(a, b) == whole[a:b] for a in range(len(whole) + 1) for b in range(a, len(whole) + 1))

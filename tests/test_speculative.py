"""Speculative decoding: n-gram and draft-model proposals verified inside continuous batching. Greedy output is the
non-speculative output token for token, alone and batched, through preemption and prefix caching; random sampling
keeps the target distribution (rejection sampling)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from slotserve import SamplingParams
from slotserve.config import EngineConfig, SpeculativeConfig, SpeculativeMethod
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.sequence import Sequence
from slotserve.engine.speculative import DraftSlots, cut_head, ngram_lookup
from slotserve.layers.sampler import Sampled, Sampler, SamplingState
from slotserve.layers.verification import sample_and_verify
from slotserve.models.gguf import convert_gguf
from slotserve.models.loader import load_model
from tests.conftest import build_tiny_model
from tests.gguf_fixtures import tiny_gguf
from tests.helpers import run_to_completion

BLOCK = 4
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # K and V, 2 layers, 2 kv heads, head_dim 32, float32
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
_rng = random.Random(1)


def _prompt(n: int) -> list[int]:
    """Random tokens, half of the prompts with a repeated stretch: something for prompt lookup to find."""
    tokens = [_rng.randrange(1000, 50_000) for _ in range(n)]
    return tokens + tokens[: n // 2] if n % 2 else tokens


PROMPTS = [_prompt(n) for n in (5, 17, 33, 8, 60, 12, 41, 3, 9, 26, 14, 7, 21, 50, 11, 30)]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def make_engine(path, blocks=1024, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), block_size=BLOCK,
                                  kv_cache_memory=blocks * BLOCK * KV_BYTES_PER_TOKEN, **kwargs))


def run(engine: LLMEngine, prompts, params=GREEDY, arrivals=None) -> dict[str, list[int]]:
    return run_to_completion(engine, prompts, params, arrivals=arrivals)


@pytest.fixture(scope="module")
def solo(tiny_qwen3):
    """Each prompt's greedy tokens, alone and without speculation: the reference."""
    engine = make_engine(tiny_qwen3, enable_prefix_caching=False)
    return {f"r{i}": run(engine, [p])["r0"] for i, p in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A draft of the target's shape and tokenizer, with other random weights: it is mostly wrong."""
    path = tmp_path_factory.mktemp("tiny-qwen3-draft")
    build_tiny_model(path, "qwen3", tie=True, seed=7)
    return path


def _draft(path, k=3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


@pytest.mark.parametrize("spec", ["ngram", "self_draft", "other_draft", "cut_vocabulary"])
def test_greedy_output_is_the_plain_output_alone_and_batched(tiny_qwen3, other_draft, solo, spec):
    config = {"ngram": NGRAM, "self_draft": _draft(tiny_qwen3), "other_draft": _draft(other_draft),
              "cut_vocabulary": {**_draft(tiny_qwen3), "draft_vocab_size": 25_000}}[spec]
    engine = make_engine(tiny_qwen3, speculative_config=config)
    alone = {f"r{i}": run(engine, [p])["r0"] for i, p in enumerate(PROMPTS)}
    assert alone == solo
    assert run(engine, PROMPTS, arrivals=[i // 3 for i in range(len(PROMPTS))]) == solo
    stats = engine.core.speculation
    assert stats.proposed > 0 and stats.verified > 0
    if spec == "self_draft":  # the target drafting for itself: every proposal kept
        assert stats.accepted == stats.proposed
    elif spec == "ngram":  # random models repeat themselves now and then
        assert 0 < stats.accepted < stats.proposed
    else:  # another random model, or the target proposing only ids below 25000, is wrong often: rejections
        assert stats.accepted < stats.proposed


@pytest.mark.parametrize("packed", [False, True])
def test_a_cut_draft_head_gives_the_first_rows_of_the_logits(tmp_path, packed):
    """A draft's head cut to its first token ids (down to whole pairs of rows where packed) is a view of the whole
    one's weight or packing: the same logits for those ids."""
    if packed:
        tg, _ = tiny_gguf("qwen3", tie=True)
        convert_gguf(tg.write(tmp_path / "m.gguf"), tmp_path / "model")
        path = tmp_path / "model"
    else:
        build_tiny_model(tmp_path, "qwen3", tie=True)
        path = tmp_path
    model, cfg = load_model(path, torch.float32, torch.device("cpu"))
    whole = model.lm_head
    assert (whole.weight is None) == packed
    hidden = torch.randn(3, cfg.hidden_size)
    expected = whole(hidden)
    cut_head(model, 100 if packed else 1007)  # the tiny GGUF's vocabulary: 288 tokens
    head, rows = model.lm_head, 96 if packed else 1007
    assert head.out_features == rows and model.model.embed_tokens is not None
    torch.testing.assert_close(head(hidden), expected[:, :rows], rtol=1e-5, atol=1e-5)
    if packed:
        assert head.packed.values.data_ptr() == whole.packed.values.data_ptr()
    else:
        assert head.weight.data_ptr() == whole.weight.data_ptr()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        cut_head(model, 31 if packed else 0)


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_preemption_and_prefix_caching_keep_the_output(tiny_qwen3, solo, spec):
    config = NGRAM if spec == "ngram" else _draft(tiny_qwen3)
    # 32 blocks of 4 tokens (a draft model's cache takes half the memory): sequences are preempted and recomputed.
    engine = make_engine(tiny_qwen3, blocks=32 if spec == "ngram" else 64, speculative_config=config,
                         max_num_batched_tokens=32)
    assert run(engine, PROMPTS) == solo
    assert engine.core.scheduler.num_preemptions > 0
    again = run(engine, PROMPTS[:4] * 2)  # the prompts again, twice: prefix hits
    assert again == {f"r{i}": solo[f"r{i % 4}"] for i in range(8)}
    assert engine.core.kv.stats.hit_tokens > 0


def test_the_length_limits_hold_with_proposals(tiny_qwen3):
    engine = make_engine(tiny_qwen3, speculative_config=_draft(tiny_qwen3, k=5), max_model_len=40)
    plain = make_engine(tiny_qwen3, max_model_len=40)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]  # 7, 25 and 8 tokens
    for n in (1, 2, 3, 7):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        out = run(engine, prompts, params)
        assert out == run(plain, prompts, params) and all(len(t) == n for t in out.values())
    long = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # to the end of the context
    out = run(engine, [PROMPTS[1]], long)
    assert out == run(plain, [PROMPTS[1]], long) and len(out["r0"]) == 40 - 25


def test_stop_tokens_and_penalties_end_as_without_proposals(tiny_qwen3, solo):
    engine = make_engine(tiny_qwen3, speculative_config=_draft(tiny_qwen3))
    plain = make_engine(tiny_qwen3)
    stop_at = solo["r4"][5]
    for params in (SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at]),
                   SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3,
                                  logprobs=2)):
        assert run(engine, PROMPTS, params) == run(plain, PROMPTS, params)


def test_seeded_sampling_gives_the_tokens_it_gives_without_proposals(tiny_qwen3, other_draft):
    """Each token takes one draw of the request's generator whatever was proposed: a seeded request's tokens do
    not depend on the proposals, their number, or the K each engine chooses."""
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=3, ignore_eos=True)
    plain = run(make_engine(tiny_qwen3), PROMPTS[:6], params)
    for config in (_draft(tiny_qwen3, k=2), _draft(other_draft, k=5), NGRAM):
        assert run(make_engine(tiny_qwen3, speculative_config=config), PROMPTS[:6], params) == plain


def _target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a row is sampled from, computed directly: temperature, min_p, top_k, then top_p."""
    probs = (logits / params.temperature).softmax(dim=-1)
    probs[probs < params.min_p * probs.max()] = 0.0
    ranked, order = (probs / probs.sum()).sort(descending=True)
    if params.top_k:
        ranked[params.top_k:] = 0.0
        ranked /= ranked.sum()
    ranked[(ranked.cumsum(dim=-1) - ranked) >= params.top_p] = 0.0
    return torch.zeros_like(probs).scatter_(0, order, ranked / ranked.sum())


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability zero was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02)])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """Two rows, one proposal: the first token must follow row 0's distribution, and where the proposal is kept,
    the second row 1's, whatever was proposed (a likely token and an unlikely one)."""
    vocab, trials = 8, 6000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, 1.5, -1.0, 0.2], [0.3, -0.2, 1.1, 0.9, 0.0, -1.0, 0.6, 0.1]])
    sampler = Sampler()
    targets = [_target(logits[r], params) for r in range(2)]
    for proposed in (0, 6):
        first, second = torch.zeros(vocab), torch.zeros(vocab)
        for t in range(trials):
            state = SamplingState.new(dataclasses.replace(params, seed=t), [1], [], vocab)
            taken: list[Sampled] = []

            def append(_i: int, sampled: Sampled, taken=taken) -> bool:
                taken.append(sampled)
                return True

            sample_and_verify(sampler, [logits], [None], [[proposed]], [state], append)
            first[taken[0].token] += 1
            if taken[0].token == proposed:
                assert len(taken) == 2
                second[taken[1].token] += 1
            else:
                assert len(taken) == 1
        # Chi-square of 7 degrees of freedom: 24.3 is its 0.1 % tail. Seeded: the same every run.
        assert _chi_square(first, targets[0]) < 24.3
        assert _chi_square(second, targets[1]) < 24.3


def test_ngram_lookup_takes_the_longest_then_the_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert ngram_lookup(tokens, 3, 1, 3) == [4, 5, 7]  # "2 3" last seen before "4 5 7"
    assert ngram_lookup(tokens, 1, 1, 1) == [4]
    assert ngram_lookup([5, 6, 7], 2, 1, 3) == []
    assert ngram_lookup([1, 2, 3, 4], 2, 2, 2) == []  # only the suffix itself
    # A match in the bytes across two tokens is no match: 256 = 00 01 00 00, 1 = 01 00 00 00.
    assert ngram_lookup([256, 0, 7, 1, 0], 1, 2, 2) == []
    assert ngram_lookup([1, 2, 8, 1, 2], 4, 2, 5) == [8, 1, 2]


def test_draft_slots_stay_within_the_rows_and_the_batch_size():
    slots = DraftSlots(4, None)
    assert [slots.most(n, n) for n in (1, 8, 16, 31, 32, 40)] == [4, 4, 3, 1, 1, 0]
    assert DraftSlots(4, 8).most(2, 8) == 0 and DraftSlots(4, 8).most(2, 7) == 4


def test_draft_slots_take_the_k_of_the_most_tokens_a_second():
    slots = DraftSlots(3, None)
    seqs = [Sequence("a", [1], GREEDY, None, 8), Sequence("b", [1], GREEDY, None, 8)]
    for seq in seqs:
        seq.draft_kept, seq.draft_tried = 1.0, 1.0
    seconds = (1.0, 1.3, 1.5, 2.5)  # rows that cost by the row, as exact products on a CPU's vector units
    tried = []
    for _ in range(8):
        tried.append(slots.choose(seqs, 2))
        slots.record(2, tried[-1], seconds[tried[-1]])
    assert tried == [0, 0, 1, 1, 2, 2, 3, 3]  # each K timed twice first, while the one below leads
    for acceptance, best in ((0.9, 2), (0.2, 0), (1.0, 2)):
        for seq in seqs:
            seq.draft_kept, seq.draft_tried = acceptance, 1.0
        assert slots.choose(seqs, 2) == best
    # Every PROBE_EVERY decisions another K is tried again, and every PLAIN_EVERY the plain step, so that its
    # time stays current. The three decisions above were the first.
    probe, plain = DraftSlots.PROBE_EVERY, DraftSlots.PLAIN_EVERY
    picks = [slots.choose(seqs, 2) for _ in range(2 * probe)]
    assert picks == [made // probe % 4 if made % probe == 0 else 0 if made % plain == 0 else 2
                     for made in range(4, 4 + 2 * probe)]


def test_a_plain_step_timed_in_a_slow_moment_is_timed_again():
    slots = DraftSlots(1, None)
    seqs = [Sequence("a", [1], GREEDY, None, 8)]
    seqs[0].draft_kept, seqs[0].draft_tried = 0.9, 1.0
    for k, seconds in ((0, 0.041), (0, 0.041), (1, 0.068), (1, 0.068)):  # the plain step slow, K = 1 leads
        slots.record(1, k, seconds)
    picks = []
    for _ in range(3 * DraftSlots.PLAIN_EVERY):
        picks.append(slots.choose(seqs, 1))
        slots.record(1, picks[-1], 0.030 if picks[-1] == 0 else 0.068)  # the plain step's time now
    assert picks[0] == 1 and picks[DraftSlots.PLAIN_EVERY - 1] == 0 and picks[-1] == 0


def test_draft_slots_try_a_k_only_while_the_one_below_could_lead_and_once_for_every_batch():
    slots = DraftSlots(3, None)
    seqs = [Sequence(str(i), [1], GREEDY, None, 8) for i in range(3)]
    seconds = {1: (1.0, 2.2, 3.3, 4.4), 3: (1.2, 2.6, 3.9, 5.2)}  # K = 1 loses with every proposal kept: no K = 2
    tried = []
    for n in (1, 3):
        for _ in range(6):
            tried.append((n, slots.choose(seqs[:n], n)))
            slots.record(n, tried[-1][1], seconds[n][tried[-1][1]])
    # three sequences time their plain steps, then take K = 1's time from one sequence's: what it added, thrice
    assert tried == [(1, 0), (1, 0), (1, 1), (1, 1), (1, 0), (1, 0), (3, 0), (3, 0), (3, 0), (3, 0), (3, 0),
                     (3, 0)]
    assert slots.estimate(3, 1) == pytest.approx(1.2 + (2.2 - 1.0) * 3) and slots.estimate(3, 2) is None


def test_speculative_config_errors_name_the_field():
    assert EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').speculative_config \
        == SpeculativeConfig(SpeculativeMethod.NGRAM, 3)
    for bad, field in (({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6}, "prompt_lookup_min"),
                       ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown field 'k'"),
                       ({"model": "m", "num_speculative_tokens": 2, "draft_vocab_size": 0}, "draft_vocab_size"),
                       ("{not json", "not JSON")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(speculative_config=bad)


def test_a_draft_of_another_vocabulary_is_refused(tiny_qwen3, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tests.conftest import TINY

    Qwen3ForCausalLM(Qwen3Config(**{**TINY, "vocab_size": 1000}, head_dim=32)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"speculative_config.model: .* vocabulary"):
        make_engine(tiny_qwen3, speculative_config=_draft(tmp_path))


def test_a_server_reports_its_proposals(tiny_qwen3):
    import httpx

    from tests.servers import MODEL, Server

    srv = Server(tiny_qwen3, "--speculative-config", json.dumps(NGRAM))
    try:
        prompt = " ".join(["one two three four"] * 8)
        out = srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0)
        assert out.usage.completion_tokens == 32 or out.choices[0].finish_reason == "stop"
        debug = httpx.get(f"{srv.url}/debug/engine").json()
        spec = next(v for k, v in _walk(debug) if k == "speculative")
        assert spec["method"] == "ngram" and spec["proposed"] > 0 and 0 <= spec["acceptance_rate"] <= 1
        metrics = httpx.get(f"{srv.url}/metrics").text
        for name in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_acceptance_rate",
                     "spec_decode_mean_accepted_length"):
            assert f"slotserve:{name}" in metrics
        assert f'slotserve:spec_decode_num_draft_tokens{{model_name="{MODEL}"}} {float(spec["proposed"])}' in metrics
    finally:
        assert srv.stop() == 0


def _walk(value, key=None):
    """Every (key, value) of a JSON document, nested ones too."""
    yield key, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _walk(v)

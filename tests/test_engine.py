"""The engine end to end on tiny random models: parity with `transformers.generate`, batching,
stopping, n > 1, seeds, aborts and rejected input."""

from __future__ import annotations

import pytest
import torch

from slotserve import LLM, SamplingParams
from slotserve.config import EngineConfig
from slotserve.kernels import decode_attention, norm_rotary_swiglu_argmax, small_gemm
from slotserve.layers.sampler import stack_rows
from tests.conftest import build_tiny_model

PROMPTS = ["Hello there", "def fibonacci(n):", "The capital of France is", "1, 2, 3, 4,", "你好，世界"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SMALL_CACHE = dict(kv_cache_memory=8 << 20)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-qwen3")
    hf = build_tiny_model(path, "qwen3", tie=True, seed=1)
    return path, hf


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny[0]), **SMALL_CACHE)


def _free_blocks(llm: LLM) -> int:
    return llm.engine.kv.pool.num_free


def test_greedy_matches_transformers_generate(tiny, llm):
    _, hf = tiny
    for prompt in PROMPTS:
        ids = llm.get_tokenizer().encode(prompt)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        ours = llm.generate(prompt, GREEDY)[0].outputs[0]
        assert ours.token_ids == ref[0, len(ids):].tolist(), prompt


def test_cpu_float32_decodes_through_the_native_kernels(llm):
    """The parity test above then covers them end to end: where they build, they are the default."""
    if not (small_gemm.available() and decode_attention.available() and norm_rotary_swiglu_argmax.available()):
        pytest.skip("no C compiler with OpenMP here")
    runner = llm.engine.runner
    assert runner.decode_mode == "paged" and runner.native_gemm and runner.native_row_ops


def test_batch_equals_one_at_a_time(llm):
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert together == alone
    assert llm.engine.stats().running == 0 and _free_blocks(llm) == llm.engine.kv.pool.num_blocks


def test_token_id_prompt_equals_text_prompt(llm):
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    out_ids = llm.generate([ids], GREEDY)[0]
    out_text = llm.generate(PROMPTS[1], GREEDY)[0]
    assert out_ids.outputs[0].token_ids == out_text.outputs[0].token_ids
    assert out_ids.prompt is None and out_ids.prompt_token_ids == ids


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    # top_k: over the random model's near-uniform 151k-token distribution, float noise at 1e-6 (a GEMM's
    # rounding depends on its row count) would move the sampled token to a neighbour.
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True)
    batch = llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3]], [noisy, params, noisy])
    assert batch[1].outputs[0].token_ids == alone


def test_n_samples_are_distinct_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    first = llm.generate(PROMPTS[0], params)[0]
    second = llm.generate(PROMPTS[0], params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_max_tokens_and_stop_token(llm):
    out = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    stop_id = out.token_ids[5]
    first = out.token_ids.index(stop_id)
    stopped = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))[0]
    assert stopped.outputs[0].token_ids == out.token_ids[:first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_id
    # The stop token itself is not part of the text.
    assert stopped.outputs[0].text == llm.get_tokenizer().decode(out.token_ids[:first])


def test_stop_string_is_excluded(llm):
    full = llm.generate(PROMPTS[2], GREEDY)[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]


def test_eos_ends_generation_unless_ignored(tiny):
    probe = LLM(str(tiny[0]), **SMALL_CACHE)
    out = probe.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    # Make the 4th greedy token an EOS of the model: generation must end there, and go on with ignore_eos.
    probe.engine.core.scheduler.eos_token_ids = frozenset({out.token_ids[3]})
    stopped = probe.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == out.token_ids[:4]
    assert probe.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == out.token_ids
    with_min = probe.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=16, min_tokens=6))[0]
    assert len(with_min.outputs[0].token_ids) >= 6


def test_logprobs_and_prompt_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = llm.generate(PROMPTS[1], params)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for token, position in zip(comp.token_ids, comp.logprobs, strict=True):
        assert token in position and position[token].rank == 1  # greedy picks the top token
        assert len(position) == 3
        assert position[token].decoded_token == llm.get_tokenizer().decode([token])
    chosen = [p[t].logprob for t, p in zip(comp.token_ids, comp.logprobs, strict=True)]
    assert comp.cumulative_logprob == pytest.approx(sum(chosen))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(out.prompt_token_ids[i] in out.prompt_logprobs[i] for i in range(1, len(out.prompt_token_ids)))


def test_abort_frees_blocks(llm):
    engine = llm.engine
    total = engine.kv.pool.num_blocks
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert _free_blocks(llm) < total
    engine.abort_request(["a", "b", "never-existed"])
    assert not engine.has_unfinished_requests() and _free_blocks(llm) == total


def test_rejections_name_the_problem(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        engine.add_request("e", "", SamplingParams())
    with pytest.raises(ValueError, match=r"prompt: .* do not fit"):
        engine.add_request("long", [100] * engine.max_model_len, SamplingParams())
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("mt", PROMPTS[0], SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("vocab", [10**9], SamplingParams())
    engine.add_request("dup", PROMPTS[0], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", PROMPTS[0], SamplingParams(max_tokens=1))
    engine.abort_request("dup")
    # A bad prompt in a batch leaves nothing queued and the engine keeps working.
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], ""], GREEDY)
    assert not engine.has_unfinished_requests()
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].finish_reason == "length"


def test_chat_uses_template(llm):
    messages = [{"role": "user", "content": "Hi"}]
    out = llm.chat(messages, GREEDY, chat_template_kwargs={"enable_thinking": False})[0]
    assert out.prompt.endswith("<think>\n\n</think>\n\n")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt)


def test_stream_concatenates_to_generate(llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert "".join(llm.stream(PROMPTS[4], params)) == llm.generate(PROMPTS[4], params)[0].outputs[0].text


def test_engine_config_rejects_bad_values():
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=-5)


def test_sampled_rows_are_one_view_when_consecutive():
    logits = torch.randn(5, 7)
    rows = [logits[i:i + 1] for i in range(1, 4)]
    stacked = stack_rows(rows)
    assert torch.equal(stacked, logits[1:4]) and stacked.data_ptr() == logits[1].data_ptr()
    for scattered in ([logits[0:1], logits[2:3]], [logits[1:2], torch.randn(1, 7)], [logits[3:4], logits[2:3]]):
        together = stack_rows(scattered)
        assert torch.equal(together, torch.cat(scattered)) and together.data_ptr() != scattered[0].data_ptr()

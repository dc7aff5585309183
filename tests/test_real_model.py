"""The bundled default model (Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M) end to end."""

from __future__ import annotations

import ast

import pytest
import torch

from slotserve import LLM, SamplingParams
from slotserve.engine.model_runner import ScheduledSeq, Want
from slotserve.model_store import DEFAULT_MODEL, assemble

pytestmark = pytest.mark.real_model

# Both sides dequantize the same GGUF blocks to float32 with gguf-py, so the weights are identical and
# only float32 summation order may differ (measured here: max abs diff 0.0 on logits of magnitude ~22).
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, kv_cache_memory=256 << 20)


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends on <|im_end|>, which is not in the text
    assert "<|im_end|>" not in out.text


def test_fibonacci_continues_with_python(llm):
    params = SamplingParams(temperature=0, max_tokens=160, stop=["\n\n"])
    out = llm.generate("def fibonacci(n):", params)[0].outputs[0]
    assert out.finish_reason == "stop", out.text  # the function ended with a blank line
    body = "def fibonacci(n):" + out.text
    tree = ast.parse(body)  # a complete, valid Python function
    assert isinstance(tree.body[0], ast.FunctionDef) and any(isinstance(n, ast.Return) for n in ast.walk(tree))


def test_first_positions_match_transformers_on_the_same_gguf(llm):
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    gguf_path = assemble(DEFAULT_MODEL)
    ref_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ids = llm.get_tokenizer().encode("def fibonacci(n):\n    if n <= 1:\n        return n")[:8]
    assert len(ids) == 8
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    runner = llm.engine.runner
    ours = runner.execute([ScheduledSeq(ids, 0, list(range(runner.num_blocks))[:1], want=Want.ALL)])[0].logits
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= LOGIT_TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_embed_mode_puts_similar_sentences_closer():
    from slotserve import LLM as Engine

    llm = Engine(DEFAULT_MODEL, task="embed", kv_cache_memory=64 << 20)
    texts = ["How do I sort a list in Python?", "What is the way to order a Python list?",
             "The weather in Paris is sunny today."]
    a, b, c = (torch.tensor(o.embedding) for o in llm.embed(texts))
    assert torch.dot(a, b) > torch.dot(a, c) and torch.dot(a, b) > torch.dot(b, c)


def test_tp2_server_answers_as_one_process(llm):
    """`slotserve serve -tp 2` through the official openai client: the same greedy answers as one process. The
    ranks sum o_proj's and down's halves in another order than one GEMM does (float32), so a near-tie could
    flip a token; on these prompts none does (measured: 8 of 8 identical over 32 tokens)."""
    from tests.servers import MODEL, Server

    prompts = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n", "class Stack:",
               "SELECT name FROM", "The quick brown fox", "# Sort a list in Python\n", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    srv = Server(DEFAULT_MODEL, "-tp", "2")
    try:
        client = srv.client()
        got = [client.completions.create(model=MODEL, prompt=p, max_tokens=32, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in prompts]
        assert got == want
    finally:
        assert srv.stop() == 0

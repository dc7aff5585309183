"""The HTTP server as a real subprocess on 127.0.0.1, driven by the official `openai` client and httpx,
on a tiny random Qwen3 (its chat template is Qwen3's, with thinking)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest

from slotserve.faults import FaultPoint, fault_spec
from tests.helpers import assert_figures
from tests.servers import MODEL, Server


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    srv = Server(tiny_qwen3)
    yield srv
    assert srv.stop() == 0  # SIGTERM: drain, stop the engine, exit 0


def test_models_and_request_id(server):
    assert [m.id for m in server.client().models.list()] == [MODEL]
    response = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    assert httpx.get(f"{server.url}/v1/models").headers["x-request-id"]


def test_completion_stream_equals_non_stream(server):
    client = server.client()
    kwargs = dict(model=MODEL, prompt="def fibonacci(n):", max_tokens=20, temperature=0.9, seed=42)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text and full.choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "def fibonacci(n):"}).json()["tokens"]
    assert full.usage.prompt_tokens == len(ids)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_chat_stream_equals_non_stream_and_thinking_switch(server):
    client = server.client()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0.7, seed=3)
    full = client.chat.completions.create(**kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kwargs, stream=True)
                       if c.choices)
    assert streamed == full.choices[0].message.content and full.choices[0].message.role == "assistant"
    on = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["count"]
    off = httpx.post(f"{server.url}/tokenize", json={"messages": messages,
                                                     "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["count"] == on + 4  # "<think>\n\n</think>\n\n" is appended when thinking is off
    no_think = client.chat.completions.create(**kwargs, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert no_think.usage.prompt_tokens == full.usage.prompt_tokens + 4


def test_n_logprobs_and_stop(server):
    client = server.client()
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, n=3, temperature=1.0, seed=1,
                                    logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        assert len(choice.logprobs.tokens) == 6 and len(choice.logprobs.top_logprobs) == 6
        assert all(1 <= len(t) <= 3 for t in choice.logprobs.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          logprobs=True, top_logprobs=3, temperature=0)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)

    full = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:9]  # four characters that usually straddle a token boundary
    cut = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=24, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == cut.text


@pytest.mark.parametrize("path,body,status", [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, 400),
    ("/v1/completions", {"prompt": "hi " * 5000}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"word": 1}}, 400),
    ("/v1/completions", {"max_tokens": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),
    ("/v1/embeddings", {"input": "hi"}, 400),  # a generation server: embeddings need --task embed
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/tokenize", {}, 400),
])
def test_bad_input_gets_a_clear_4xx(server, path, body, status):
    response = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body} if "model" not in body else body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] == status and error["type"].endswith("Error")


def test_malformed_json_is_400(server):
    response = httpx.post(f"{server.url}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_concurrent_clients_with_cancellations(server):
    """100 concurrent streams, 10 cancelled mid-stream: the other 90 get exactly their solo output, and
    afterwards no request runs and every KV block is free."""
    prompts = [f"Request {i}: count to ten." for i in range(100)]
    solo = {i: server.client().completions.create(model=MODEL, prompt=prompts[i], max_tokens=12, temperature=0,
                                                  extra_body={"ignore_eos": True}).choices[0].text
            for i in range(100) if i % 10}

    async def one(client, i):
        stream = await client.completions.create(model=MODEL, prompt=prompts[i], temperature=0, stream=True,
                                                 max_tokens=200 if i % 10 == 0 else 12,
                                                 extra_body={"ignore_eos": True})
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            if i % 10 == 0 and len(text) > 3:
                await stream.close()  # the client goes away mid-stream
                return None
        return text

    async def main():
        client = server.async_client()
        return await asyncio.gather(*[one(client, i) for i in range(100)])

    results = asyncio.run(main())
    for i, text in enumerate(results):
        if i % 10 == 0:
            assert text is None
        else:
            assert text == solo[i], i
    for _ in range(100):
        metrics = httpx.get(f"{server.url}/metrics").text
        if 'slotserve:num_requests_running{model_name="tiny"} 0.0' in metrics:
            break
        time.sleep(0.05)
    assert 'slotserve:num_requests_running{model_name="tiny"} 0.0' in metrics
    assert 'slotserve:kv_cache_usage_perc{model_name="tiny"} 0.0' in metrics
    assert "slotserve:time_to_first_token_seconds_bucket" in metrics


def test_api_key_and_queue_limit(tiny_qwen3):
    srv = Server(tiny_qwen3, "--api-key", "s3cret", "--max-queued-requests", "1")
    try:
        with pytest.raises(openai.AuthenticationError):
            srv.client(api_key="wrong").models.list()
        assert httpx.get(f"{srv.url}/health").status_code == 200  # /health stays open
        client = srv.client(api_key="s3cret", max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        with pytest.raises(openai.InternalServerError) as info:  # 503: the one slot is taken
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
        stream.close()
    finally:
        assert srv.stop() == 0


def test_engine_death_fails_requests_and_health(tiny_qwen3):
    srv = Server(tiny_qwen3, env=fault_spec(FaultPoint.CORE_STEP, 6))
    try:
        client = srv.client(max_retries=0)
        with pytest.raises(openai.APIError):
            for _ in range(3):
                client.completions.create(model=MODEL, prompt="hello", max_tokens=8)
        deadline = time.monotonic() + 10
        while httpx.get(f"{srv.url}/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(f"{srv.url}/health").status_code == 503
        response = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert response.status_code == 503 and "fails on purpose" in response.json()["error"]["message"]
    finally:
        assert srv.stop() == 0


def test_py_spy_sees_the_engine_threads(server):
    # The venv's scripts are not on PATH when pytest runs as `.venv/bin/python -m pytest`.
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if py_spy is None:
        pytest.skip("py-spy is not installed")
    dump = subprocess.run([py_spy, "dump", "--pid", str(server.engine_pid())], capture_output=True, text=True)
    if dump.returncode != 0:
        pytest.skip(f"py-spy cannot attach here: {dump.stderr.strip()}")
    text = dump.stdout
    for name in ("IPCLoop", "EngineCoreLoop", "OutputProcessor"):
        assert name in text


def _bench_serve(server, *args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "slotserve.entrypoints.cli", "bench", "serve", "--base-url", server.url,
         "--input-len", "8", "--output-len", "5", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bench_serve_reports_latencies(server):
    figures = _bench_serve(server, "--num-prompts", "6", "--max-concurrency", "3", "--poll-debug", "0.05")
    assert figures["completed"] == 6 and figures["failed"] == 0 and figures["cancelled"] == 0
    assert figures["debug_polls"] >= 1
    assert_figures(figures, "output_tokens_per_s", *(f"{name}.{stat}" for name in ("ttft_ms", "tpot_ms", "itl_ms")
                                                     for stat in ("mean", "median", "p99")))
    assert figures["after"]["settled"]


def test_bench_serve_for_a_duration_with_cancellations(server):
    figures = _bench_serve(server, "--duration", "3", "--max-concurrency", "4", "--cancel-fraction", "0.5",
                           "--output-len", "12")
    assert figures["failed"] == 0 and figures["cancelled"] > 0 and figures["completed"] > 0, figures
    assert figures["num_prompts"] == figures["completed"] + figures["cancelled"]
    after = figures["after"]
    assert after["settled"] and after["kv_cache_free_blocks"] == after["kv_cache_blocks"] > 0, after


@pytest.mark.real_model
def test_real_model_smoke():
    srv = Server("qwen2.5-coder-0.5b")
    try:
        out = srv.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0)
        assert "Paris" in out.choices[0].message.content and out.choices[0].finish_reason == "stop"
    finally:
        assert srv.stop() == 0


def test_embeddings_endpoint(tiny_qwen3):
    import base64

    import numpy as np

    from slotserve import LLM

    srv = Server(tiny_qwen3, "--task", "embed")
    try:
        client = srv.client()
        texts = ["The cat sat on the mat.", "A kitten rests on a rug.", "def add(a, b): return a + b"]
        out = client.embeddings.create(model=MODEL, input=texts)
        vectors = [d.embedding for d in sorted(out.data, key=lambda d: d.index)]
        offline = LLM(str(tiny_qwen3), task="embed", kv_cache_memory=8 << 20).embed(texts)
        assert np.allclose(vectors, [o.embedding for o in offline], atol=1e-5)
        assert all(abs(np.linalg.norm(v) - 1) < 1e-4 for v in vectors)
        assert out.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in offline) == out.usage.total_tokens

        raw = httpx.post(f"{srv.url}/v1/embeddings", json={"model": MODEL, "input": texts[0],
                                                          "encoding_format": "base64", "dimensions": 16}).json()
        decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        assert decoded.shape == (16,) and abs(np.linalg.norm(decoded) - 1) < 1e-4
        ids = offline[0].prompt_token_ids
        by_ids = client.embeddings.create(model=MODEL, input=[ids]).data[0].embedding
        assert np.allclose(by_ids, vectors[0], atol=1e-5)

        for body in ({"input": []}, {"input": "x", "dimensions": 0}, {"input": "x", "encoding_format": "hex"}):
            response = httpx.post(f"{srv.url}/v1/embeddings", json={"model": MODEL, **body})
            assert response.status_code == 400, (body, response.text)
        response = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert response.status_code == 400 and "embeddings" in response.json()["error"]["message"]
    finally:
        assert srv.stop() == 0

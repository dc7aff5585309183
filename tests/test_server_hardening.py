"""The server against hostile and unlucky clients, black-box: each test drives a real `slotserve serve`
process and checks that nothing wedges, leaks into another request, or grows without bound."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest

from slotserve.faults import FaultPoint, fault_spec
from tests.servers import MODEL, Server

LONG = {"max_tokens": 900, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    srv = Server(tiny_qwen3, "--max-request-bytes", "1M")
    yield srv
    assert srv.stop() == 0


def _post(srv: Server, path: str, body: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=None if body is None else {"model": MODEL, **body}, timeout=60,
                      **kwargs)


def _complete(srv: Server, prompt: str, max_tokens: int = 8, **extra) -> dict:
    response = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                              "ignore_eos": True, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def _is_error_body(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] == status and error["type"].endswith("Error")
    return error


def _metrics(srv: Server) -> dict[str, float]:
    """The engine's gauges from /metrics, by name without the `slotserve:` prefix."""
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return {line.split("{")[0].removeprefix("slotserve:"): float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("slotserve:") and "_bucket" not in line}


def _metric(srv: Server, name: str) -> float:
    return _metrics(srv)[name]


def _engine_idle(srv: Server, timeout: float = 10) -> None:
    """Waits until no sequence runs or waits and every KV block is back in the pool."""
    deadline = time.monotonic() + timeout
    while True:
        values = _metrics(srv)
        idle = (values["num_requests_running"] == 0 and values["num_requests_waiting"] == 0
                and values["kv_cache_free_blocks"] == values["kv_cache_blocks"] > 0)
        if idle or time.monotonic() > deadline:
            assert idle, values
            return
        time.sleep(0.05)


# ---- ids -----------------------------------------------------------------------------------------

def test_a_client_request_id_is_echoed_and_reusable_after_a_rejection(server):
    expected = _complete(server, "Hello there")["choices"][0]["text"]
    for _ in range(50):
        bad = _post(server, "/v1/completions", {"prompt": "Hello there", "stop_token_ids": [1_000_000_000]},
                    headers={"X-Request-Id": "t1"})
        assert _is_error_body(bad, 400)["param"] == "stop_token_ids" and bad.headers["x-request-id"] == "t1"
        good = _post(server, "/v1/completions", {"prompt": "Hello there", "max_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True}, headers={"X-Request-Id": "t1"})
        assert good.status_code == 200 and good.headers["x-request-id"] == "t1"
        assert good.json()["choices"][0]["text"] == expected
    assert httpx.get(f"{server.url}/health").status_code == 200
    _engine_idle(server)


def test_no_cross_talk_when_an_id_is_reused_after_a_disconnect(server):
    expected = _complete(server, "The capital of France is")
    for _ in range(50):
        events = server.sse("/v1/completions", {"prompt": "def fibonacci(n):", "stream": True, **LONG},
                            headers={"X-Request-Id": "t2"})
        for _, _ in zip(range(3), events, strict=False):
            pass
        events.close()  # the client goes away after three chunks
        again = _post(server, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                                  "temperature": 0, "ignore_eos": True},
                      headers={"X-Request-Id": "t2"}).json()
        assert again["usage"]["completion_tokens"] == 8
        assert again["choices"][0]["text"] == expected["choices"][0]["text"]
        assert again["id"] != expected["id"]  # the response id is the server's own
    _engine_idle(server)


# ---- limits --------------------------------------------------------------------------------------

@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "n": 100_000}, "n"),
    ({"prompt": "hi", "n": 129}, "n"),
    ({"prompt": ["a", "b", "c"], "n": 43}, "n"),  # 129 sequences in all
    ({"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"prompt": "hi", "stop_token_ids": list(range(17))}, "stop_token_ids"),
    ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"prompt": "x" * 200_000}, "prompt"),  # more characters than 1024 tokens can hold
])
def test_limits_are_checked_before_any_work(server, body, param):
    start = time.monotonic()
    assert _is_error_body(_post(server, "/v1/completions", body), 400)["param"] == param
    assert time.monotonic() - start < 30  # not a timing claim: a request that queued work would not return at all


def _content_length(response: bytes) -> int:
    head = response.partition(b"\r\n\r\n")[0].decode().lower()
    return next(int(line.split(":")[1]) for line in head.splitlines() if line.startswith("content-length:"))


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        # A 50 MB body is announced and never sent: the answer must not wait for it.
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 52428800\r\n\r\n{")
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
            data += conn.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert "1048576 bytes" in json.loads(body)["error"]["message"]

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(3):
            yield b" " * (1 << 19)

    response = httpx.post(f"{server.url}/v1/completions", content=chunked(), timeout=60,
                          headers={"content-type": "application/json"})
    _is_error_body(response, 413)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_queue_limit_counts_sequences_and_tokenize_needs_the_api_key(tiny_qwen3):
    srv = Server(tiny_qwen3, "--max-queued-requests", "4", "--api-key", "s3cret")
    key = {"Authorization": "Bearer s3cret"}
    try:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
            _is_error_body(_post(srv, path, body), 401)
            ok = _post(srv, path, body, headers=key)
            assert ok.status_code == 200, ok.text
        assert httpx.get(f"{srv.url}/health").status_code == 200 and httpx.get(f"{srv.url}/metrics").status_code == 200

        events = srv.sse("/v1/completions", {"prompt": "hi", "n": 3, "stream": True, **LONG}, headers=key)
        next(events)
        full = _post(srv, "/v1/completions", {"prompt": "hi", "n": 2}, headers=key)
        assert "too many sequences" in _is_error_body(full, 503)["message"]
        assert _is_error_body(_post(srv, "/v1/completions", {"prompt": "hi", "n": 5}, headers=key), 400)["param"] == "n"
        one = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=key)  # the fourth slot
        assert one.json()["usage"]["completion_tokens"] == 2
        events.close()
        _engine_idle(srv)
        assert _post(srv, "/v1/completions", {"prompt": "hi", "n": 4, "max_tokens": 2}, headers=key).status_code == 200
    finally:
        assert srv.stop() == 0


# ---- error bodies ----------------------------------------------------------------------------------

@pytest.mark.parametrize("method,path,content,status,needle", [
    ("GET", "/v1/nowhere", None, 404, "Not Found"),
    ("GET", "/v1/completions", None, 405, "Method Not Allowed"),
    ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "nested"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b"}', 400, "surrogate"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop": ["\\udc00"]}', 400, "surrogate"),
    ("POST", "/v1/completions", b"{not json", 400, "JSON"),
    ("POST", "/v1/completions", b"[1, 2]", 400, "object"),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "role"),
    ("POST", "/v1/chat/completions", b'{"messages": []}', 400, "empty"),
    ("POST", "/v1/completions", b'{"prompt": "hi", "echo": true}', 400, "echo"),
    ("POST", "/v1/completions", b'{"prompt": "hi", "suffix": "x"}', 400, "suffix"),
    ("POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}',
     400, "response_format.type"),
    ("POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", '
     b'"json_schema": {"name": "x", "schema": {"type": "objekt"}}}}', 400, "Invalid type: objekt"),
    ("POST", "/v1/completions", b'{"prompt": "hi", "guided_regex": "((", "guided_choice": ["a"]}', 400,
     "give one constraint"),
    ("POST", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": ""}}]}',
     400, "tools[0].function.name"),
])
def test_every_error_is_an_openai_error_body(server, method, path, content, status, needle):
    response = httpx.request(method, f"{server.url}{path}", content=content, timeout=30,
                             headers={"content-type": "application/json"})
    assert needle in _is_error_body(response, status)["message"]


def test_fields_that_change_nothing_are_accepted(server):
    response = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_tokens": 2, "user": "someone", "metadata": {"k": "v"}, "store": False, "response_format": {"type": "text"},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "none"})
    assert response.status_code == 200, response.text


# ---- streams -------------------------------------------------------------------------------------

def test_n_streams_end_each_choice_exactly_once_with_the_right_usage(server):
    events = list(server.sse("/v1/completions", {"prompt": "Hello", "n": 3, "max_tokens": 7, "temperature": 1.0,
                                                 "seed": 5, "stream": True, "stream_options": {"include_usage": True}}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2]
    assert chunks[-1]["usage"]["completion_tokens"] == 21
    chat = list(server.sse("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                                    "max_tokens": 5, "stream": True}))
    finishes = [c["choices"][0]["index"] for c in chat[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]


def test_a_slow_reader_gets_its_whole_answer(server):
    """The reader stops after one chunk until the engine has finished: the rest still arrives, whole and in
    order, and the server runs others meanwhile (the merging itself: test_async_llm)."""
    expected = _complete(server, "1, 2, 3, 4,", max_tokens=200)["choices"][0]["text"]
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "logprobs": 5, "stream": True}) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        _engine_idle(server)
        assert _complete(server, "meanwhile", max_tokens=4)["usage"]["completion_tokens"] == 4
        rest = [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(line[6:])["choices"][0] for line in [first, *rest[:-1]]]
    assert "".join(c["text"] for c in chunks) == expected and rest[-1] == "data: [DONE]"
    assert sum(len(c["logprobs"]["tokens"]) for c in chunks) == 200


def test_a_disconnect_aborts_every_sequence_it_started(server):
    body = {"model": MODEL, "prompt": ["one", "two"], "n": 3, **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    _engine_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", timeout=0.5, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 4, **LONG})
    _engine_idle(server)


# ---- the engine dies -----------------------------------------------------------------------------

# The threads of a single-process engine; the worker ranks' and micro-batches' points have tests of their own.
@pytest.mark.parametrize("point", [FaultPoint.CORE_STEP, FaultPoint.OUTPUT, FaultPoint.IPC, FaultPoint.FRONTEND_EVENTS])
def test_a_failure_in_any_thread_ends_the_engine_cleanly(tiny_qwen3, point):
    """Each thread in turn raises: in-flight requests end with an error (a stream with an error event and
    [DONE]), /health turns 503, and the server exits with code 1 for a supervisor to restart."""
    srv = Server(tiny_qwen3, "--engine-death-exit-delay", "2", env=fault_spec(point, 6))
    try:
        events, refused = [], None
        for _ in range(30):
            response = _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
            if response.status_code != 200:
                refused = _is_error_body(response, 503)
                break
            events = list(srv.sse("/v1/completions", {"prompt": "hi", "stream": True, "max_tokens": 3}))
            if any("error" in e for e in events[:-1]):
                break
        streamed = [e for e in events[:-1] if "error" in e]
        assert refused or streamed, events
        error = refused or streamed[0]["error"]
        assert "fails on purpose" in error["message"] or "engine" in error["message"], error
        if streamed:
            assert events[-2] == streamed[0] and events[-1] == "[DONE]"
        deadline = time.monotonic() + 2
        while srv.proc.poll() is None and time.monotonic() < deadline:
            if httpx.get(f"{srv.url}/health", timeout=5).status_code == 503:
                break
            time.sleep(0.05)
        else:
            pytest.fail("health never turned 503")
        assert srv.wait_exit(timeout=30) == 1
        assert "fails on purpose" in srv.output()
    finally:
        srv.stop()


def test_sigkill_of_the_engine_ends_every_stream_with_an_error(tiny_qwen3):
    srv = Server(tiny_qwen3, "--engine-death-exit-delay", "2")
    try:
        streams = [srv.sse("/v1/completions", {"prompt": f"p{i}", "stream": True, **LONG}) for i in range(3)]
        for events in streams:
            next(events)
        os.kill(srv.engine_pid(), signal.SIGKILL)
        start = time.monotonic()
        for events in streams:
            tail = list(events)
            assert tail[-1] == "[DONE]" and "engine" in tail[-2]["error"]["message"], tail[-3:]
        assert time.monotonic() - start < 30
        assert srv.wait_exit(timeout=30) == 1
    finally:
        srv.stop()


def test_sigkill_of_the_front_end_makes_the_engine_exit(tiny_qwen3):
    srv = Server(tiny_qwen3)
    engine = psutil.Process(srv.engine_pid())
    srv.proc.kill()
    srv.proc.wait()
    engine.wait(timeout=20)  # psutil.TimeoutExpired if it lingers


def test_sigterm_lets_streams_finish_and_ends_the_rest_with_an_error(tiny_qwen3):
    """One sequence at a time: the first stream finishes inside the grace period, those queued behind it
    (thousands of tokens) cannot, and end with an error event instead of a cut connection."""
    srv = Server(tiny_qwen3, "--shutdown-timeout", "1", "--max-num-seqs", "1")
    try:
        short = srv.sse("/v1/completions", {"prompt": "short", "stream": True, "max_tokens": 10, "temperature": 0,
                                            "ignore_eos": True})
        first = next(short)
        cut: dict[int, list] = {}

        def read(i: int) -> None:
            cut[i] = list(srv.sse("/v1/completions", {"prompt": f"long {i}", "stream": True, **LONG}))

        readers = [threading.Thread(target=read, args=(i,)) for i in range(4)]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 30
        while _metric(srv, "num_requests_waiting") < 3:  # all four arrived: one may have started
            assert time.monotonic() < deadline
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        finished = [first, *short]  # the first event may already hold every token: the tiny model is fast
        assert finished[-1] == "[DONE]" and finished[-2]["choices"][0]["finish_reason"] == "length"
        for reader in readers:
            reader.join()
        assert all(events[-1] == "[DONE]" for events in cut.values())
        assert any("shutting down" in events[-2].get("error", {}).get("message", "") for events in cut.values())
        assert srv.wait_exit(timeout=30) == 0
    finally:
        srv.stop()

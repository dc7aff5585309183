"""The KV disk tier through real servers: a saved prefix survives a restart and gives the same greedy tokens;
llama.cpp's /slots endpoints; metrics and /debug/engine; bad input is a 4xx with an OpenAI error body; a server
killed with SIGKILL in the middle of a write loses nothing it had written and serves no torn block."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import httpx
import pytest

from slotserve.faults import FaultPoint, fault_spec
from slotserve.kv_cache import block_file
from tests.servers import MODEL, Server

PROMPT_A = [(i * 7919) % 150000 + 100 for i in range(200)]  # 12 full blocks of 16
PROMPT_B = [(i * 104729) % 150000 + 100 for i in range(200)]


def _complete(srv: Server, prompt: list[int], **extra) -> dict:
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(srv: Server, prompt: list[int]) -> str:
    return _complete(srv, prompt)["choices"][0]["text"]


def _post(srv: Server, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", json=body, timeout=60)


def _metric(srv: Server, name: str) -> float:
    for line in httpx.get(f"{srv.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["param"] == param and error["message"]


def test_a_saved_prefix_survives_a_restart_and_the_slots_work(tiny_qwen3, tmp_path):
    srv = Server(tiny_qwen3, "--kv-offload-dir", str(tmp_path))
    try:
        want = _tokens(srv, PROMPT_A)
        r = _post(srv, "/v1/cache/save", {"model": MODEL, "prompt": PROMPT_A, "name": "system"})
        assert r.status_code == 200, r.text
        assert r.json()["num_saved_tokens"] == 192 and r.json()["bytes_written"] > 0
        assert [m["name"] for m in httpx.get(f"{srv.url}/v1/cache").json()["data"]] == ["system"]
        chat = _post(srv, "/v1/cache/save", {"messages": [{"role": "system", "content": "Be brief. " * 40}]})
        assert chat.status_code == 200 and chat.json()["num_saved_tokens"] >= 16, chat.text
        assert _metric(srv, "slotserve:kv_offload_bytes_written") > 0

        _error(_post(srv, "/v1/cache/save", {"prompt": PROMPT_A, "messages": []}), 400, "prompt")
        _error(_post(srv, "/v1/cache/save", {"prompt": PROMPT_A, "name": "../up"}), 400, "name")
        _error(_post(srv, "/v1/cache/save", {"prompt": PROMPT_A, "colour": 1}), 400, "colour")
        _error(_post(srv, "/slots/9999?action=save", {"filename": "x"}), 400, "id_slot")
        _error(_post(srv, "/slots/0?action=restore", {"filename": "nothing-saved"}), 404, "filename")
        _error(_post(srv, "/slots/0?action=save", {}), 400, "filename")
        assert _post(srv, "/slots/0?action=explode", {"filename": "x"}).status_code == 400

        _complete(srv, PROMPT_B, id_slot=1)
        saved = _post(srv, "/slots/1?action=save", {"filename": "slot-b"})
        assert saved.status_code == 200 and saved.json()["n_saved"] == 192 and saved.json()["n_written"] > 0
        slots = httpx.get(f"{srv.url}/slots").json()
        assert slots[1]["n_tokens"] == len(PROMPT_B)
        assert _post(srv, "/slots/1?action=erase").json() == {"id_slot": 1, "n_erased": len(PROMPT_B)}
    finally:
        assert srv.stop() == 0

    again = Server(tiny_qwen3, "--kv-offload-dir", str(tmp_path))
    try:
        out = _complete(again, PROMPT_A)
        assert out["choices"][0]["text"] == want
        assert _metric(again, 'slotserve:prefix_cache_hit_tokens{model_name="tiny",tier="disk"}') == 192
        snapshot = httpx.get(f"{again.url}/debug/engine").json()["engine"]["prefix_cache"]
        assert snapshot["tiers"] == ["memory", "disk"] and snapshot["disk"]["hit_blocks"] == 12
        restored = _post(again, "/slots/0?action=restore", {"filename": "slot-b"})
        assert restored.status_code == 200 and restored.json()["n_restored"] == 192, restored.text
        assert restored.json()["n_read"] > 0
    finally:
        assert again.stop() == 0


def test_a_save_needs_the_disk_tier(tiny_qwen3):
    srv = Server(tiny_qwen3)
    try:
        _error(_post(srv, "/v1/cache/save", {"prompt": PROMPT_A}), 400, "kv_offload_dir")
    finally:
        assert srv.stop() == 0


def test_sigkill_in_the_middle_of_a_write_loses_nothing_written(tiny_qwen3, tmp_path):
    # The 17th block written (the 5th of the second save) stalls half-written, so the kill lands mid-write.
    srv = Server(tiny_qwen3, "--kv-offload-dir", str(tmp_path), env=fault_spec(FaultPoint.KV_WRITE_STALL, 17))
    try:
        want_a, want_b = _tokens(srv, PROMPT_A), _tokens(srv, PROMPT_B)
        assert _post(srv, "/v1/cache/save", {"prompt": PROMPT_A, "name": "a"}).json()["num_saved_tokens"] == 192
        def save_b() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the kill cuts it off
                _post(srv, "/v1/cache/save", {"prompt": PROMPT_B})

        threading.Thread(target=save_b, daemon=True).start()
        directory = next(p for p in tmp_path.iterdir() if p.is_dir())
        deadline = time.monotonic() + 30
        # The stalled write: its temporary file beside the 16 whole ones (other writes' pass in a moment).
        while not (list(directory.glob(f"*{block_file.TMP_SUFFIX}"))
                   and len(list(directory.glob(f"*{block_file.SUFFIX}"))) == 16):
            assert time.monotonic() < deadline, "the stalled write never began"
            time.sleep(0.02)
        engine = srv.engine_pid()
        os.kill(engine, signal.SIGKILL)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(timeout=30)
    finally:
        srv.stop()
    torn = list(directory.glob(f"*{block_file.TMP_SUFFIX}"))
    assert torn, "the kill should have left the half-written temporary file"
    files = sorted(directory.glob(f"*{block_file.SUFFIX}"))
    assert len(files) == 16
    key = bytes.fromhex(directory.name)
    for path in files:  # every file under a real name is whole
        block_file.decode(path.read_bytes(), key, int(path.name.removesuffix(block_file.SUFFIX), 16))

    again = Server(tiny_qwen3, "--kv-offload-dir", str(tmp_path))
    try:
        assert not list(directory.glob(f"*{block_file.TMP_SUFFIX}"))
        a = _complete(again, PROMPT_A)
        assert a["choices"][0]["text"] == want_a
        b = _complete(again, PROMPT_B)
        assert b["choices"][0]["text"] == want_b
        disk = _metric(again, 'slotserve:prefix_cache_hit_tokens{model_name="tiny",tier="disk"}')
        assert disk == 192 + 4 * 16  # all of the first save, the four blocks of the second written before the kill
        assert _metric(again, "slotserve:kv_offload_corrupt_files") == 0
    finally:
        assert again.stop() == 0


@pytest.mark.parametrize("point", [FaultPoint.KV_WRITE])
def test_a_failing_writer_ends_the_engine_with_its_reason(tiny_qwen3, tmp_path, point):
    srv = Server(tiny_qwen3, "--kv-offload-dir", str(tmp_path), "--engine-death-exit-delay", "1",
                 env=fault_spec(point, 3))
    try:
        r = _post(srv, "/v1/cache/save", {"prompt": PROMPT_A})
        assert r.status_code == 503 and "KVDiskWriter died" in r.json()["error"]["message"], r.text
        assert srv.wait_exit(60) == 1
    finally:
        srv.stop()

"""A real `slotserve serve` subprocess on 127.0.0.1, for black-box tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import openai
import psutil

MODEL = "tiny"


class Server:
    """Its output goes to a file, not a pipe: a pipe nobody reads fills up and blocks the server's logging."""

    def __init__(self, model_dir, *extra: str, env: dict[str, str] | None = None) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (read after the server stopped)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slotserve.entrypoints.cli", "--log-level", "WARNING", "serve", str(model_dir),
             "--port", str(self.port), "--served-model-name", MODEL, "--kv-cache-memory", "16M",
             "--log-interval", "0", *extra],
            env={**os.environ, **(env or {})}, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def engine_pid(self) -> int:
        """The engine-core process: the server's child started by multiprocessing's spawn."""
        engines = []
        for child in psutil.Process(self.proc.pid).children():
            with contextlib.suppress(psutil.Error):
                if any("spawn_main" in part for part in child.cmdline()):
                    engines.append(child.pid)
        assert len(engines) == 1, engines
        return engines[0]

    def worker_pids(self) -> list[int]:
        """The engine core's worker ranks (tensor parallel)."""
        return [child.pid for child in psutil.Process(self.engine_pid()).children()
                if any("slotserve.engine.worker_process" in part for part in child.cmdline())]

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kwargs.pop("api_key", "none"), **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def sse(self, path: str, body: dict, **kwargs):
        """A streamed POST: yields each event's data (a dict, or the string "[DONE]") as it arrives."""
        with httpx.stream("POST", f"{self.url}{path}", json={"model": MODEL, **body}, timeout=60, **kwargs) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    yield "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def reasoning_server(model_dir) -> Iterator[Server]:
    """A fixture's server over `model_dir` with Qwen3's reasoning parser, stopped (and checked to exit 0) after."""
    srv = Server(model_dir, "--reasoning-parser", "qwen3")
    yield srv
    assert srv.stop() == 0

"""A real `slotserve serve` subprocess on 127.0.0.1, for black-box tests."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import openai
import psutil

from slotserve.bench.server_process import ServerProcess

MODEL = "tiny"


class Server(ServerProcess):
    def __init__(self, model_dir, *extra: str, env: dict[str, str] | None = None) -> None:
        super().__init__(str(model_dir), "--served-model-name", MODEL, "--kv-cache-memory", "16M", *extra, env=env)

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


def reasoning_server(model_dir) -> Iterator[Server]:
    """A fixture's server over `model_dir` with Qwen3's reasoning parser, stopped (and checked to exit 0) after."""
    srv = Server(model_dir, "--reasoning-parser", "qwen3")
    yield srv
    assert srv.stop() == 0

"""A `slotserve serve` subprocess on 127.0.0.1, started and waited on until `/health` answers 200."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from slotserve.distributed.process_groups import free_port


class ServerProcess:
    """Its output goes to a file, not a pipe: a pipe nobody reads fills up and blocks the server's logging."""

    def __init__(self, model: str, *args: str, env: dict[str, str] | None = None,
                 start_timeout: float = 120.0) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (read after the server stopped)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "slotserve.entrypoints.cli", "--log-level", "WARNING", "serve", model,
             "--port", str(self.port), "--log-interval", "0", *args],
            env={**os.environ, **(env or {})}, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.output()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer /health in {start_timeout} s: {self.output()[-4000:]}")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 30 s; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

"""The driver's side of a model split over N ranks: it starts ranks 1 .. N-1 (worker.py), sends each of them
every step, and knows when one has failed.

Rank 0 is the engine core itself: it runs its part of the model in its own process and alone receives the
logits, so the scheduler, the sampler and the three threads stay as they are. A step reaches the workers
as one small message each over a ZMQ socket (the scheduled sequences: token ids, positions, block tables);
the tensors travel only through the process group's collectives.

- `MultiprocExecutor` (`mp`): worker processes on this machine, children of the engine core; the kernel
  kills them when it dies (PR_SET_PDEATHSIG), and they exit when their parent changes.
- `RayExecutor` (`ray`, engine/ray_executor.py): the same workers as Ray actors in a placement group,
  on any machines of a Ray cluster.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from pathlib import Path

import zmq

from slotserve import envs
from slotserve.config import EngineConfig, ExecutorBackend
from slotserve.distributed.process_groups import free_port
from slotserve.distributed.shm_all_reduce import CollectiveTimeoutError, RankGoneError
from slotserve.engine.model_runner import ScheduledSeq
from slotserve.engine.worker_process import (
    AllocateCache,
    ReportKind,
    Step,
    StopWorker,
    WorkerSpec,
    decode_report,
    encode,
)
from slotserve.parallel.ubatch import UbatchError

logger = logging.getLogger("slotserve")

_POLL_S = 0.2


class WorkerError(RuntimeError):
    """A worker rank failed, exited or stopped answering: the model cannot run without it."""


class Executor(ABC):
    """Ranks 1 .. N-1 of the model whose rank 0 runs in this process."""

    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        self.config, self.world_size = config, config.tensor_parallel_size
        self.ctx = zmq.Context()
        self.channel = self.ctx.socket(zmq.ROUTER)
        self.channel.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a vanished worker raises
        self.channel.setsockopt(zmq.LINGER, 0)
        host = self.host()
        port = self.channel.bind_to_random_port(f"tcp://{host}")
        # A worker's error report comes here too, for `failure` (another thread than the channel's).
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.setsockopt(zmq.LINGER, 0)
        reports = self.reports.bind_to_random_port(f"tcp://{host}")
        self.init_method = f"tcp://{host}:{free_port(host)}"
        self.ranks = range(1, self.world_size)
        specs = [WorkerSpec(rank, self.world_size, self.init_method, f"tcp://{host}:{port}", f"tcp://{host}:{reports}",
                            str(model_path), _fields(config), self.watched_pid()) for rank in self.ranks]
        self._failures: list[str] = []
        self._stopped = False
        atexit.register(self.shutdown)
        self.launch(specs)

    # ---- what each backend provides -------------------------------------------------------------

    @abstractmethod
    def host(self) -> str:
        """The address the workers reach this process at."""

    def watched_pid(self) -> int:
        """The pid a worker watches (its parent: exits when it changes); 0: none."""
        return 0

    @abstractmethod
    def launch(self, specs: list[WorkerSpec]) -> None:
        """Starts one worker per spec."""

    @abstractmethod
    def exited(self) -> list[str]:
        """Why each worker that is gone is gone (empty while all run)."""

    @abstractmethod
    def stop(self, grace_s: float) -> None:
        """Ends every worker: after `grace_s` for them to exit on their own, by force."""

    @abstractmethod
    def kill(self) -> None:
        """Ends every worker at once (the engine is dying and will not wait for them). Any thread."""

    # ---- driving them --------------------------------------------------------------------------

    def wait_for(self, kind: ReportKind, timeout_s: float | None = None) -> None:
        """Waits for each worker's `kind` report; WorkerError on an error report, a worker gone, or the
        timeout."""
        waiting = set(self.ranks)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while waiting:
            if self.channel.poll(int(_POLL_S * 1000)):
                report = decode_report(self.channel.recv_multipart()[-1])
                if report.kind is ReportKind.ERROR:
                    raise WorkerError(report.message)
                if report.kind is kind:
                    waiting.discard(report.rank)
                continue
            if gone := self.exited():
                raise WorkerError("; ".join(gone))
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"ranks {sorted(waiting)} did not report {kind.value!r} within {timeout_s:.0f} s")

    def allocate_cache(self, num_blocks: int) -> None:
        """Every rank's cache holds the driver's number of blocks (each block its own KV heads)."""
        self._send(encode(AllocateCache(num_blocks)))
        self.wait_for(ReportKind.READY, self.config.distributed_timeout)

    def send_step(self, seqs: list[ScheduledSeq]) -> None:
        self._send(encode(Step(seqs)))

    def _send(self, payload: bytes) -> None:
        try:
            for rank in self.ranks:
                self.channel.send_multipart([str(rank).encode(), payload])
        except zmq.ZMQError as e:
            raise self.explain(e) from e

    def check(self) -> None:
        """Raises WorkerError where `failure` has a reason."""
        if (reason := self.failure()) is not None:
            raise WorkerError(reason)

    def failure(self) -> str | None:
        """Why the workers can no longer run the model (one reported an error, or is gone); None while they
        can. From one thread only, which may be another than the one driving the steps."""
        while self.reports.poll(0):
            self._failures.append(decode_report(self.reports.recv()).message)
        gone = self.exited()
        # A report sent just before its sender exited may still be on its way.
        if gone and not self._failures and self.reports.poll(int(_POLL_S * 1000)):
            return self.failure()
        reasons = self._failures or gone
        return "; ".join(reasons) if reasons else None

    def explain(self, error: Exception) -> Exception:
        """The error a failed collective or send becomes: a worker's own report where one arrives within a
        second, else which are gone, else the collective's error (a worker that stopped answering), or the
        micro-batch's error, which names this rank and the cause: at once where that cause is its own (it raised,
        stalled, timed out waiting for its turn) rather than a collective that failed."""
        if isinstance(error, UbatchError) and not _collective_failure(error.__cause__):
            return error
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if self.channel.poll(int(_POLL_S * 1000)):
                report = decode_report(self.channel.recv_multipart()[-1])
                if report.kind is ReportKind.ERROR:
                    return WorkerError(report.message)
            elif gone := self.exited():
                return WorkerError("; ".join(gone))
        if isinstance(error, UbatchError):
            return error
        return WorkerError(f"a collective failed and no worker said why (one may hang): {error}")

    def shutdown(self) -> None:
        """Tells the workers to stop, waits briefly, ends any left, and closes the socket. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.shutdown)
        try:
            for rank in self.ranks:
                self.channel.send_multipart([str(rank).encode(), encode(StopWorker())], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # one is gone already: stop ends the rest
        self.stop(grace_s=5.0)
        self.reports.close()
        self.channel.close()
        self.ctx.term()


class MultiprocExecutor(Executor):
    def host(self) -> str:
        return "127.0.0.1"

    def watched_pid(self) -> int:
        return os.getpid()

    def launch(self, specs: list[WorkerSpec]) -> None:
        env = {**os.environ, envs.LOG_LEVEL_ENV: logging.getLevelName(logger.getEffectiveLevel())}
        entry = "from slotserve.engine.worker_process import main; main()"
        self.processes = {spec.rank: subprocess.Popen([sys.executable, "-c", entry, spec.to_json()], env=env)
                          for spec in specs}

    def exited(self) -> list[str]:
        return [f"worker rank {rank} (pid {p.pid}) exited with code {p.returncode}"
                for rank, p in self.processes.items() if p.poll() is not None]

    def stop(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for p in self.processes.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        for p in self.processes.values():
            if p.poll() is None:
                p.kill()


def start_executor(config: EngineConfig, model_path: Path) -> Executor:
    if config.distributed_executor_backend is ExecutorBackend.RAY:
        from slotserve.engine.ray_executor import RayExecutor

        return RayExecutor(config, model_path)
    return MultiprocExecutor(config, model_path)


def _fields(config: EngineConfig) -> dict:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def _collective_failure(error: BaseException | None) -> bool:
    """Whether an error is a collective's: the shared-memory all-reduce's, or gloo's (plain RuntimeErrors)."""
    return type(error) is RuntimeError or isinstance(error, CollectiveTimeoutError | RankGoneError)

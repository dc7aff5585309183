"""A worker process: one rank (1 .. N-1) of a model split over N, the driver (rank 0) being the engine core.

Its `Worker` (engine/worker.py) loads its part of the checkpoint and allocates its part of the KV cache when
the driver says how many blocks; then it runs every step the driver sends it: the same forward pass on its
heads and rows, meeting the other ranks at each collective. It sends nothing back per step (the driver
gathers the logits through the process group). It ends on the driver's word, when the driver is gone, or on
any error, which it reports first. Started as a process (executor.py's `MultiprocExecutor`: `main`) or
as a Ray actor (engine/ray_executor.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import json
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import msgspec
import zmq

from slotserve import envs, faults
from slotserve.config import EngineConfig
from slotserve.engine.model_runner import ScheduledSeq
from slotserve.engine.worker import Rank, Worker
from slotserve.faults import FaultPoint
from slotserve.parallel import timeline

logger = logging.getLogger("slotserve")

_POLL_MS = 200  # how often a waiting worker checks that its driver is still there


# ---- messages --------------------------------------------------------------------------------


class AllocateCache(msgspec.Struct, tag=True):
    num_blocks: int


class Step(msgspec.Struct, tag=True):
    seqs: list[ScheduledSeq]


class StopWorker(msgspec.Struct, tag=True):
    pass


class ReportKind(enum.Enum):
    LOADED = "loaded"  # its part of the weights is loaded
    READY = "ready"  # its cache is allocated
    ERROR = "error"  # it failed, `message` says why; it exits


class Report(msgspec.Struct):
    """Worker -> driver."""

    rank: int
    kind: ReportKind
    message: str = ""


ToWorker = AllocateCache | Step | StopWorker
_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_report = msgspec.msgpack.Decoder(Report)


def encode(message: ToWorker | Report) -> bytes:
    return _encoder.encode(message)


def decode_report(data: bytes) -> Report:
    return _report.decode(data)


# ---- the worker process ----------------------------------------------------------------------


@dataclass
class WorkerSpec:
    """Everything a worker needs to start: which rank, where to meet the others, what to load."""

    rank: int
    world_size: int
    init_method: str  # torch.distributed's rendezvous, e.g. tcp://127.0.0.1:29500
    channel: str  # the driver's ZMQ socket for steps and reports
    errors: str  # the driver's ZMQ socket that an error report also goes to
    model_path: str
    config: dict  # the EngineConfig's fields
    driver_pid: int = 0  # a worker process's parent, watched; 0: not watched (a Ray actor)
    pin_cores: bool = True  # take this rank's share of the host's cores (`rank_cpu_settings`); False: `threads` only

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=lambda v: v.value)

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


class WorkerProcess:
    """A remote rank's life: a `Worker`, driven over the driver's socket."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.config = EngineConfig(**spec.config)
        self.ctx = zmq.Context()
        self.channel = self.ctx.socket(zmq.DEALER)
        self.channel.setsockopt(zmq.IDENTITY, str(spec.rank).encode())
        self.channel.setsockopt(zmq.LINGER, 2000)
        self.channel.connect(spec.channel)
        self.errors = self.ctx.socket(zmq.PUSH)
        self.errors.setsockopt(zmq.LINGER, 2000)
        self.errors.connect(spec.errors)
        self.worker: Worker | None = None
        self.timeline_path = timeline.record_from_env(spec.rank)  # a benchmark's

    def report(self, kind: ReportKind, message: str = "") -> None:
        data = encode(Report(self.spec.rank, kind, message))
        self.channel.send(data)
        if kind is ReportKind.ERROR:
            self.errors.send(data)

    def driver_alive(self) -> bool:
        return not self.spec.driver_pid or os.getppid() == self.spec.driver_pid

    def receive(self) -> ToWorker | None:
        """The driver's next message; None when the driver is gone."""
        while not self.channel.poll(_POLL_MS):
            if not self.driver_alive():
                return None
        return _to_worker.decode(self.channel.recv())

    def load(self) -> None:
        spec = self.spec
        self.worker = Worker(self.config, spec.model_path,
                             Rank(spec.rank, spec.world_size, spec.init_method, spec.pin_cores))
        self.report(ReportKind.LOADED)

    def serve(self) -> None:
        """Steps until the driver says stop or is gone."""
        runner = None
        while (message := self.receive()) is not None:
            if isinstance(message, StopWorker):
                return
            if isinstance(message, AllocateCache):
                runner = self.worker.allocate_cache(message.num_blocks)
                self.report(ReportKind.READY)
                continue
            faults.check(FaultPoint.WORKER_STEP)
            if faults.fires(FaultPoint.WORKER_HANG):
                self._hang()
            runner.execute(message.seqs)

    def _hang(self) -> None:
        """A worker that stops answering (a test's fault): it waits, out of every collective, until its
        driver is gone."""
        logger.error("rank %d hangs on purpose (%s)", self.spec.rank, faults.FAULT_ENV)
        while self.driver_alive():
            time.sleep(0.1)

    def close(self) -> None:
        if self.timeline_path is not None:
            timeline.active().save(self.timeline_path)
        if self.worker is not None:
            self.worker.close()
        self.channel.close()
        self.errors.close()
        self.ctx.term()


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies, even while it is stuck in a collective."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_worker(spec: WorkerSpec) -> int:
    """A worker's whole life; its exit code."""
    process = WorkerProcess(spec)
    try:
        process.load()
        process.serve()
        return 0
    except Exception as e:
        logger.error("rank %d died: %s\n%s", spec.rank, e, traceback.format_exc())
        process.report(ReportKind.ERROR, f"rank {spec.rank}: {type(e).__name__}: {e}")
        return 1
    finally:
        process.close()


def main() -> None:
    spec = WorkerSpec.from_json(sys.argv[1])
    if spec.driver_pid:
        _die_with_parent()
        if os.getppid() != spec.driver_pid:  # the driver died before the line above
            sys.exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides how its workers stop
    logging.basicConfig(level=envs.log_level(),
                        format=f"%(levelname)s %(asctime)s rank-{spec.rank}: %(message)s", datefmt="%H:%M:%S")
    sys.exit(run_worker(spec))


"""A worker: one rank (1 .. N-1) of a model split over N, the driver (rank 0) being the engine core itself.

It joins the ranks' process group, loads its part of the checkpoint, allocates its part of the KV cache when
the driver says how many blocks, then runs every step the driver sends it: the same forward pass on its
heads and rows, meeting the other ranks at each collective. It sends nothing back per step (the driver
gathers the logits through the process group). It ends on the driver's word, when the driver is gone, or on
any error, which it reports first. Started as a process (executor.py's `MultiprocExecutor`: `main`) or
as a Ray actor (distributed/ray_executor.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass

import msgspec
import torch
import zmq

from slotserve.config import EngineConfig, parse_device, parse_dtype
from slotserve.distributed.group import ModelParallel
from slotserve.distributed.process_groups import init_rank_group, lanes, leave_rank_group
from slotserve.engine import faults
from slotserve.engine.faults import FaultPoint
from slotserve.engine.model_runner import ModelRunner, ScheduledSeq, UbatchPolicy
from slotserve.layers.quantization import quantize_int8
from slotserve.models.loader import load_model
from slotserve.parallel import timeline
from slotserve.parallel.cpu import apply_cpu_settings
from slotserve.parallel.threadpool import default_threads

logger = logging.getLogger("slotserve")

_POLL_MS = 200  # how often a waiting worker checks that its driver is still there


# ---- messages --------------------------------------------------------------------------------


class AllocateCache(msgspec.Struct, tag=True):
    num_blocks: int


class Step(msgspec.Struct, tag=True):
    seqs: list[ScheduledSeq]


class Shutdown(msgspec.Struct, tag=True):
    pass


class Report(msgspec.Struct):
    """Worker -> driver: "loaded", "ready" (its cache is allocated) or "error" (with why; it exits)."""

    rank: int
    kind: str
    message: str = ""


ToWorker = AllocateCache | Step | Shutdown
_encoder = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_report = msgspec.msgpack.Decoder(Report)


def encode(message: ToWorker | Report) -> bytes:
    return _encoder.encode(message)


def decode_report(data: bytes) -> Report:
    return _report.decode(data)


# ---- the worker ------------------------------------------------------------------------------


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


def rank_cpu_settings(config: EngineConfig, rank: int) -> tuple[int, tuple[int, ...] | None]:
    """Threads and cores of rank `rank` of a model on this host: the cores split evenly between the ranks
    (the given `cpu_affinity`, else all this process may use), each rank pinned to its share where every
    rank gets at least one core; else the ranks share them, `threads` each (default 1)."""
    ranks = config.tensor_parallel_size
    cores = list(config.cpu_affinity or sorted(os.sched_getaffinity(0)))
    per_rank = len(cores) // ranks
    if per_rank >= 1:
        mine = tuple(cores[rank * per_rank:(rank + 1) * per_rank])
        return config.threads or len(mine), mine
    return config.threads or max(1, default_threads() // ranks), None


class Worker:
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
        self.group = None
        self.runner: ModelRunner | None = None
        self.timeline_path = timeline.record_from_env(spec.rank)  # a benchmark's

    def report(self, kind: str, message: str = "") -> None:
        data = encode(Report(self.spec.rank, kind, message))
        self.channel.send(data)
        if kind == "error":
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
        config, spec = self.config, self.spec
        threads, cores = rank_cpu_settings(config, spec.rank) if spec.pin_cores else (config.threads, None)
        apply_cpu_settings(threads, cores)
        device = parse_device(config.device)
        if device.type == "cuda":
            device = torch.device("cuda", spec.rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        torch.manual_seed(config.seed)
        self.group = init_rank_group(spec.rank, spec.world_size, spec.init_method, device, config.distributed_timeout,
                                     lanes=lanes(config))
        parallel = ModelParallel(self.group, config.enable_expert_parallel, config.expert_comm)
        self.model, self.model_config = load_model(spec.model_path, parse_dtype(config.dtype, device), device,
                                                   config.max_model_len, parallel)
        if config.quantization == "int8":
            quantize_int8(self.model)
        self.report("loaded")

    def serve(self) -> None:
        """Steps until the driver says stop or is gone."""
        while (message := self.receive()) is not None:
            if isinstance(message, Shutdown):
                return
            if isinstance(message, AllocateCache):
                self.runner = ModelRunner(self.model, self.model_config, message.num_blocks, self.config.block_size,
                                          ubatching=UbatchPolicy.of(self.config), prefill=self.config.prefill_precision)
                self.report("ready")
                continue
            faults.check(FaultPoint.WORKER_STEP)
            if faults.fires(FaultPoint.WORKER_HANG):
                self._hang()
            self.runner.execute(message.seqs)

    def _hang(self) -> None:
        """A worker that stops answering (a test's fault): it waits, out of every collective, until its
        driver is gone."""
        logger.error("rank %d hangs on purpose (%s)", self.spec.rank, faults.FAULT_ENV)
        while self.driver_alive():
            time.sleep(0.1)

    def close(self) -> None:
        if self.timeline_path is not None:
            timeline.active().save(self.timeline_path)
        if self.group is not None:
            leave_rank_group(self.group)
        self.channel.close()
        self.errors.close()
        self.ctx.term()


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies, even while it is stuck in a collective."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_worker(spec: WorkerSpec) -> int:
    """A worker's whole life; its exit code."""
    worker = Worker(spec)
    try:
        worker.load()
        worker.serve()
        return 0
    except Exception as e:
        logger.error("rank %d died: %s\n%s", spec.rank, e, traceback.format_exc())
        worker.report("error", f"rank {spec.rank}: {type(e).__name__}: {e}")
        return 1
    finally:
        worker.close()


def main() -> None:
    spec = WorkerSpec.from_json(sys.argv[1])
    if spec.driver_pid:
        _die_with_parent()
        if os.getppid() != spec.driver_pid:  # the driver died before the line above
            sys.exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides how its workers stop
    logging.basicConfig(level=os.environ.get("SLOTSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(levelname)s %(asctime)s rank-{spec.rank}: %(message)s", datefmt="%H:%M:%S")
    sys.exit(run_worker(spec))


"""The ranks that share one model: who this rank is among them, and the collectives the model calls.

A `RankGroup` of size 1 (`SINGLE`) is the single-process engine: every collective is the identity, so the
model code calls them unconditionally. Larger groups run on torch.distributed: gloo on the CPU (with a
shared-memory all-reduce for ranks on one host, distributed/shm_all_reduce.py), NCCL on CUDA, plus a gloo
group for small metadata either way. Every collective carries the group's timeout.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as dist

from slotserve import faults
from slotserve.config import ExpertCommKind
from slotserve.faults import FaultPoint
from slotserve.parallel import timeline, ubatch
from slotserve.parallel.timeline import SpanKind

T = TypeVar("T")


class ShmSum(Protocol):
    def all_reduce(self, t: torch.Tensor) -> None: ...
    def fits_one_round(self, t: torch.Tensor) -> bool: ...
    def start(self, t: torch.Tensor) -> None: ...
    def finish(self, t: torch.Tensor) -> float: ...


@dataclass
class CollectiveClock:
    """Time this rank spent waiting on the group's collectives (for the others included), for benchmarks."""

    seconds: float = 0.0
    calls: int = 0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._start
        self.calls += 1


class Pending(Generic[T]):
    """Collectives in flight and what to do with their results once they are done.

    `wait` in a micro-batch (parallel/ubatch.py) first hands the turn on, so that another micro-batch computes
    while these travel, and waits for them once the turn is back."""

    def __init__(self, works: list[Any], finish: Callable[[], T], name: str, group: RankGroup,
                 started: float | None = None) -> None:
        """started: when the works were launched (time.monotonic()); default now."""
        self._works, self._finish, self._name, self._group = works, finish, name, group
        self._started = time.monotonic() if started is None else started

    def wait(self) -> T:
        running = ubatch.current()
        if running is not None:
            faults.check(FaultPoint.UBATCH_RAISE)
            running.yield_turn()
        with self._group.clock:
            done = max([self._started, *(w.wait() for w in self._works)])
            if self._group.latency_s:
                ready = self._started + self._group.latency_s
                time.sleep(max(0.0, ready - time.monotonic()))
                done = max(done, ready)
        if (tl := timeline.active()) is not None:
            tl.add(running.lane if running is not None else "step", SpanKind.COMMUNICATION, self._name,
                   self._started, done)
        return self._finish()


class _Work:
    """A torch.distributed work object; `wait` returns when its data arrived (time.monotonic())."""

    def __init__(self, work: Any) -> None:
        self.work, self.done_at = work, None
        if timeline.active() is not None:  # the completion time only matters to a timeline
            work.get_future().add_done_callback(self._completed)

    def _completed(self, _future: Any) -> None:
        self.done_at = time.monotonic()

    def wait(self) -> float:
        self.work.wait()
        return self.done_at or time.monotonic()


class _StreamWork(_Work):
    """CUDA: a collective launched on a lane's communication stream; waiting makes the compute stream wait for
    it (an event on the GPU), not the CPU."""

    def __init__(self, work: Any, stream: Any) -> None:
        super().__init__(work)
        self.stream = stream

    def wait(self) -> float:
        with torch.cuda.stream(self.stream):
            self.work.wait()
        torch.cuda.current_stream().wait_stream(self.stream)
        return self.done_at or time.monotonic()


class _ShmWork:
    def __init__(self, shm: ShmSum, buffer: torch.Tensor) -> None:
        self.shm, self.buffer = shm, buffer
        shm.start(buffer)

    def wait(self) -> float:
        return self.shm.finish(self.buffer)


@dataclass(frozen=True, eq=False)
class RankGroup:
    """`size` ranks, this one `rank`: the tensor-parallel (and expert-parallel) group of one model.

    `lanes`: one group of the same ranks per micro-batch (micro-batch overlap), with process groups and
    buffers of its own, so that the collectives of different micro-batches never meet; a collective made
    in micro-batch i runs on lane i (`lane`)."""

    rank: int = 0
    size: int = 1
    device_group: dist.ProcessGroup | None = None  # the model's tensors: gloo on CPU, NCCL on CUDA
    cpu_group: dist.ProcessGroup | None = None  # small host-side metadata (split counts, votes)
    fast_all_reduce: ShmSum | None = None  # shared memory, for CPU ranks on one host
    timeout: datetime.timedelta = field(default_factory=lambda: datetime.timedelta(minutes=2))
    clock: CollectiveClock = field(default_factory=CollectiveClock)
    lanes: tuple[RankGroup, ...] = ()
    stream: Any = None  # CUDA lanes: the stream their collectives run on
    latency_s: float = 0.0  # a floor on every collective's time (envs.LATENCY_ENV)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: {self.rank} is not in a group of {self.size}")
        if self.size > 1 and self.device_group is None:
            raise ValueError("device_group: a group of several ranks needs a process group")

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one in the engine core's process, which alone receives the logits."""
        return self.rank == 0

    def lane(self) -> RankGroup:
        """The group the calling thread's collectives run on: its micro-batch's lane, else this group."""
        running = ubatch.current()
        if running is None or self.size == 1:
            return self
        if running.index >= len(self.lanes):
            raise RuntimeError(f"micro-batch {running.index}: the rank group has {len(self.lanes)} lanes")
        return self.lanes[running.index]

    def launch(self, start: Callable[[], list[Any]], finish: Callable[[], T], name: str) -> Pending[T]:
        """`start()`'s async torch.distributed works (on this group's process groups) as a Pending; on a CUDA
        lane they run on its communication stream, after what the compute stream has queued so far."""
        started = time.monotonic()
        if self.stream is None:
            return Pending([_Work(w) for w in start()], finish, name, self, started)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            works = start()
        return Pending([_StreamWork(w, self.stream) for w in works], finish, name, self, started)

    def start_all_reduce(self, x: torch.Tensor) -> Pending[torch.Tensor]:
        """The sum over the ranks, in place, started: `.wait()` returns `x`."""
        g = self.lane()
        if self.size == 1:
            return Pending([], lambda: x, "all-reduce", g)
        fast = g.fast_all_reduce
        if fast is not None and x.device.type == "cpu" and x.dtype == torch.float32:
            buffer = x if x.is_contiguous() else x.contiguous()
            if not fast.fits_one_round(buffer):
                with g.clock:
                    fast.all_reduce(buffer)
                return Pending([], lambda: x if buffer is x else x.copy_(buffer), "all-reduce", g)
            started = time.monotonic()
            return Pending([_ShmWork(fast, buffer)], lambda: x if buffer is x else x.copy_(buffer), "all-reduce", g,
                           started)
        return g.launch(lambda: [dist.all_reduce(x, group=g.device_group, async_op=True)], lambda: x, "all-reduce")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place; returns `x`."""
        return x if self.size == 1 else self.start_all_reduce(x).wait()

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's `x` (same shape on each), concatenated along `dim` in rank order."""
        if self.size == 1:
            return x
        g = self.lane()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        source = x.contiguous()
        return g.launch(lambda: [dist.all_gather(parts, source, group=g.device_group, async_op=True)],
                        lambda: torch.cat(parts, dim=dim), "all-gather").wait()

    def gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor | None:
        """Every rank's `x` concatenated along `dim` on the driver; None on the other ranks."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        with self.clock:
            dist.gather(x.contiguous(), parts, dst=dist.get_global_rank(self.device_group, 0), group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def sum_over_ranks(self, values: list[int]) -> list[int]:
        """Small integers summed over the ranks (votes), through the fastest path there is."""
        if self.size == 1:
            return values
        return [round(v) for v in self.all_reduce(torch.tensor(values, dtype=torch.float32)).tolist()]


SINGLE = RankGroup()


@dataclass(frozen=True)
class ModelParallel:
    """How one model is split: its tensor-parallel group, and whether its experts are split across it
    (expert parallel, moving tokens by `expert_comm`) instead of each expert being split by tensor parallel."""

    group: RankGroup = SINGLE
    expert_parallel: bool = False
    expert_comm: ExpertCommKind = ExpertCommKind.ALL_TO_ALL


UNSPLIT = ModelParallel()  # a model on one rank

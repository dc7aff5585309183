"""Micro-batch overlap (as vLLM's dual-batch overlap, `--enable-dbo`): one step run as N micro-batches, each
on a thread of its own, so that while one computes, another's collectives are in flight.

The N threads (`UbatchPool`, started once) and the caller meet at a `threading.Barrier(N + 1)`; then the turn
goes around a ring, 0, 1, ..., N - 1, 0, ...: exactly one micro-batch computes at a time (they share the
cores, torch's threads and the pool). At each communication point a micro-batch starts its collective, hands
the turn on (`Ubatch.yield_turn`, which `Pending.wait` of distributed/group.py calls) and waits for the
collective's result only once the turn is back. Each micro-batch reaches the same communication points in the
same order on every rank, and uses a process group of its own, so the ranks' collectives match.

Failure: the barrier and every wait have a timeout. A micro-batch that raises, or waits past the timeout,
aborts the ring and the barrier; that wakes the others, which stop at their next wait; `UbatchPool.run`
raises one `UbatchError` naming the micro-batch, the rank and the cause. (vLLM's version parks a raising
micro-batch's peer forever and joins it without a timeout.)
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from slotserve.parallel import timeline
from slotserve.parallel.timeline import SpanKind

logger = logging.getLogger("slotserve")

S = TypeVar("S")
T = TypeVar("T")


class UbatchError(RuntimeError):
    """A micro-batch of a step failed; the message names it, the rank and the cause."""


class UbatchAborted(Exception):
    """Another micro-batch of the step failed: this one stops."""


class _Ring:
    """Whose turn it is among N micro-batches, and the step's first failure."""

    def __init__(self, n: int, timeout_s: float, barrier: threading.Barrier) -> None:
        self.n, self.timeout_s, self.barrier = n, timeout_s, barrier
        self.turn = [threading.Event() for _ in range(n)]
        self.done = [False] * n
        self.aborted = threading.Event()
        self.failure: tuple[int, BaseException] | None = None
        self.holder = 0  # whose turn it is
        self._lock = threading.Lock()

    def take(self, i: int) -> None:
        """Waits until it is micro-batch i's turn."""
        if not self.turn[i].wait(self.timeout_s):
            raise TimeoutError(f"waited {self.timeout_s:g} s for its turn while micro-batch {self.holder} had it")
        if self.aborted.is_set():
            raise UbatchAborted
        self.turn[i].clear()
        self.holder = i

    def pass_on(self, i: int, finished: bool = False) -> None:
        """Hands the turn to the next micro-batch after i that has not finished."""
        with self._lock:
            self.done[i] = self.done[i] or finished
            for step in range(1, self.n + 1):
                j = (i + step) % self.n
                if not self.done[j]:
                    self.turn[j].set()
                    return

    def fail(self, i: int, error: BaseException) -> None:
        """Micro-batch i failed (i = -1: the caller): the first failure is the step's; everyone wakes."""
        with self._lock:
            if self.failure is None and not isinstance(error, UbatchAborted | threading.BrokenBarrierError):
                self.failure = (i, error)
            self.aborted.set()
        self.barrier.abort()
        for event in self.turn:
            event.set()


class Ubatch:
    """The micro-batch this thread runs (`current()`)."""

    def __init__(self, index: int, count: int, ring: _Ring) -> None:
        self.index, self.count, self._ring = index, count, ring
        self.lane = f"ubatch-{index}"
        self._since = 0.0

    @property
    def aborted(self) -> threading.Event:
        """Set once the step has failed."""
        return self._ring.aborted

    def yield_turn(self) -> None:
        """Hands the turn to the next micro-batch; returns when it is this one's again."""
        self._end_compute("compute")
        self._ring.pass_on(self.index)
        self._take()

    def _take(self) -> None:
        self._ring.take(self.index)
        self._since = time.monotonic()

    def _end_compute(self, name: str) -> None:
        if (tl := timeline.active()) is not None:
            tl.add(self.lane, SpanKind.COMPUTE, name, self._since)


_local = threading.local()


def current() -> Ubatch | None:
    """The micro-batch the calling thread runs; None outside one."""
    return getattr(_local, "ubatch", None)


class _Step:
    """One split step: its barrier, its ring, and which micro-batches arrived and finished."""

    def __init__(self, prepare: Callable[[int], S], run: Callable[[int, S], T], n: int, timeout_s: float) -> None:
        self.prepare, self.run, self.n = prepare, run, n
        self.barrier = threading.Barrier(n + 1)
        self.ring = _Ring(n, timeout_s, self.barrier)
        self.arrived, self.finished = [False] * n, [False] * n
        self.results: list[T | None] = [None] * n
        self.all_done = threading.Event()
        self._lock = threading.Lock()

    def body(self, i: int) -> None:
        """Micro-batch i, on its thread."""
        ring = self.ring
        ubatch = _local.ubatch = Ubatch(i, self.n, ring)
        try:
            prepared = self.prepare(i)
            self.arrived[i] = True
            self.barrier.wait()
            ubatch._take()
            self.results[i] = self.run(i, prepared)
            ubatch._end_compute("compute")
            ring.pass_on(i, finished=True)
        except BaseException as e:
            ring.fail(i, e)
        finally:
            _local.ubatch = None
            with self._lock:
                self.finished[i] = True
                if all(self.finished):
                    self.all_done.set()


class UbatchPool:
    """The threads `ubatch-0` .. `ubatch-<n-1>`, started once and reused by every split step: starting n
    threads a step cost more than overlap saved on small steps. After a failed step the threads are retired
    (each ends once its part of that step has stopped) and the next step starts fresh ones."""

    def __init__(self, n: int, timeout_s: float, rank: int = 0) -> None:
        self.n, self.timeout_s, self.rank = n, timeout_s, rank
        self._lanes: list[tuple[threading.Thread, queue.SimpleQueue]] = []

    def run(self, prepare: Callable[[int], S], run: Callable[[int, S], T]) -> list[T]:
        """Runs micro-batches 0..n-1, one on each thread: each `prepare(i)` (at once, before the barrier), then,
        taking turns, `run(i, prepared)`. Their results in order, or UbatchError."""
        if not self._lanes:
            self._lanes = [_start_lane(i) for i in range(self.n)]
        step = _Step(prepare, run, self.n, self.timeout_s)
        for _thread, jobs in self._lanes:
            jobs.put(step)
        ring = step.ring
        # Only the caller's wait times out, so the micro-batches missing when it does are the ones to blame (a thread
        # that timed out first would wake the stalled one, which would then seem to have arrived).
        try:
            step.barrier.wait(self.timeout_s)
            ring.turn[0].set()
        except threading.BrokenBarrierError:
            missing = [i for i in range(self.n) if not step.arrived[i]]
            ring.fail(missing[0] if missing else -1,
                      TimeoutError(f"micro-batches {missing} did not reach the start within {self.timeout_s:g} s"))
        while not step.all_done.wait(0.05):
            if ring.aborted.is_set():
                break
        if ring.aborted.is_set():
            self.close(wait_s=0.0)
            _raise(step, self.rank, self.timeout_s)
        return step.results

    def close(self, wait_s: float = 1.0) -> None:
        """Retires the threads: each ends after its current step; waits up to `wait_s` for them. Idempotent."""
        lanes, self._lanes = self._lanes, []
        for _thread, jobs in lanes:
            jobs.put(None)
        deadline = time.monotonic() + wait_s
        for thread, _jobs in lanes:
            thread.join(max(0.0, deadline - time.monotonic()))


def _start_lane(i: int) -> tuple[threading.Thread, queue.SimpleQueue]:
    jobs: queue.SimpleQueue[_Step | None] = queue.SimpleQueue()

    def serve() -> None:
        while (step := jobs.get()) is not None:
            step.body(i)

    thread = threading.Thread(target=serve, name=f"ubatch-{i}", daemon=True)
    thread.start()
    return thread, jobs


def _raise(step: _Step, rank: int, timeout_s: float) -> None:
    """The step's error, once its micro-batches have stopped (each is bounded by its waits' timeouts)."""
    step.all_done.wait(timeout_s)
    left = [f"ubatch-{i}" for i, done in enumerate(step.finished) if not done]
    index, cause = step.ring.failure or (-1, UbatchAborted("stopped"))
    n = step.n
    who = f"micro-batch {index} of {n}" if index >= 0 else f"the step's {n} micro-batches"
    extra = f" (threads {left} still running)" if left else ""
    if left:
        logger.error("rank %d: micro-batch threads %s did not stop within %g s", rank, left, timeout_s)
    raise UbatchError(f"rank {rank}: {who} failed: {type(cause).__name__}: {cause}{extra}") from cause


@dataclass
class _Trials:
    """A kind of step's last seconds per token, split and whole."""

    split: deque[float] = field(default_factory=lambda: deque(maxlen=OverlapGate.SAMPLES))
    whole: deque[float] = field(default_factory=lambda: deque(maxlen=OverlapGate.SAMPLES))
    seen: set[bool] = field(default_factory=set)  # the ways whose first, warm-up step has been dropped
    decided: int = 0  # steps since both ways had their samples


class OverlapGate:
    """Whether splitting pays on this rank, learnt from its own steps, so that overlap turns itself off where
    it costs more than it hides (two cores and a fast link). Steps are of a kind: decode-only or not, and
    their tokens to the nearest power of two. Each kind tries both ways until each has `SAMPLES` timed steps
    (after one warm-up step each); then it splits only while split steps take less per token, and every
    `PROBE_EVERY` steps tries the other way once, so that a change in load is seen."""

    SAMPLES = 3
    PROBE_EVERY = 50

    def __init__(self) -> None:
        self._kinds: dict[tuple[bool, int], _Trials] = {}

    def wants(self, decode: bool, tokens: int) -> bool:
        """This rank's vote on splitting a step of this kind."""
        trials = self._kinds.setdefault(_kind(decode, tokens), _Trials())
        if len(trials.split) < self.SAMPLES or len(trials.whole) < self.SAMPLES:
            return len(trials.split) <= len(trials.whole)
        trials.decided += 1
        better = statistics.median(trials.split) < statistics.median(trials.whole)
        return not better if trials.decided % self.PROBE_EVERY == 0 else better

    def record(self, decode: bool, tokens: int, split: bool, seconds: float) -> None:
        """A step of this kind took `seconds`, split or whole (as the ranks agreed, whatever this one wanted)."""
        trials = self._kinds.setdefault(_kind(decode, tokens), _Trials())
        if split not in trials.seen:
            trials.seen.add(split)
            return
        (trials.split if split else trials.whole).append(seconds / tokens)

    def choices(self) -> dict[str, bool]:
        """Each decided kind's way ("decode <= 32 tokens": True for split), for reports."""
        out = {}
        for (decode, bound), t in sorted(self._kinds.items()):
            if len(t.split) == len(t.whole) == self.SAMPLES:
                name = f"{'decode' if decode else 'prefill'} <= {bound} tokens"
                out[name] = statistics.median(t.split) < statistics.median(t.whole)
        return out


def _kind(decode: bool, tokens: int) -> tuple[bool, int]:
    return decode, 1 << max(0, tokens - 1).bit_length()

"""Micro-batch overlap (as vLLM's dual-batch overlap, `--enable-dbo`): one step run as N micro-batches, each
on a thread of its own, so that while one computes, another's collectives are in flight.

The N threads and the caller meet at a `threading.Barrier(N + 1)`; then the turn goes around a ring, 0, 1,
..., N - 1, 0, ...: exactly one micro-batch computes at a time (they share the cores, torch's threads and
the pool). At each communication point a micro-batch starts its collective, hands the turn on
(`Ubatch.yield_turn`, which `Pending.wait` of distributed/group.py calls) and waits for the collective's
result only once the turn is back. Each micro-batch reaches the same communication points in the same
order on every rank, and uses a process group of its own, so the ranks' collectives match.

Failure: the barrier and every wait have a timeout. A micro-batch that raises, or waits past the timeout,
aborts the ring and the barrier; that wakes the others, which stop at their next wait; `run_ubatches`
raises one `UbatchError` naming the micro-batch, the rank and the cause. (vLLM's version parks a raising
micro-batch's peer forever and joins it without a timeout.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
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


def run_ubatches(prepare: Callable[[int], S], run: Callable[[int, S], T], n: int, timeout_s: float,
                 rank: int = 0) -> list[T]:
    """Runs micro-batches 0..n-1 on threads `ubatch-<i>`: each `prepare(i)` (at once, before the barrier),
    then, taking turns, `run(i, prepared)`. Their results in order, or UbatchError."""
    # Only the caller's wait times out, so the micro-batches missing when it does are the ones to blame (a thread
    # that timed out first would wake the stalled one, which would then seem to have arrived).
    barrier = threading.Barrier(n + 1)
    ring = _Ring(n, timeout_s, barrier)
    arrived, results = [False] * n, [None] * n
    remaining = [n]
    all_done = threading.Event()
    count_lock = threading.Lock()

    def body(i: int) -> None:
        ubatch = _local.ubatch = Ubatch(i, n, ring)
        try:
            prepared = prepare(i)
            arrived[i] = True
            barrier.wait()
            ubatch._take()
            results[i] = run(i, prepared)
            ubatch._end_compute("compute")
            ring.pass_on(i, finished=True)
        except BaseException as e:
            ring.fail(i, e)
        finally:
            _local.ubatch = None
            with count_lock:
                remaining[0] -= 1
                if not remaining[0]:
                    all_done.set()

    threads = [threading.Thread(target=body, args=(i,), name=f"ubatch-{i}", daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    try:
        barrier.wait(timeout_s)
        ring.turn[0].set()
    except threading.BrokenBarrierError:
        missing = [i for i in range(n) if not arrived[i]]
        ring.fail(missing[0] if missing else -1,
                  TimeoutError(f"micro-batches {missing} did not reach the start within {timeout_s:g} s"))
    while not all_done.wait(0.05):
        if ring.aborted.is_set():
            break
    if ring.aborted.is_set():
        _raise(ring, threads, n, rank, timeout_s)
    return results


def _raise(ring: _Ring, threads: Sequence[threading.Thread], n: int, rank: int, timeout_s: float) -> None:
    """The step's error, once its threads have stopped (each is bounded by its waits' timeouts)."""
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [t.name for t in threads if t.is_alive()]
    index, cause = ring.failure or (-1, UbatchAborted("stopped"))
    who = f"micro-batch {index} of {n}" if index >= 0 else f"the step's {n} micro-batches"
    extra = f" (threads {left} still running)" if left else ""
    if left:
        logger.error("rank %d: micro-batch threads %s did not stop within %g s", rank, left, timeout_s)
    raise UbatchError(f"rank {rank}: {who} failed: {type(cause).__name__}: {cause}{extra}") from cause


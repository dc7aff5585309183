"""A persistent CPU thread pool whose parallel-for makes the calling thread work too.

`ThreadPool.parfor(start, end, body, ctx)` runs `body(ctx, i)` for every i in [start, end) on
`nthreads = workers + 1` executors: worker k takes chunk k, the calling thread takes the last chunk
and then waits for the others (the join). The split is static and contiguous: with n items the first
`n % nthreads` chunks get one item more than the rest (`chunk_bounds`). Inside a region `worker_id()`
answers the executor's index (the caller is `nthreads - 1`); outside any region it answers -1.

The GIL lets one thread at a time run Python bytecode, so bodies that are pure Python gain nothing
here: they run one after another and pay the dispatch on top. The pool earns its place for bodies
that spend their time in code that releases the GIL (torch and numpy kernels, decompression, file
reads), each body call a real piece of work (a block of rows, one expert, one tensor) rather than
one scalar. Such bodies should run torch single-threaded or nearly so: see `configure_torch_threads`.

How a region runs:
- Publishing a region wakes only the workers that sleep: a worker that has just finished a chunk
  polls for the next region for a short while (`_WORKER_POLL_S`) before it goes to sleep.
- The join waits in tiers: it spins `join_spin` rounds (env `SLOTSERVE_TP_JOIN_SPIN`), then yields
  the CPU and the GIL for up to `_JOIN_YIELD_S`, then sleeps 1 ms at a time and re-signals unfinished
  workers every 2 s, so a lost wake-up delays the caller instead of hanging it. The default spin is 0
  when the interpreter has a GIL: a spinning caller holds it, and finishing workers need it back.
- A parfor called from inside a parfor body (of any pool) runs serially in the thread that calls it.
- An exception raised by a body ends that executor's chunk; the others run theirs to the end, and
  after the join the caller re-raises it (the first one raised; later ones in the same region are
  dropped). The pool stays usable.
- One region at a time per pool: parfor calls from different threads take turns.
- Workers are daemon threads named `slotserve-tp-<index>` (they show in `py-spy dump`). They start on
  the first region; `shutdown()` (also run at exit) stops them. In a forked child every pool gets
  fresh workers on its next region, since the parent's threads do not exist there.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slotserve import envs

Body = Callable[[Any, int], None]

_HAS_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()  # False only on a free-threaded build
DEFAULT_JOIN_SPIN = 0 if _HAS_GIL else 200  # rounds; a spin holding the GIL only delays the workers
_JOIN_YIELD_S = 0.002  # then yield (GIL released) for this long before sleeping 1 ms at a time
_JOIN_SLEEP_S = 0.001
_RESIGNAL_S = 2.0
_WORKER_POLL_S = 0.0005  # an idle worker looks for the next region this long before it sleeps

_local = threading.local()  # .wid: this thread's executor index in the region it is executing, else -1


def worker_id() -> int:
    """The calling executor's index in the current region: 0..workers-1 for workers, nthreads-1 for
    the thread that called parfor; -1 outside any region. A nested (serial) parfor keeps the index of
    the region it runs in."""
    return getattr(_local, "wid", -1)


def chunk_bounds(n: int, nthreads: int) -> list[tuple[int, int]]:
    """Static split of [0, n) into `nthreads` contiguous [lo, hi) chunks; the first n % nthreads
    chunks get one item more. Chunks are empty when n < nthreads."""
    if nthreads < 1:
        raise ValueError(f"nthreads must be >= 1, got {nthreads}")
    base, extra = divmod(max(n, 0), nthreads)
    bounds, lo = [], 0
    for k in range(nthreads):
        hi = lo + base + (k < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def available_cores() -> int:
    """The number of cores this process may run on (its affinity mask), not the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def default_threads() -> int:
    """`SLOTSERVE_THREADS` when set, else `available_cores()`."""
    return envs.threads() or available_cores()


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6] (the taskset / cpuset syntax), in the order given."""
    cpus: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"not a CPU list (e.g. 0-3,6): {text!r}") from None
    if not cpus:
        raise ValueError(f"empty CPU list: {text!r}")
    return cpus


def torch_threads_for(pool_threads: int, cores: int | None = None) -> int:
    """The torch intra-op thread count for bodies run by `pool_threads` executors at once, so that
    together they do not oversubscribe the cores: max(1, cores // pool_threads)."""
    if pool_threads < 1:
        raise ValueError(f"pool_threads must be >= 1, got {pool_threads}")
    return max(1, (cores or available_cores()) // pool_threads)


def configure_torch_threads(pool: ThreadPool | None = None, count: int | None = None) -> int:
    """Sets torch's intra-op thread count (default `torch_threads_for(pool.threads)`) in this thread
    and in every executor of `pool` (default `get_pool()`); returns it.

    Every executor needs it: torch keeps the OpenMP thread count per thread, and a worker that missed
    a change goes on running each op with its old team on top of its siblings (on a busy 2-core machine
    a 256x256 matmul ran 30x slower so). The count also applies to torch ops outside pool regions: use
    this where the hot loop is pool-driven."""
    import torch  # here, not at module import: the pool itself does not need torch

    pool = pool or get_pool()
    count = torch_threads_for(pool.threads) if count is None else count
    torch.set_num_threads(count)
    # n == nthreads: the static split hands exactly one item to each executor.
    pool.parfor(0, pool.threads, lambda _ctx, _i: torch.set_num_threads(count))
    return count


@dataclass(eq=False)
class _Region:
    gen: int
    body: Body
    ctx: Any
    bounds: list[tuple[int, int]]  # absolute [lo, hi) per executor; the caller's chunk is the last
    done: list[bool]  # per worker; list item stores are atomic, so no lock is needed
    errors: list[BaseException] = field(default_factory=list)


@dataclass(eq=False)
class _Worker:
    index: int  # its executor index, and its chunk's
    wake: threading.Event = field(default_factory=threading.Event)
    sleeping: bool = False
    thread: threading.Thread | None = None


class ThreadPool:
    """Persistent workers plus the calling thread; see the module docstring.

    threads: executors including the caller (default `default_threads()`); threads=1 runs every region
    in the caller. cpu_affinity: pin worker k to core cpu_affinity[k % len(cpu_affinity)] (Linux); the
    caller is not pinned (it is the user's thread), so leave its core at the end of the list.
    join_spin: spin rounds of the join (default env `SLOTSERVE_TP_JOIN_SPIN`, else DEFAULT_JOIN_SPIN)."""

    def __init__(self, threads: int | None = None, cpu_affinity: Sequence[int] | None = None,
                 join_spin: int | None = None) -> None:
        self.threads = default_threads() if threads is None else threads
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self.cpu_affinity = list(cpu_affinity) if cpu_affinity is not None else None
        if self.cpu_affinity is not None:
            if not hasattr(os, "sched_setaffinity"):
                raise NotImplementedError("cpu_affinity needs os.sched_setaffinity (Linux)")
            allowed = os.sched_getaffinity(0)
            if not self.cpu_affinity or not set(self.cpu_affinity) <= allowed:
                raise ValueError(f"cpu_affinity {self.cpu_affinity} must be a non-empty subset of the cores "
                                 f"this process may use: {sorted(allowed)}")
        if join_spin is None:
            join_spin = envs.join_spin()
        self.join_spin = DEFAULT_JOIN_SPIN if join_spin is None else join_spin
        if self.join_spin < 0:
            raise ValueError(f"join_spin must be >= 0, got {self.join_spin}")
        self.closed = False
        self._init_state()
        _pools.add(self)

    @property
    def workers(self) -> int:
        return self.threads - 1

    def _init_state(self) -> None:
        self._lock = threading.Lock()  # one region at a time; also guards start and shutdown
        self._workers: list[_Worker] = []
        self._region: _Region | None = None
        self._gen = 0
        self._stopping = False

    def parfor(self, start: int, end: int, body: Body, ctx: Any = None) -> None:
        """Runs body(ctx, i) for i in [start, end) across the pool; returns when all calls are done."""
        if end <= start:
            return
        if worker_id() >= 0:  # inside a region: the executors are busy, run serially right here
            for i in range(start, end):
                body(ctx, i)
            return
        with self._lock:
            if self.closed:
                raise RuntimeError("parfor on a ThreadPool that was shut down")
            if len(self._workers) < self.workers:
                self._start_workers()
            bounds = [(start + lo, start + hi) for lo, hi in chunk_bounds(end - start, self.threads)]
            self._gen += 1
            # Workers with nothing to do are done already and need no wake-up.
            region = _Region(self._gen, body, ctx, bounds, [lo == hi for lo, hi in bounds[:-1]])
            self._region = region  # publish: polling workers see the new gen without any syscall
            for w in self._workers:
                if w.sleeping and not region.done[w.index]:
                    w.wake.set()
            _local.wid = self.threads - 1
            try:
                _run_chunk(region, self.threads - 1)
            finally:
                _local.wid = -1
                self._join(region)
        if region.errors:
            raise region.errors[0]

    def _join(self, region: _Region) -> None:
        done, spins = region.done, self.join_spin
        yield_until = resignal_at = None
        while False in done:
            if spins > 0:  # the workers are about to finish: just look again
                spins -= 1
                continue
            now = time.monotonic()
            if yield_until is None:
                yield_until, resignal_at = now + _JOIN_YIELD_S, now + _RESIGNAL_S
            if now < yield_until:
                os.sched_yield()  # releases the GIL: a finishing worker can take it at once
                continue
            time.sleep(_JOIN_SLEEP_S)
            if now >= resignal_at:  # a lost wake-up would otherwise hang the caller for good
                for w in self._workers:
                    if not done[w.index]:
                        w.wake.set()
                resignal_at = now + _RESIGNAL_S

    def _start_workers(self) -> None:
        """Starts the missing workers and waits until each runs (and is pinned, when asked)."""
        pin_errors: list[OSError] = []
        started = []
        for index in range(len(self._workers), self.workers):
            w = _Worker(index)
            ready = threading.Event()
            w.thread = threading.Thread(target=self._worker_main, args=(w, ready, pin_errors),
                                        name=f"slotserve-tp-{index}", daemon=True)
            w.thread.start()
            started.append(ready)
            self._workers.append(w)
        for ready in started:
            ready.wait()
        if pin_errors:
            self.closed = True
            self._stop_workers()
            raise pin_errors[0]

    def _worker_main(self, w: _Worker, ready: threading.Event, pin_errors: list[OSError]) -> None:
        if self.cpu_affinity is not None:
            try:  # pid 0 means the calling thread on Linux
                os.sched_setaffinity(0, {self.cpu_affinity[w.index % len(self.cpu_affinity)]})
            except OSError as e:
                pin_errors.append(e)
        ready.set()
        seen = self._gen  # regions published before this worker existed are not its business
        torch_ready = False
        while True:
            region = self._next_region(w, seen)
            if region is None:
                return
            seen = region.gen
            if not torch_ready and "torch" in sys.modules:
                # torch copies its thread count into a new thread only on a call like this one; its
                # kernels do not, and would run with the machine's default OpenMP team.
                sys.modules["torch"].get_num_threads()
                torch_ready = True
            _local.wid = w.index
            try:
                _run_chunk(region, w.index)
            finally:
                _local.wid = -1
                region.done[w.index] = True

    def _next_region(self, w: _Worker, seen: int) -> _Region | None:
        """Polls for a region newer than `seen`, then sleeps until woken; None when stopping."""
        poll_until = time.monotonic() + _WORKER_POLL_S
        while True:
            region = self._region
            if self._stopping:
                return None
            if region is not None and region.gen != seen:
                return region
            if time.monotonic() < poll_until:
                os.sched_yield()
                continue
            # Announce the sleep before the last look, so a publisher either sees `sleeping` and sets
            # the event, or published before that look and the look finds the region.
            w.wake.clear()
            w.sleeping = True
            region = self._region
            if not self._stopping and (region is None or region.gen == seen):
                w.wake.wait()
            w.sleeping = False

    def _stop_workers(self, timeout: float = 1.0) -> None:
        self._stopping = True
        for w in self._workers:
            w.wake.set()
        for w in self._workers:
            if w.thread is not None:
                w.thread.join(timeout)
        self._workers = []

    def shutdown(self, timeout: float = 1.0) -> None:
        """Stops the workers, after waiting up to `timeout` s for a running region (TimeoutError);
        later parfor calls raise RuntimeError. Calling it again does nothing."""
        if worker_id() >= 0:
            raise RuntimeError("shutdown() called from inside a parfor body")
        if not self._lock.acquire(timeout=timeout):
            raise TimeoutError(f"a parfor region still runs after {timeout} s")
        try:
            if not self.closed:
                self.closed = True
                self._stop_workers(timeout)
        finally:
            self._lock.release()

    def _after_fork_in_child(self) -> None:
        # The parent's workers do not exist here and its lock may be held by a thread that is gone.
        self._init_state()


def _run_chunk(region: _Region, index: int) -> None:
    lo, hi = region.bounds[index]
    body, ctx = region.body, region.ctx
    try:
        for i in range(lo, hi):
            body(ctx, i)
    except BaseException as e:  # anything, SystemExit included, belongs to the caller
        region.errors.append(e)


_pools: weakref.WeakSet[ThreadPool] = weakref.WeakSet()
_default: ThreadPool | None = None
_default_lock = threading.Lock()


def get_pool() -> ThreadPool:
    """The process-wide pool, created on first use from the environment (`SLOTSERVE_THREADS`);
    a new one replaces it after it was shut down."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = ThreadPool()
        return _default


def configure_pool(threads: int | None = None, cpu_affinity: Sequence[int] | None = None,
                   join_spin: int | None = None) -> ThreadPool:
    """Replaces the process-wide pool with one of these settings (for `--threads`, `--cpu-affinity`)."""
    global _default
    pool = ThreadPool(threads, cpu_affinity, join_spin)
    with _default_lock:
        old, _default = _default, pool
    if old is not None:
        old.shutdown()
    return pool


def parfor(start: int, end: int, body: Body, ctx: Any = None) -> None:
    """`get_pool().parfor(...)`."""
    get_pool().parfor(start, end, body, ctx)


def _shutdown_all() -> None:
    for pool in list(_pools):
        with contextlib.suppress(TimeoutError):  # a region running in a daemon thread: leave it be
            pool.shutdown()


def _after_fork_in_child() -> None:
    global _default_lock
    _default_lock = threading.Lock()
    _local.wid = -1  # fork may have been called from inside a body
    for pool in list(_pools):
        pool._after_fork_in_child()


atexit.register(_shutdown_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

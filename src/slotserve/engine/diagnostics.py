"""Seeing inside a running engine (the diagnosis of a stalled core loop, built in): each thread's current
stack and CPU share, the recent steps and where their time went, and a watchdog that reports a core loop that
stopped stepping while it had work.

Everything here is read from the outside of the thread it describes (`sys._current_frames`, /proc), so a snapshot
can be taken while the core loop is stuck: that is when it matters.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass

# Innermost frames kept per thread: enough to tell the forward pass from the scheduler from a queue wait.
STACK_DEPTH = 12
RECENT_STEPS = 64
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)  # vLLM's iteration_tokens_total
PHASES = ("step", "schedule", "model", "sample")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class StepRecord:
    """One step of the core loop: when it ended, how long it took and in which part, and how big it was."""

    ended: float  # time.time()
    seconds: float
    schedule_seconds: float
    model_seconds: float
    sample_seconds: float
    sequences: int
    tokens: int


class Histogram:
    """Cumulative counts per upper bound, as Prometheus exposes them, kept where the observations happen."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds, self.counts, self.count, self.sum = bounds, [0] * len(bounds), 0, 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1

    def as_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "count": self.count, "sum": self.sum}


class StepLog:
    """The last steps and every step's times and tokens as histograms, appended by the core loop, read by any
    thread."""

    def __init__(self) -> None:
        self.steps: deque[StepRecord] = deque(maxlen=RECENT_STEPS)
        self.last_end = time.monotonic()  # of the last step, or of the start
        self.seconds = {phase: Histogram(STEP_BUCKETS) for phase in PHASES}
        self.tokens = Histogram(TOKEN_BUCKETS)

    def add(self, record: StepRecord) -> None:
        self.steps.append(record)
        self.last_end = time.monotonic()
        for phase, value in zip(PHASES, (record.seconds, record.schedule_seconds, record.model_seconds,
                                         record.sample_seconds), strict=True):
            self.seconds[phase].observe(value)
        self.tokens.observe(record.tokens)

    def histograms(self) -> dict:
        return {"seconds": {phase: h.as_dict() for phase, h in self.seconds.items()}, "tokens": self.tokens.as_dict()}

    def woke(self) -> None:
        """The core loop got work after waiting for it: the wait was idle time, not a stall."""
        self.last_end = time.monotonic()

    def recent(self) -> list[dict]:
        return [asdict(s) for s in list(self.steps)]


def _thread_cpu_seconds(native_id: int) -> float | None:
    """User plus system CPU time of one thread of this process (Linux); None where it cannot be read."""
    try:
        with open(f"/proc/self/task/{native_id}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return None


class ThreadSampler:
    """Each thread's CPU share since the previous sample (`sample` is called about once a second)."""

    def __init__(self) -> None:
        self._previous: dict[int, tuple[float, float]] = {}
        self.shares: dict[int, float] = {}

    def sample(self) -> None:
        now = time.monotonic()
        current = {}
        for thread in threading.enumerate():
            if thread.native_id is None or (cpu := _thread_cpu_seconds(thread.native_id)) is None:
                continue
            current[thread.native_id] = (now, cpu)
            if thread.native_id in self._previous:
                then, before = self._previous[thread.native_id]
                self.shares[thread.native_id] = round((cpu - before) / max(now - then, 1e-6), 3)
        self._previous = current


def threads(sampler: ThreadSampler | None = None) -> list[dict]:
    """Every thread of this process: name, ids, CPU seconds and share, and its innermost frames (last = current)."""
    frames = sys._current_frames()
    out = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident)
        stack = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                 for f in traceback.extract_stack(frame)[-STACK_DEPTH:]] if frame is not None else []
        out.append({"name": thread.name, "native_id": thread.native_id, "daemon": thread.daemon,
                    "alive": thread.is_alive(), "cpu_seconds": _thread_cpu_seconds(thread.native_id or 0),
                    "cpu_share": (sampler.shares.get(thread.native_id) if sampler else None), "stack": stack})
    return out


def report(snapshot: dict) -> str:
    """A snapshot as the watchdog logs it: each thread's stack, then the queues."""
    lines = []
    for t in snapshot["threads"]:
        lines.append(f"thread {t['name']} (tid {t['native_id']}, cpu {t['cpu_share']}):")
        lines += [f"    {frame}" for frame in t["stack"]]
    lines.append(f"queues: {snapshot['queues']}; scheduler: {snapshot['scheduler']}")
    return "\n".join(lines)


@dataclass
class Watchdog:
    """Reports once when the core loop has had work for longer than `limit_s` without finishing a step."""

    limit_s: float
    stalled_since: float | None = None  # time.time() of the stall's start, while it lasts
    reports: int = 0

    def check(self, busy: bool, since_last_step: float) -> bool:
        """True the first time a stall is seen; the stall clears at the next step."""
        if not busy or since_last_step <= self.limit_s:
            self.stalled_since = None
            return False
        if self.stalled_since is not None:
            return False
        self.stalled_since = time.time() - since_last_step
        self.reports += 1
        return True

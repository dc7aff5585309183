"""Spans of compute and communication on one rank, for the micro-batch overlap's benchmark and its Chrome trace.

Off unless a benchmark switches it on (`record`, or `SLOTSERVE_TIMELINE` naming a file for a worker rank): the
recording points then cost a clock read and an append each.
"""

from __future__ import annotations

import enum
import json
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from slotserve import envs


class SpanKind(enum.Enum):
    COMPUTE = "compute"  # a thread computing: a micro-batch holding the turn, or a whole step without overlap
    COMMUNICATION = "communication"  # a collective, from its start until its data arrived
    STEP = "step"  # one forward pass, end to end


@dataclass(frozen=True)
class Span:
    lane: str  # "ubatch-0", ..., or "step" (the caller's thread)
    kind: SpanKind
    name: str
    start: float  # time.monotonic() seconds: the same clock in every process of a host
    end: float


class Timeline:
    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()

    def add(self, lane: str, kind: SpanKind, name: str, start: float, end: float | None = None) -> None:
        span = Span(lane, kind, name, start, time.monotonic() if end is None else end)
        with self._lock:
            self.spans.append(span)

    def take(self) -> list[Span]:
        """The spans so far, forgetting them."""
        with self._lock:
            spans, self.spans = self.spans, []
        return spans

    def save(self, path: Path) -> None:
        path.write_text(json.dumps([{**asdict(s), "kind": s.kind.value} for s in self.spans]))


def load_spans(path: Path) -> list[Span]:
    return [Span(d["lane"], SpanKind(d["kind"]), d["name"], d["start"], d["end"]) for d in json.loads(path.read_text())]


_active: Timeline | None = None


def active() -> Timeline | None:
    """The timeline being recorded in this process, if any."""
    return _active


def record(timeline: Timeline | None) -> None:
    """Starts recording into `timeline` (None: stops)."""
    global _active
    _active = timeline


def record_from_env(rank: int) -> Path | None:
    """A worker rank: records when SLOTSERVE_TIMELINE says so; the path to save to at its end."""
    base = envs.timeline()
    if not base:
        return None
    record(Timeline())
    return Path(f"{base}.rank{rank}")


def hidden_seconds(spans: list[Span]) -> tuple[float, float]:
    """Of the communication spans of micro-batches: their total time, and how much of it another micro-batch
    of the same rank computed through (the time their overlap hid)."""
    compute: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        if s.kind is SpanKind.COMPUTE:
            compute.setdefault(s.lane, []).append((s.start, s.end))
    total = hidden = 0.0
    for s in spans:
        if s.kind is not SpanKind.COMMUNICATION or not s.lane.startswith("ubatch"):
            continue
        total += s.end - s.start
        others = sorted(iv for lane, ivs in compute.items() if lane != s.lane for iv in ivs)
        hidden += _covered(s.start, s.end, others)
    return total, hidden


def _covered(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """How much of [start, end] the sorted intervals cover (they never overlap: one thread computes at a time)."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals)


def chrome_trace(spans_by_rank: dict[int, list[Span]]) -> dict:
    """Chrome's trace-event format (chrome://tracing, Perfetto): a process per rank, a thread per lane."""
    events = []
    lanes = sorted({s.lane for spans in spans_by_rank.values() for s in spans})
    tid = {lane: i for i, lane in enumerate(lanes)}
    origin = min((s.start for spans in spans_by_rank.values() for s in spans), default=0.0)
    for rank, spans in spans_by_rank.items():
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for lane in lanes:
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid[lane], "args": {"name": lane}})
        for s in spans:
            events.append({"ph": "X", "name": s.name, "cat": s.kind.value, "pid": rank, "tid": tid[s.lane],
                           "ts": (s.start - origin) * 1e6, "dur": (s.end - s.start) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}

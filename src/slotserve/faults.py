"""Failure injection for tests: `SLOTSERVE_FAULT=<point>:<n>` makes the nth pass through <point> raise.

Each thread of the engine and the front end's event receiver has one point, so a test can kill each in
turn and check that the engine ends cleanly instead of wedging. Unset, a check costs one dict lookup.
"""

from __future__ import annotations

import enum

from slotserve import envs
from slotserve.envs import FAULT_ENV

STALL_SECONDS = 6.0


class FaultPoint(enum.Enum):
    CORE_STEP = "core-step"  # EngineCoreLoop, before each engine step
    OUTPUT = "output"  # OutputProcessor, before each batch of outputs
    IPC = "ipc"  # IPCLoop, before each command it routes
    FRONTEND_EVENTS = "frontend-events"  # the front end's receiver, before each event
    WORKER_STEP = "worker-step"  # a worker rank (tensor parallel), before each step: it raises
    WORKER_HANG = "worker-hang"  # a worker rank, before each step: it stops answering
    UBATCH_RAISE = "ubatch-raise"  # a micro-batch, at each collective it waits on: it raises, the collective in flight
    UBATCH_STALL = "ubatch-stall"  # a micro-batch thread, before the barrier: it never arrives (until the step fails)
    CORE_STALL = "core-stall"  # EngineCoreLoop, before each engine step: it sleeps STALL_SECONDS (a stuck step)
    KV_WRITE = "kv-write"  # the KV disk writer, before each block it stores: it raises
    # The KV disk writer, before each block it stores: it writes half the block's temporary file and sleeps
    # STALL_SECONDS, so a test can kill the process in the middle of a write.
    KV_WRITE_STALL = "kv-write-stall"


class InjectedFault(RuntimeError):
    pass


_passes: dict[FaultPoint, int] = {}


def fault_spec(point: FaultPoint, at: int) -> dict[str, str]:
    """The environment that makes the `at`th pass through `point` fail."""
    return {FAULT_ENV: f"{point.value}:{at}"}


def fires(point: FaultPoint) -> bool:
    """Counts a pass through `point`; whether it is the one that fails."""
    spec = envs.fault()
    if not spec:
        return False
    name, _, at = spec.partition(":")
    if name != point.value:
        return False
    _passes[point] = _passes.get(point, 0) + 1
    return _passes[point] == int(at)


def check(point: FaultPoint) -> None:
    """Raises on the pass through `point` that fails."""
    if fires(point):
        raise InjectedFault(f"{FAULT_ENV}: pass {_passes[point]} through {point.value} fails on purpose")

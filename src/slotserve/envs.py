"""Every `SLOTSERVE_*` environment variable the engine reads: its name, its default and what it does. Each is
read when asked for, not at import, so that a test or a benchmark that sets one before starting an engine (or
its worker processes, which inherit it) is heard."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SLOTSERVE_CACHE"  # models, converted checkpoints and built kernels; default ~/.cache/slotserve
HUGE_PAGES_ENV = "SLOTSERVE_HUGE_PAGES"  # 0: no transparent huge pages for weights and the KV cache
NATIVE_KERNELS_ENV = "SLOTSERVE_NATIVE_KERNELS"  # 0: no C kernels, torch alone
AMX_ENV = "SLOTSERVE_AMX"  # 0: packed linears do not use AMX where the CPU has it
PACK_WEIGHTS_ENV = "SLOTSERVE_PACK_WEIGHTS"  # 0: a float32 checkpoint's linears keep their float32 weights
THREADS_ENV = "SLOTSERVE_THREADS"  # CPU threads per rank, where --threads is not given
JOIN_SPIN_ENV = "SLOTSERVE_TP_JOIN_SPIN"  # spin rounds of the thread pool's join before it yields
LOG_LEVEL_ENV = "SLOTSERVE_LOG_LEVEL"  # a worker rank's log level (the driver passes its own)
API_KEY_ENV = "SLOTSERVE_API_KEY"  # the server's key, where --api-key is not given
FAULT_ENV = "SLOTSERVE_FAULT"  # tests: <point>:<n> fails the nth pass through a fault point (faults.py)
TIMELINE_ENV = "SLOTSERVE_TIMELINE"  # benchmarks: a worker rank records its spans to this path + ".rank<r>"
LATENCY_ENV = "SLOTSERVE_COLLECTIVE_LATENCY_MS"  # benchmarks: a floor on every collective's time (a slower link)


def cache_dir() -> Path:
    """`$SLOTSERVE_CACHE`, else ~/.cache/slotserve."""
    value = os.environ.get(CACHE_ENV)
    return Path(value).expanduser() if value else Path.home() / ".cache" / "slotserve"


def _on(name: str) -> bool:
    """A switch that is on unless set to 0."""
    return os.environ.get(name, "1") != "0"


def huge_pages() -> bool:
    return _on(HUGE_PAGES_ENV)


def native_kernels() -> bool:
    return _on(NATIVE_KERNELS_ENV)


def amx() -> bool:
    return _on(AMX_ENV)


def pack_weights() -> bool:
    return _on(PACK_WEIGHTS_ENV)


def _int(name: str, minimum: int) -> int | None:
    """ValueError naming the variable where it is set to something other than an integer >= minimum."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {text!r}")
    return value


def threads() -> int | None:
    return _int(THREADS_ENV, 1)


def join_spin() -> int | None:
    return _int(JOIN_SPIN_ENV, 0)


def log_level() -> str:
    return os.environ.get(LOG_LEVEL_ENV, "INFO")


def api_key() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def fault() -> str | None:
    return os.environ.get(FAULT_ENV) or None


def timeline() -> str | None:
    return os.environ.get(TIMELINE_ENV) or None


def collective_latency_s() -> float:
    return float(os.environ.get(LATENCY_ENV) or 0) / 1e3


def passed_to_ranks() -> dict[str, str]:
    """The variables a worker rank on another machine needs: every SLOTSERVE_* one but the server's key."""
    return {k: v for k, v in os.environ.items() if k.startswith("SLOTSERVE_") and k != API_KEY_ENV}

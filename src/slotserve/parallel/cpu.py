"""How the engine shares the CPU between torch and the parfor pool.

One setting (`--threads` / `SLOTSERVE_THREADS`, `--cpu-affinity`) sizes both. They take turns and
never run at once: torch runs the large GEMMs on all its intra-op threads, and the pool runs per-item
work (the experts of a MoE layer in prefill, dequantizing GGUF tensors) with torch on one thread in
every executor (`torch_parfor`). So each phase uses the cores once, and neither oversubscribes them.
Decode attention stays off the pool: torch's OpenMP threads keep spinning on the cores for a while after
each GEMM, and pool threads beside them slow the step.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slotserve.parallel.threadpool import Body, ThreadPool, configure_pool, default_threads, get_pool


@dataclass(frozen=True)
class CpuSettings:
    """What `apply_cpu_settings` put in place."""

    threads: int  # torch intra-op threads, and the pool's executors (workers + the caller)
    cpu_affinity: tuple[int, ...] | None  # the cores the process was restricted to; workers pinned one each


def restrict_process(cpus: Sequence[int]) -> None:
    """Lets every thread of this process (those that exist now and, by inheritance, later ones) run only
    on `cpus`; also widens it again. Linux only: the affinity call works per thread, so every task of the
    process is set."""
    if not hasattr(os, "sched_setaffinity"):
        raise NotImplementedError("cpu_affinity needs os.sched_setaffinity (Linux)")
    if not cpus:
        raise ValueError("cpu_affinity: needs at least one core")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), set(cpus))
        except ProcessLookupError:  # a thread that exited meanwhile
            continue
        except OSError as e:  # EINVAL: none of the cores may be used here (cgroup cpuset, offline)
            raise ValueError(f"cpu_affinity: cannot run on cores {list(cpus)} ({e.strerror})") from None


def apply_cpu_settings(threads: int | None = None, cpu_affinity: Sequence[int] | None = None) -> CpuSettings:
    """Sizes torch and the process-wide pool for the engine. threads: default the cores in
    `cpu_affinity` when given, else `SLOTSERVE_THREADS`, else the cores this process may use."""
    if threads is not None and threads < 1:
        raise ValueError(f"threads: must be >= 1, got {threads}")
    cpus = tuple(cpu_affinity) if cpu_affinity else None
    if cpus is not None:
        restrict_process(cpus)
    count = threads or (len(cpus) if cpus else default_threads())
    pool = get_pool()
    if pool.threads != count or pool.cpu_affinity != (list(cpus) if cpus else None):
        configure_pool(count, cpus)
    torch.set_num_threads(count)
    return CpuSettings(count, cpus)


def torch_parfor(start: int, end: int, body: Body, ctx: Any = None, pool: ThreadPool | None = None) -> None:
    """`parfor` for bodies made of torch ops: each executor runs them on one torch thread (the pool is
    the parallelism) and in the caller's inference/grad mode; the caller's torch thread count is restored
    afterwards. With a one-thread pool the items simply run in order here, on torch's usual threads."""
    pool = pool or get_pool()
    if pool.threads == 1 or end - start < 2:
        for i in range(start, end):
            body(ctx, i)
        return
    saved = torch.get_num_threads()
    # Autograd's modes are per thread: the workers must run the bodies as the caller would.
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def single_threaded(c: Any, i: int) -> None:
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            body(c, i)

    torch.set_num_threads(1)
    try:
        pool.parfor(start, end, single_threaded, ctx)
    finally:
        torch.set_num_threads(saved)


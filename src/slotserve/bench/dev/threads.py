"""`python -m slotserve.bench.dev threads`: what the parfor pool costs and what it buys on this machine.

- dispatch: microseconds per empty region (one no-op item per executor), the pool against
  `concurrent.futures.ThreadPoolExecutor` (submit nthreads tasks, wait for all), per thread count.
- matmul: a GIL-releasing workload (one fp32 matmul per item, torch single-threaded in every
  executor) on 1..N pool threads, with and without pinning the workers, beside torch's own intra-op
  threading on the same matmuls in one thread.
- engine: the engine's decode step (batch 1, and a batch of sequences) with 1..N threads for torch and
  the pool (`--threads`), with and without `--cpu-affinity`: the data behind the defaults.

This module imports torch only when it runs, so the CLI can build its parser without it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
from collections.abc import Callable
from typing import Any

from slotserve.bench.timing import median_seconds
from slotserve.parallel.threadpool import (
    ThreadPool,
    available_cores,
    configure_torch_threads,
    parse_cpu_list,
)


def _thread_counts(text: str) -> list[int]:
    counts = parse_cpu_list(text)  # same syntax: "1,2,4" or "1-4"
    if min(counts) < 1:
        raise ValueError(f"thread counts must be >= 1: {text!r}")
    return counts


def _default_counts(cores: int) -> list[int]:
    """1, 2, 4, ... below the core count, then the core count itself."""
    counts = [1 << k for k in range(cores.bit_length()) if 1 << k < cores]
    return [*counts, cores]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=_thread_counts, default=None,
                        help="pool thread counts to measure, e.g. 1,2,4 or 1-4 (default: powers of two up to "
                             "the cores this process may use, and that count)")
    parser.add_argument("--cpu-affinity", type=parse_cpu_list, default=None,
                        help="cores the workers are pinned to in the pinned runs, e.g. 0-3 "
                             "(default: the cores this process may use)")
    parser.add_argument("--regions", type=int, default=3000, help="empty regions timed per dispatch figure")
    parser.add_argument("--matmul-size", type=int, default=256, help="n of each n x n fp32 matmul")
    parser.add_argument("--items", type=int, default=64, help="matmuls in each region of the workload")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of each figure; the median is reported")
    parser.add_argument("--engine-batch", type=int, default=32, help="sequences in the engine's batched decode step")
    parser.add_argument("--engine-context", type=int, default=256, help="history tokens of each of those sequences")
    parser.add_argument("--no-engine", action="store_true", help="skip the engine figures (no model is loaded)")


def _noop(*_args: Any) -> None:
    return None


def _dispatch(threads: int, regions: int, repeats: int) -> dict[str, Any]:
    pool = ThreadPool(threads)
    batch = max(1, regions // repeats)

    def pool_regions() -> None:
        for _ in range(batch):
            pool.parfor(0, threads, _noop)

    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as executor:
        def executor_regions() -> None:
            for _ in range(batch):
                concurrent.futures.wait([executor.submit(_noop) for _ in range(threads)])

        pool_s = median_seconds(pool_regions, repeats) / batch
        executor_s = median_seconds(executor_regions, repeats) / batch
    pool.shutdown()
    return {"threads": threads, "join_spin": pool.join_spin, "pool_us": round(pool_s * 1e6, 2),
            "executor_us": round(executor_s * 1e6, 2), "executor_over_pool": round(executor_s / pool_s, 2)}


def _matmul(args: argparse.Namespace, counts: list[int], cpus: list[int] | None) -> dict[str, Any]:
    import torch

    n, items = args.matmul_size, args.items
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(items, n, n, generator=gen), torch.randn(items, n, n, generator=gen)
    out = torch.empty(items, n, n)
    gflop = 2 * n**3 * items / 1e9

    def body(_ctx: Any, i: int) -> None:
        torch.mm(a[i], b[i], out=out[i])

    rows = []
    for threads in counts:
        for pinned in (False, True) if cpus is not None and threads > 1 else (False,):
            pool = ThreadPool(threads, cpu_affinity=cpus if pinned else None)
            configure_torch_threads(pool, count=1)
            seconds = median_seconds(lambda pool=pool: pool.parfor(0, items, body), args.repeats)
            pool.shutdown()
            rows.append({"threads": threads, "pinned": pinned, "ms": round(seconds * 1e3, 2),
                         "gflops": round(gflop / seconds, 1)})
    torch_rows = []
    for threads in counts:
        torch.set_num_threads(threads)
        seconds = median_seconds(lambda: [body(None, i) for i in range(items)], args.repeats)
        torch_rows.append({"torch_threads": threads, "ms": round(seconds * 1e3, 2),
                           "gflops": round(gflop / seconds, 1)})
    best = min(rows, key=lambda r: r["ms"])
    return {"workload": f"{items} fp32 matmuls of {n}x{n} per region ({gflop:.2f} GFLOP)",
            "pool": rows, "torch_intra_op": torch_rows,
            "fastest_pool": {"threads": best["threads"], "pinned": best["pinned"]}}


def _engine(make_engine: Callable[[], Any], args: argparse.Namespace, counts: list[int],
            cpus: list[int] | None) -> dict[str, Any]:
    from slotserve.bench.dev.kernels import decode_step
    from slotserve.parallel.cpu import apply_cpu_settings, restrict_process

    engine = make_engine()
    all_cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    one, release_one = decode_step(engine, 1, args.engine_context)
    batched, release_batched = decode_step(engine, args.engine_batch, args.engine_context, seed=1)
    rows = []
    try:
        for threads in counts:
            for pinned in (False, True) if cpus is not None and threads <= len(cpus) else (False,):
                apply_cpu_settings(threads, cpus[:threads] if pinned else None)
                rows.append({"threads": threads, "pinned": pinned,
                             "batch1_ms": round(median_seconds(one, args.repeats) * 1e3, 1),
                             f"batch{args.engine_batch}_ms": round(median_seconds(batched, args.repeats) * 1e3, 1)})
                if pinned and all_cores is not None:
                    restrict_process(all_cores)
    finally:
        release_one()
        release_batched()
        apply_cpu_settings()
    key = f"batch{args.engine_batch}_ms"
    best = min(rows, key=lambda r: r[key])
    return {"model": engine.config.model, "context": args.engine_context, "steps": rows,
            f"fastest_batch{args.engine_batch}": {k: best[k] for k in ("threads", "pinned")}}


def run_threads(args: argparse.Namespace, make_engine: Callable[[], Any] | None = None) -> dict[str, Any]:
    import torch

    cores = available_cores()
    counts = args.threads or _default_counts(cores)
    cpus = args.cpu_affinity
    if cpus is None and hasattr(os, "sched_setaffinity"):  # pinning is Linux-only: no pinned runs elsewhere
        cpus = sorted(os.sched_getaffinity(0))
    torch_threads = torch.get_num_threads()
    try:
        dispatch = [_dispatch(t, args.regions, args.repeats) for t in counts]
        matmul = _matmul(args, counts, cpus)
        engine = _engine(make_engine, args, counts, cpus) if make_engine and not args.no_engine else None
    finally:
        torch.set_num_threads(torch_threads)
    return {
        "bench": "threads",
        "cores": cores,
        "python": sys.version.split()[0],
        # Other processes on the cores skew every figure here, torch's OpenMP teams the most.
        "load_average_1m": round(os.getloadavg()[0], 2),
        "dispatch": dispatch,
        "matmul": matmul,
        "engine": engine,
    }

"""`slotserve bench replicas`: one server against N data-parallel replicas on the same cores, under the same
streamed load (`bench serve`'s), in alternating rounds; output tokens/s of each and their ratio.

Each round starts `slotserve serve` on a free port, pinned to `--cpu-affinity` (default: every core this process
may use), with `--data-parallel-size` 1 and then N, so both configurations get the same cores and the same
moments of a shared machine in turn. The prompts are new to each server (a different seed per round)."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from typing import Any

from slotserve.bench.serve import run_load
from slotserve.bench.server_process import ServerProcess
from slotserve.parallel.threadpool import parse_cpu_list


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default="qwen2.5-coder-0.5b")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=2, help="replicas of the second configuration")
    p.add_argument("--cpu-affinity", default=None, help="the cores both configurations run on (default: all)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of each configuration, alternating")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--kv-cache-memory", default="512M", help="each replica's")
    p.add_argument("--start-timeout", type=float, default=600.0)


def _round(args: argparse.Namespace, cores: str, replicas: int, seed: int) -> dict[str, Any]:
    server = ServerProcess(args.model, "--cpu-affinity", cores, "--data-parallel-size", str(replicas),
                           "--kv-cache-memory", args.kv_cache_memory, start_timeout=args.start_timeout)
    try:
        load = argparse.Namespace(
            base_url=server.url, model=None, api_key=None, num_prompts=args.num_prompts, input_len=args.input_len,
            output_len=args.output_len, max_concurrency=args.max_concurrency, request_rate=float("inf"),
            seed=seed, duration=None, cancel_fraction=0.0, poll_debug=None, settle_timeout=30.0)
        result = asyncio.run(run_load(load))
    finally:
        server.stop()
    return {"replicas": replicas, "completed": result["completed"], "failed": result["failed"],
            "output_tokens_per_s": result["output_tokens_per_s"], "ttft_ms_median": result["ttft_ms"]["median"],
            "tpot_ms_median": result["tpot_ms"]["median"]}


def run_replicas(args: argparse.Namespace) -> dict[str, Any]:
    cores = args.cpu_affinity or ",".join(map(str, sorted(os.sched_getaffinity(0))))
    parse_cpu_list(cores)  # a bad list fails here, not in the first server
    rounds = []
    for r in range(args.rounds):
        for replicas in (1, args.data_parallel_size):
            rounds.append(_round(args, cores, replicas, seed=1000 * r + replicas))
    # Each round's two runs are minutes apart: their ratio, and the median of those, is what the noise spares.
    ratios = [b["output_tokens_per_s"] / a["output_tokens_per_s"] for a, b in zip(rounds[::2], rounds[1::2],
                                                                                  strict=True)
              if a["output_tokens_per_s"]]
    return {"bench": "replicas", "model": args.model, "cores": cores, "data_parallel_size": args.data_parallel_size,
            "max_concurrency": args.max_concurrency, "input_len": args.input_len, "output_len": args.output_len,
            "rounds": rounds, "ratios": [round(r, 3) for r in ratios],
            "ratio": round(statistics.median(ratios), 3) if ratios else None}

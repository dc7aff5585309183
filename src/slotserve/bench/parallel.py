"""`slotserve bench parallel`: the same steps on one rank and on N (tensor parallel), in one run: step times,
the driver's time in collectives, and each rank's resident memory."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import psutil

from slotserve.engine.model_runner import ScheduledSeq, Want


def _step_ms(engine: Any, seqs: list[ScheduledSeq], repeats: int) -> tuple[float, float]:
    """Median milliseconds of a step, and of the driver's collectives in it."""
    clock = engine.core.worker.parallel.group.clock
    steps, waits = [], []
    for _ in range(repeats + 1):  # the first warms up
        before = clock.seconds
        start = time.perf_counter()
        engine.core.execute(seqs)
        steps.append(time.perf_counter() - start)
        waits.append(clock.seconds - before)
    return round(1000 * statistics.median(steps[1:]), 2), round(1000 * statistics.median(waits[1:]), 2)


def _resident_gib(engine: Any) -> list[float]:
    """Each rank's resident memory: this process, then its workers."""
    procs = [psutil.Process()]
    if engine.core.workers is not None:
        procs += [psutil.Process(p.pid) for p in getattr(engine.core.workers, "processes", {}).values()]
    return [round(p.memory_info().rss / 2**30, 2) for p in procs]


def _measure(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    block, blocks = engine.core.config.block_size, engine.kv.pool.num_blocks
    per_seq = -(-(args.input_len + 1) // block)
    prompt = [rng.randrange(1000, 50_000) for _ in range(args.input_len)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(min(args.batch, blocks // per_seq))]
    for table in tables:  # a context of input_len tokens for each decode row
        engine.core.execute([ScheduledSeq(prompt, 0, table, want=Want.NONE)])
    prefill_ms, prefill_wait = _step_ms(engine, [ScheduledSeq(prompt, 0, tables[0], want=Want.LAST)], args.repeats)
    figures = {"prefill_ms": prefill_ms, "prefill_collectives_ms": prefill_wait}
    for batch in sorted({1, len(tables)}):
        decode = [ScheduledSeq([prompt[0]], args.input_len, t, want=Want.GREEDY) for t in tables[:batch]]
        figures[f"decode_b{batch}_ms"], figures[f"decode_b{batch}_collectives_ms"] = _step_ms(engine, decode,
                                                                                              args.repeats)
    figures["resident_gib_per_rank"] = _resident_gib(engine)
    return figures


def run_parallel(make_llm: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> dict[str, Any]:
    ranks = max(args.tensor_parallel_size, 2)
    runs = {}
    for tp in (1, ranks):
        llm = make_llm(argparse.Namespace(**{**vars(args), "tensor_parallel_size": tp}))
        try:
            runs[tp] = _measure(llm.engine, args)
        finally:
            llm.shutdown()
    one, many = runs[1], runs[ranks]
    ratios = {f"{key}_tp{ranks}_over_tp1": round(many[key] / one[key], 3) for key in one
              if key.endswith("ms") and not key.endswith("collectives_ms") and one[key]}
    return {"bench": "parallel", "model": args.model, "input_len": args.input_len, "batch": args.batch,
            "tp1": one, f"tp{ranks}": many, **ratios}

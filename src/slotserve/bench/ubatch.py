"""`slotserve bench ubatch`: micro-batch overlap measured. The same prefill and decode steps (of the default
thresholds' sizes: 512 prompt tokens, 32 decode rows) with and without
overlap, alternating, their communication, and the share of it another micro-batch computed through
(`overlap_fraction`), per rank; once over the collectives as they are (`real`) and once with a latency added to
each (`injected_latency`, a slower link), in one run; and a Chrome trace of both (chrome://tracing, Perfetto)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from slotserve.engine.model_runner import ScheduledSeq, Want
from slotserve.envs import LATENCY_ENV, TIMELINE_ENV
from slotserve.parallel import timeline
from slotserve.parallel.timeline import Span, SpanKind, Timeline

Window = tuple[float, float]


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    """These variables set (None: unset) while the engine starts: its workers inherit them."""
    saved = {k: os.environ.get(k) for k in values}
    _set(values)
    try:
        yield
    finally:
        _set(saved)


def _set(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _steps(engine: Any, args: argparse.Namespace) -> dict[str, list[ScheduledSeq]]:
    """A prefill of `prefill_batch` prompts of input_len tokens, and a decode step of `decode_batch` rows, each
    over a context of `decode_context` tokens (prefilled first, a few sequences a step)."""
    rng = random.Random(0)
    block = engine.core.config.block_size
    longest = max(args.input_len, args.decode_context) + 1
    per_seq = -(-longest // block)
    count = max(args.prefill_batch, args.decode_batch)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(count)]
    prompts = [[rng.randrange(1000, 50_000) for _ in range(args.input_len)] for _ in range(args.prefill_batch)]
    contexts = [[rng.randrange(1000, 50_000) for _ in range(args.decode_context)] for _ in range(args.decode_batch)]
    for first in range(0, len(contexts), 8):
        engine.core.execute([ScheduledSeq(c, 0, t, want=Want.NONE)
                             for c, t in zip(contexts[first:first + 8], tables[first:first + 8], strict=True)])
    return {"prefill": [ScheduledSeq(p, 0, t, want=Want.LAST) for p, t in zip(prompts, tables, strict=False)],
            "decode": [ScheduledSeq([c[0]], args.decode_context, t, want=Want.GREEDY)
                       for c, t in zip(contexts, tables, strict=False)]}


def _time_steps(engine: Any, seqs: list[ScheduledSeq], kind: str, repeats: int,
                driver: Timeline) -> dict[bool, list[Window]]:
    """Each step's window, with overlap (True) and without, alternating so that drift meets both; one warm-up."""
    runner, windows = engine.core.runner, {False: [], True: []}
    for i in range(repeats + 1):
        for overlap in (False, True):
            runner.overlap = overlap
            start = time.monotonic()
            engine.core.execute(seqs)
            end = time.monotonic()
            driver.add("step", SpanKind.STEP, f"{kind}, {'overlap' if overlap else 'no overlap'}", start, end)
            if i:
                windows[overlap].append((start, end))
    runner.overlap = True
    return windows


def _within(spans: list[Span], windows: list[Window]) -> list[Span]:
    return [s for s in spans if any(a <= s.start and s.end <= b + 1e-3 for a, b in windows)]


def _communication_ms(spans: list[Span], windows: list[Window]) -> float:
    comm = [s for s in _within(spans, windows) if s.kind is SpanKind.COMMUNICATION]
    return round(1000 * sum(s.end - s.start for s in comm) / len(windows), 3)


def _figures(windows: dict[bool, list[Window]], ranks: dict[int, list[Span]]) -> dict[str, Any]:
    median_ms = {o: 1000 * statistics.median(b - a for a, b in w) for o, w in windows.items()}
    fractions = []
    for spans in ranks.values():
        total, hidden = timeline.hidden_seconds(_within(spans, windows[True]))
        fractions.append(round(hidden / total, 3) if total else 0.0)
    return {
        "step_ms_no_overlap": round(median_ms[False], 2), "step_ms_overlap": round(median_ms[True], 2),
        "speedup": round(median_ms[False] / median_ms[True], 3),
        "communication_ms_no_overlap": _communication_ms(ranks[0], windows[False]),
        "communication_ms": _communication_ms(ranks[0], windows[True]),
        "overlap_fraction": fractions[0], "overlap_fraction_per_rank": fractions,
    }


def _section(make_llm: Callable[[argparse.Namespace], Any], args: argparse.Namespace, latency_ms: float,
             trace: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "timeline"
        env = {TIMELINE_ENV: str(base), LATENCY_ENV: str(latency_ms) if latency_ms else None}
        with _environment(env):
            llm = make_llm(args)
        driver = Timeline()
        timeline.record(driver)
        try:
            steps = _steps(llm.engine, args)
            windows = {kind: _time_steps(llm.engine, seqs, kind, args.repeats, driver) for kind, seqs in steps.items()}
        finally:
            timeline.record(None)
            llm.shutdown()
        ranks = {0: driver.spans, **{r: timeline.load_spans(Path(f"{base}.rank{r}"))
                                      for r in range(1, args.tensor_parallel_size)}}
    trace.write_text(json.dumps(timeline.chrome_trace(ranks)))
    return {"latency_ms": latency_ms, "trace": str(trace),
            **{kind: _figures(w, ranks) for kind, w in windows.items()}}


def run_ubatch(make_llm: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> dict[str, Any]:
    # At least two ranks and two micro-batches, with thresholds the measured steps reach.
    tokens = {"prefill": args.prefill_batch * args.input_len, "decode": args.decode_batch}
    args = argparse.Namespace(**{
        **vars(args), "tensor_parallel_size": max(args.tensor_parallel_size, 2), "ubatches": max(args.ubatches, 2),
        "ubatch_prefill_threshold": min(args.ubatch_prefill_threshold, tokens["prefill"]),
        "ubatch_decode_threshold": min(args.ubatch_decode_threshold, tokens["decode"]),
        "ubatch_adaptive": False})  # the bench chooses the way of each step itself
    trace = Path(args.trace)
    injected = trace.with_name(f"{trace.stem}-injected{trace.suffix}")
    return {
        "bench": "ubatch", "model": args.model, "tensor_parallel_size": args.tensor_parallel_size,
        "ubatches": args.ubatches, "expert_parallel": args.enable_expert_parallel, "input_len": args.input_len,
        "decode_context": args.decode_context, "tokens": tokens,
        "thresholds": {"prefill": args.ubatch_prefill_threshold, "decode": args.ubatch_decode_threshold},
        "real": _section(make_llm, args, 0.0, trace),
        "injected_latency": _section(make_llm, args, args.latency_ms, injected),
    }

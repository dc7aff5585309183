"""`slotserve bench structured`: what constrained decoding costs: the decode step of a batch with none, one and
all of its requests under a JSON schema, the grammar masks' own time per step at batch 1 and at the full batch,
and how long a new schema takes to compile."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from slotserve.engine.llm_engine import LLMEngine
from slotserve.sampling_params import SamplingParams, StructuredOutputsParams
from slotserve.structured_outputs import Grammar, mask_

# A schema whose outputs can run long (a free string), so no constrained request finishes inside the timed steps.
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
          "required": ["title", "year"], "additionalProperties": False}


def run_structured(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    compile_s = _compile_seconds(engine, args.schemas)
    _decode_step_ms(engine, args, 0, rng)  # warm-up: the first decode steps of a fresh engine run slower
    steps = {}
    for constrained in sorted({0, 1, args.batch}):
        steps[constrained] = _decode_step_ms(engine, args, constrained, rng)
    mask = {rows: _mask_ms(engine, rows, args.repeats) for rows in sorted({1, args.batch})}
    return {
        "bench": "structured", "model": engine.config.model, "batch": args.batch,
        "decode_step_ms": {f"{n}_constrained": ms for n, ms in steps.items()},
        "decode_step_ratio_all_constrained": round(steps[args.batch] / steps[0], 3),
        "decode_step_ratio_one_constrained": round(steps[1] / steps[0], 3),
        "mask_ms_per_step": {f"batch_{rows}": ms for rows, ms in mask.items()},
        "schema_compile_ms": compile_s,
    }


def _decode_step_ms(engine: LLMEngine, args: argparse.Namespace, constrained: int, rng: random.Random) -> float:
    """The median decode step of `args.batch` requests, the first `constrained` of them under SCHEMA."""
    free = SamplingParams(temperature=1.0, seed=1, max_tokens=args.steps + 8, ignore_eos=True)
    bound = SamplingParams(temperature=1.0, seed=1, max_tokens=args.steps + 8,
                           structured_outputs=StructuredOutputsParams(json=SCHEMA))
    for i in range(args.batch):
        prompt = [rng.randrange(1000, 100_000) for _ in range(args.input_len)]
        engine.add_request(f"c{constrained}-{i}", prompt, bound if i < constrained else free)
    while len(engine.scheduler.running) < args.batch or any(
            r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running):
        engine.step()  # prefill (and the grammars' compile) first
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_request([f"c{constrained}-{i}" for i in range(args.batch)])
    return round(1000 * statistics.median(times), 2)


def _mask_ms(engine: LLMEngine, rows: int, repeats: int) -> float:
    """One step's masks for `rows` requests at the start of SCHEMA, on logits of the model's width."""
    future = engine.core.grammars.submit(StructuredOutputsParams(json=SCHEMA))
    future.result()
    grammars = [Grammar(future) for _ in range(rows)]
    for g in grammars:
        g.ready()
    logits = torch.randn(rows, engine.core.vocab_size)
    times = []
    for _ in range(max(repeats, 5)):
        start = time.perf_counter()
        mask_(logits, list(range(rows)), grammars)
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 3)


def _compile_seconds(engine: LLMEngine, count: int) -> dict[str, float]:
    """The first compile (which also builds the grammar engine's view of the vocabulary), then the median of
    `count` new schemas (each one a cache miss)."""
    compiler = engine.core.grammars
    start = time.perf_counter()
    compiler.submit(StructuredOutputsParams(json={**SCHEMA, "title": "first"})).result()
    first = time.perf_counter() - start
    times = []
    for i in range(count):
        schema = {**SCHEMA, "properties": {**SCHEMA["properties"], f"field_{i}": {"type": "number"}}}
        start = time.perf_counter()
        compiler.submit(StructuredOutputsParams(json=schema)).result()
        times.append(time.perf_counter() - start)
    return {"first_ms": round(1000 * first, 1), "median_ms": round(1000 * statistics.median(times), 2)}

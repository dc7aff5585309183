"""Checks shared by the tests."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def assert_figures(figures: Mapping[str, Any], *keys: str) -> None:
    """Each key (a dotted path into nested mappings: "fma_peak.GFLOPs") names a finite number > 0 in `figures`.

    What a benchmark's measured times and rates are checked for, and all: how they compare with each other
    (a fraction of a peak under 1, one time under another, a speedup) depends on the CPU and its load, so no
    test asserts it."""
    for key in keys:
        value: Any = figures
        for part in key.split("."):
            assert isinstance(value, Mapping) and part in value, f"{key}: no {part!r} in {value!r}"
            value = value[part]
        assert isinstance(value, int | float) and not isinstance(value, bool), f"{key}: {value!r} is not a number"
        assert math.isfinite(value) and value > 0, f"{key}: {value!r} is not a finite figure > 0"


def run_to_completion(engine: Any, prompts: Sequence[list[int]], params: Any,
                      images: Sequence[Sequence[Any]] | None = None,
                      arrivals: Sequence[int] | None = None) -> dict[str, list[int]]:
    """Adds the prompts (with their `images`, where given) as requests r0, r1, ... to an `LLMEngine` (prompt i at
    step arrivals[i], where given, else all at once), steps it until all finish, checks that every KV block is back
    in the pool; each request's token ids."""
    arrivals = arrivals or [0] * len(prompts)
    done: dict[str, list[int]] = {}
    step = 0
    while len(done) < len(prompts):
        for i, prompt in enumerate(prompts):
            if arrivals[i] == step:
                engine.add_request(f"r{i}", prompt, params, *([images[i]] if images is not None else []))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    engine.kv.pool.check_whole()
    return done


# A grammar (structured outputs' lark) for a Qwen3 answer with reasoning: the think tags as the tokenizer's own
# tokens (<think> 151667, </think> 151668), as the model writes them.
THINKING = ('start: <[151667]> "\\n" /[a-z]{2,8}( [a-z]{2,8}){0,3}/ "\\n" <[151668]> "\\n\\n" '
            '/[a-z]{2,8}( [a-z]{2,8}){0,2}/')

"""`slotserve bench latency`: load time, time to first token, single-request prefill and decode speed."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from slotserve.sampling_params import SamplingParams


def _random_prompt(rng: random.Random, length: int) -> list[int]:
    # Ordinary vocabulary ids only: no special tokens in the middle of a prompt.
    return [rng.randrange(1000, 100_000) for _ in range(length)]


def _timed_request(engine, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """Seconds of the first step (prefill + first token) and of all the later (decode) steps."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    start = time.perf_counter()
    engine.step()
    first = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return first - start, time.perf_counter() - first


def run_latency(make_llm: Callable[[argparse.Namespace], Any], args: argparse.Namespace,
                started: float) -> dict[str, Any]:
    llm = make_llm(args)
    engine = llm.engine
    rng = random.Random(0)
    _timed_request(engine, "ttft", _random_prompt(rng, 8), 1)
    ttft_from_start = time.perf_counter() - started

    prefill = [_timed_request(engine, f"prefill-{i}", _random_prompt(rng, args.input_len), 1)[0]
               for i in range(args.repeats)]
    decode = [_timed_request(engine, f"decode-{i}", _random_prompt(rng, 16), args.output_len)[1]
              for i in range(args.repeats)]
    prefill_s, decode_s = statistics.median(prefill), statistics.median(decode)
    return {
        "bench": "latency",
        "model": args.model,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "load_seconds": round(engine.load_seconds, 3),
        "first_token_seconds_from_process_start": round(ttft_from_start, 3),
        "input_len": args.input_len,
        "prefill_seconds": round(prefill_s, 4),
        "prefill_tokens_per_s": round(args.input_len / prefill_s, 1),
        "output_len": args.output_len,
        "decode_tokens_per_s": round((args.output_len - 1) / decode_s, 2),
        "decode_ms_per_token": round(1000 * decode_s / (args.output_len - 1), 2),
        "repeats": args.repeats,
    }

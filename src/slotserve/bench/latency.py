"""`slotserve bench latency`: load time, time to first token, single-request prefill and decode speed (and
prefill's share of this machine's GEMM rate in the dtype it multiplies in, decode's of the rate its weight
bytes allow at this machine's read rate), resident memory."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from slotserve.bench.bounds import attention_pair_flops, gemm_rate, linear_params, prefill_dtype, read_rate
from slotserve.bench.memory import peak_resident_bytes, resident_bytes, weight_bytes
from slotserve.sampling_params import SamplingParams


def random_prompt(rng: random.Random, length: int) -> list[int]:
    # Ordinary vocabulary ids only: no special tokens in the middle of a prompt.
    return [rng.randrange(1000, 100_000) for _ in range(length)]


def timed_request(engine, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """Seconds of the first step (prefill + first token) and of all the later (decode) steps."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    start = time.perf_counter()
    engine.step()
    first = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return first - start, time.perf_counter() - first


def _prefill_flops(model: nn.Module, cfg: Any, tokens: int) -> int:
    """One prompt's prefill: every token through the decoder's linears, one row of the head, attention."""
    body, head, _ = linear_params(model)
    return 2 * body * tokens + 2 * head + attention_pair_flops(cfg) * tokens * (tokens + 1) // 2


def run_latency(make_llm: Callable[[argparse.Namespace], Any], args: argparse.Namespace,
                started: float) -> dict[str, Any]:
    runtime = resident_bytes()  # torch and the rest of the process before a model is loaded
    llm = make_llm(args)
    engine = llm.engine
    rng = random.Random(0)
    timed_request(engine, "ttft", random_prompt(rng, 8), 1)
    ttft_from_start = time.perf_counter() - started

    prefill = [timed_request(engine, f"prefill-{i}", random_prompt(rng, args.input_len), 1)[0]
               for i in range(args.repeats)]
    decode = [timed_request(engine, f"decode-{i}", random_prompt(rng, 16), args.output_len)[1]
              for i in range(args.repeats)]
    prefill_s, decode_s = statistics.median(prefill), statistics.median(decode)
    model, cpu = engine.runner.model, engine.device.type == "cpu"
    dtype = prefill_dtype(model)
    rate = gemm_rate(dtype) if cpu else None
    prefill_rate = _prefill_flops(model, engine.model_config, args.input_len) / prefill_s
    decode_rate, step_bytes = (args.output_len - 1) / decode_s, linear_params(model)[2]
    peak = peak_resident_bytes() if cpu else None  # before read_rate's buffer
    read = read_rate() if cpu else None
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
        "prefill_GFLOPs": round(prefill_rate / 1e9, 1),
        "prefill_dtype": str(dtype).removeprefix("torch."),
        # A large square GEMM in that dtype, measured here: what prefill's linears would run at in torch.
        "gemm_GFLOPs": round(rate / 1e9, 1) if rate else None,
        "prefill_fraction_of_gemm": round(prefill_rate / rate, 3) if rate else None,
        "output_len": args.output_len,
        "decode_tokens_per_s": round(decode_rate, 2),
        "decode_ms_per_token": round(1000 / decode_rate, 2),
        # The weights a batch-1 step streams, and this machine's read rate: what bounds decode.
        "decode_weight_bytes_per_token": step_bytes,
        "read_GBps": round(read / 1e9, 1) if read else None,
        "decode_fraction_of_read_bound": round(decode_rate * step_bytes / read, 3) if read else None,
        "repeats": args.repeats,
        "weight_bytes": weight_bytes(model),
        "resident_bytes_before_load": runtime if cpu else None,
        "peak_resident_bytes": peak,
    }

"""`python -m slotserve.bench.dev kernels`: this machine's limits (memory read bandwidth, fp32 GEMM rate,
fp32 multiply-add peak) and the engine's speed as fractions of the bounds they imply.

- batch-1 decode streams every weight once per token: bound = bandwidth / weight bytes per token (in the
  form the step reads them: float32, or a narrow packing's bytes);
- prefill (one 512-token prompt) and batched decode (32 sequences) are GEMM work: bound = FLOPs of the
  step (linear layers and attention) / the GEMM rate; beside it, the same FLOPs as a fraction of the
  hardware's multiply-add peak (`fma_peak`), which no float32 GEMM on the vector units beats (linears on
  AMX, kernels/amx_gemm.c, can).

Each limit is sampled in turns with the figure it bounds (`interleaved`), so both see the same machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable
from typing import Any

import torch

from slotserve.bench.bounds import (
    GEMM_FLOPS,
    READ_BYTES,
    attention_pair_flops,
    fma_peak,
    gemm_pass,
    linear_params,
    read_buffer,
    read_pass,
)
from slotserve.bench.timing import median_seconds, seconds
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.model_runner import ScheduledSeq, Want
from slotserve.kv_cache.block_table import cache_indices


def interleaved(limit: Callable[[], object], work: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median seconds of the limit, median seconds of the work), sampled in turns: on a shared machine
    whose speed drifts by 1.5x within minutes, a bound taken minutes away from its figure says little.
    Each turn's limit is the best of three passes: the first pass after engine work runs 10-30 % slow here."""
    work()  # warm-up
    limits, times = [], []
    for _ in range(repeats):
        limits.append(min(seconds(limit) for _ in range(3)))
        times.append(seconds(work))
    limits.append(min(seconds(limit) for _ in range(3)))
    return statistics.median(limits), statistics.median(times)


def resident(engine: LLMEngine, table: list[int]) -> None:
    """Faults in the KV cache pages of a table's blocks (zeroing what they hold), as a server's are once it
    has run a while: the cache is faulted in lazily, and on fresh pages a round of batch-1 steps (each writing
    a new position into every layer's keys and values) spends 1-2 % of its time on page faults, not on
    decoding."""
    runner = engine.runner
    indices = torch.tensor(cache_indices(table, 0, len(table) * runner.block_size, runner.block_size))
    runner.k_cache[:, indices] = 0
    runner.v_cache[:, indices] = 0


def decode_step(engine: LLMEngine, batch: int, context_len: int,
                seed: int = 0) -> tuple[Callable[[], object], Callable[[], None]]:
    """A decode step of `batch` sequences with `context_len` random tokens of history each (prefilled
    here), as a function that runs it; and a function that frees their blocks afterwards."""
    rng, runner, pool = random.Random(seed), engine.runner, engine.kv.pool
    tables = [pool.allocate(engine.kv.blocks_for(context_len + 1)) for _ in range(batch)]
    with torch.inference_mode():
        for table in tables:
            runner.execute([ScheduledSeq([rng.randrange(1000, 100_000) for _ in range(context_len)], 0, table,
                                         want=Want.NONE)])
    step = [ScheduledSeq([5], context_len, table) for table in tables]

    def release() -> None:
        for table in tables:
            pool.free(table)

    return lambda: runner.execute(step), release


def run_kernels(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    core, cfg, runner = engine.core, engine.model_config, engine.runner
    rng = random.Random(0)
    buffer = read_buffer()
    read, gemm = read_pass(buffer), gemm_pass()
    peak_before = fma_peak()
    bandwidth_torch_sum = READ_BYTES / median_seconds(buffer.sum, 3)
    bandwidth_4k = READ_BYTES / median_seconds(read_pass(read_buffer(huge_pages=False)), 3)
    body, head, weight_bytes = linear_params(core.model)
    kv_per_token = runner.cache_bytes_per_token(cfg, core.worker.dtype)

    def attention_flops(queries: int, context: float) -> float:
        return attention_pair_flops(cfg) * queries * context

    def blocks(tokens: int) -> list[int]:
        return engine.kv.pool.allocate(engine.kv.blocks_for(tokens))

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 100_000) for _ in range(n)]

    with torch.inference_mode():
        # Prefill: one prompt, logits for its last token only.
        table = blocks(args.prefill_len)
        prompt = ids(args.prefill_len)
        prefill_gemm_s, prefill_s = interleaved(gemm, lambda: runner.execute([ScheduledSeq(prompt, 0, table)]),
                                              args.repeats)
        prefill_flops = 2 * body * args.prefill_len + 2 * head + attention_flops(args.prefill_len,
                                                                                 args.prefill_len / 2)
        engine.kv.pool.free(table)

        # Batch-1 decode: every weight streamed once per token. Rounds of decode_steps tokens, three times as
        # many as the other figures' turns: a round costs ~0.5 s, and the median of 3 ranged 0.81-0.89 of the
        # bound in one hour's runs of the same code here.
        rounds = 3 * args.repeats
        table = blocks(16 + args.decode_steps * (rounds + 1) + 1)
        resident(engine, table)
        tokens = [runner.execute([ScheduledSeq(ids(16), 0, table, want=Want.GREEDY)])[0].tokens[0]]

        def decode_round() -> None:  # each token the argmax of the last, picked as the engine's greedy rows are
            for _ in range(args.decode_steps):
                pos = 15 + len(tokens)
                tokens.append(runner.execute([ScheduledSeq(tokens[-1:], pos, table, want=Want.GREEDY)])[0].tokens[0])

        read_s, decode_round_s = interleaved(read, decode_round, rounds)
        decode_s = decode_round_s / args.decode_steps
        engine.kv.pool.free(table)
        decode_bytes = weight_bytes + kv_per_token * (16 + args.decode_steps * (rounds + 1) // 2)

        # Batched decode: `batch` sequences of `context_len` tokens, one new token each.
        step, release = decode_step(engine, args.batch, args.context_len)
        batched_gemm_s, batched_s = interleaved(gemm, step, args.repeats)
        batched_flops = args.batch * (2 * (body + head)) + attention_flops(args.batch, args.context_len)
        release()

    prefill_gemm, batched_gemm = GEMM_FLOPS / prefill_gemm_s, GEMM_FLOPS / batched_gemm_s
    peak = max(peak_before, fma_peak()) if peak_before else None

    def of_peak(flops_per_s: float) -> dict[str, float]:
        return {"fraction_of_fma_peak": round(flops_per_s / peak, 3)} if peak else {}

    bandwidth = READ_BYTES / read_s
    decode_bound = bandwidth / decode_bytes
    return {
        "bench": "kernels", "model": engine.config.model, "device": str(core.device),
        "dtype": str(core.worker.dtype).removeprefix("torch."), "quantization": engine.config.quantization,
        "threads": torch.get_num_threads(),
        # Which code ran: the native kernels (kernels/) or torch's operators in their place.
        "decode_attention": runner.decode_mode, "native_small_gemm": runner.native_gemm,
        "native_row_ops": runner.native_row_ops, "fused_decode": runner.fused is not None,
        "weights_in_huge_pages": core.worker.weights_in_huge_pages,
        "memory_read_GBps": round(bandwidth / 1e9, 1), "memory_read_torch_alloc_GBps": round(bandwidth_4k / 1e9, 1),
        "memory_read_torch_sum_GBps": round(bandwidth_torch_sum / 1e9, 1),
        "gemm_fp32_GFLOPs": round(statistics.median([prefill_gemm, batched_gemm]) / 1e9, 1),
        "fma_peak_GFLOPs": round(peak / 1e9, 1) if peak else None,
        "decode_batch1": {
            "tokens_per_s": round(1 / decode_s, 2), "bytes_per_token_MB": round(decode_bytes / 1e6, 1),
            "bound_tokens_per_s": round(decode_bound, 2), "fraction_of_bound": round(1 / decode_s / decode_bound, 3)},
        "prefill": {
            "tokens": args.prefill_len, "tokens_per_s": round(args.prefill_len / prefill_s, 1),
            "GFLOPs": round(prefill_flops / prefill_s / 1e9, 1),
            "gemm_bound_GFLOPs": round(prefill_gemm / 1e9, 1),
            "fraction_of_gemm_bound": round(prefill_flops / prefill_s / prefill_gemm, 3),
            **of_peak(prefill_flops / prefill_s)},
        "decode_batched": {
            "sequences": args.batch, "context": args.context_len, "step_ms": round(batched_s * 1e3, 1),
            "tokens_per_s": round(args.batch / batched_s, 1), "GFLOPs": round(batched_flops / batched_s / 1e9, 1),
            "gemm_bound_GFLOPs": round(batched_gemm / 1e9, 1),
            "fraction_of_gemm_bound": round(batched_flops / batched_s / batched_gemm, 3),
            **of_peak(batched_flops / batched_s)},
    }

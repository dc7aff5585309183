"""`slotserve bench throughput`: many requests through the batching engine, against the
one-at-a-time path and the bare single-sequence path, all measured in the same run."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from slotserve.bench.bounds import attention_pair_flops, fma_peak, gemm_rate, linear_params
from slotserve.bench.memory import peak_resident_bytes, weight_bytes
from slotserve.engine.llm_engine import LLMEngine
from slotserve.engine.model_runner import ScheduledSeq
from slotserve.sampling_params import SamplingParams

_ids = iter(range(1 << 62))  # request ids unique across the runs of one benchmark


def _prompts(engine: LLMEngine, args: argparse.Namespace, count: int, rng: random.Random) -> list[list[int]]:
    if args.prompts_file:
        lines = [ln for ln in Path(args.prompts_file).read_text().splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"prompts_file: {args.prompts_file} holds no prompts")
        return [engine.tokenizer.encode(lines[i % len(lines)]) for i in range(count)]
    # Ordinary vocabulary ids, different per prompt so the prefix cache does not flatter the figure.
    return [[rng.randrange(1000, 100_000) for _ in range(args.input_len)] for _ in range(count)]


def _run(engine: LLMEngine, prompts: list[list[int]], output_len: int, one_at_a_time: bool) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    output_tokens = 0
    started: set[str] = set()  # requests with a token out
    first_tokens = 0.0  # when the last of them got its first token (the batched run's prompts all prefilled)
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    for batch in batches:
        for prompt in batch:
            engine.add_request(f"bench-{next(_ids)}", prompt, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                output_tokens += len(o.outputs[0].token_ids) if o.finished else 0
                if o.request_id not in started and o.outputs[0].token_ids:
                    started.add(o.request_id)
                    first_tokens = time.perf_counter() - start
    seconds = time.perf_counter() - start
    input_tokens = sum(len(p) for p in prompts)
    return {
        "requests": len(prompts), "input_tokens": input_tokens, "output_tokens": output_tokens,
        "seconds": round(seconds, 3), "output_tokens_per_s": round(output_tokens / seconds, 2),
        "total_tokens_per_s": round((input_tokens + output_tokens) / seconds, 2),
        **({} if one_at_a_time else {"first_tokens_seconds": round(first_tokens, 3)}),
    }


def _decode_rate_engine(engine: LLMEngine, prompt: list[int], steps: int) -> float:
    """Decode tokens/s of one request through the whole engine (scheduler, sampler, detokenizer)."""
    engine.add_request(f"bench-{next(_ids)}", prompt, SamplingParams(temperature=0, max_tokens=steps + 1,
                                                                     ignore_eos=True))
    engine.step()  # prefill
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return steps / (time.perf_counter() - start)


def _decode_rate_bare(engine: LLMEngine, prompt: list[int], steps: int) -> float:
    """Decode tokens/s of the bare single-sequence path: model runner and argmax, nothing else."""
    runner = engine.runner
    blocks = engine.kv.pool.allocate(engine.kv.blocks_for(len(prompt) + steps + 1))
    try:
        token = int(runner.execute([ScheduledSeq(prompt, 0, blocks)])[0].logits[0].argmax())
        start = time.perf_counter()
        for pos in range(len(prompt), len(prompt) + steps):
            token = int(runner.execute([ScheduledSeq([token], pos, blocks)])[0].logits[0].argmax())
        return steps / (time.perf_counter() - start)
    finally:
        engine.kv.pool.free(blocks)


def _run_flops(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> int:
    """The batched run's FLOPs. Counted: each prompt token and each generated token but the last through the
    decoder's linear layers, one output-head row per generated token, attention over every query's context."""
    body, head, _ = linear_params(engine.core.model)
    pair = attention_pair_flops(engine.model_config)
    flops = 0
    for prompt in prompts:
        tokens = len(prompt) + output_len - 1
        flops += 2 * body * tokens + 2 * head * output_len + pair * tokens * (tokens + 1) // 2
    return flops


def _bounds(flops: int, run_seconds: float, gemm_rate: float, peak: float | None) -> dict[str, Any]:
    """The seconds the run's FLOPs take at this machine's fp32 GEMM rate (`gemm_bound`: what a float32
    engine whose GEMMs run at the BLAS library's rate finishes no faster than) and at the hardware's
    multiply-add peak (`fma_peak`: what no float32 engine on the vector units beats; linears on AMX can).
    Each rate is the better of the readings right before and right after the run: a shared machine has
    dips that last seconds."""
    bounds: dict[str, Any] = {"gemm_bound": {
        "flops": flops, "gemm_fp32_GFLOPs": round(gemm_rate / 1e9, 1), "seconds": round(flops / gemm_rate, 3),
        "fraction_of_gemm_bound": round(flops / gemm_rate / run_seconds, 3)}}
    bounds["fma_peak"] = {"GFLOPs": round(peak / 1e9, 1), "seconds": round(flops / peak, 3),
                          "fraction_of_fma_peak": round(flops / peak / run_seconds, 3)} if peak else None
    return bounds


def _transformers_model(engine: LLMEngine) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from slotserve.model_store import resolve_model

    return AutoModelForCausalLM.from_pretrained(resolve_model(engine.config.model), dtype=engine.dtype).eval()


def _transformers_rate(model: torch.nn.Module, engine: LLMEngine, prompts: list[list[int]],
                       output_len: int) -> dict[str, Any]:
    """Output tokens/s of Hugging Face `generate` on the same prompts in one padded batch (greedy), and
    the seconds of a `generate` of one token each (the prompts' prefill)."""
    width = max(len(p) for p in prompts)
    pad = engine.tokenizer.eos_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding, as generate wants
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def generate(tokens: int) -> tuple[torch.Tensor, float]:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, pad_token_id=pad)
        return out, time.perf_counter() - start

    out, seconds = generate(output_len)
    _, first_tokens = generate(1)
    generated = (out.shape[1] - width) * len(prompts)
    return {"requests": len(prompts), "output_tokens": generated, "seconds": round(seconds, 3),
            "output_tokens_per_s": round(generated / seconds, 2), "first_tokens_seconds": round(first_tokens, 3)}


def _phases(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    """Speed-ups over transformers until every request has its first token (mostly the prompts' prefill)
    and after it (decode)."""
    after_ours, after_theirs = (r["seconds"] - r["first_tokens_seconds"] for r in (ours, theirs))
    return {"speedup_to_first_tokens": round(theirs["first_tokens_seconds"] / ours["first_tokens_seconds"], 2),
            "speedup_after_first_tokens": round(after_theirs / after_ours, 2) if after_ours > 0 else None}


def _against_transformers(engine: LLMEngine, args: argparse.Namespace, rng: random.Random,
                          first: tuple[list[list[int]], dict[str, Any]]) -> list[dict[str, Any]]:
    """Rounds of (the batched run, transformers on the same prompts), each pair back to back: the first
    from the run already made, the others on fresh prompts (the prefix cache must not flatter them)."""
    model = _transformers_model(engine)
    rounds = []
    prompts, ours = first
    for i in range(args.rounds):
        if i:
            prompts = _prompts(engine, args, args.num_prompts, rng)
            ours = _run(engine, prompts, args.output_len, one_at_a_time=False)
        print(f"transformers generate, one padded batch (round {i + 1}) ...", file=sys.stderr)
        theirs = _transformers_rate(model, engine, prompts, args.output_len)
        rounds.append({"slotserve_output_tokens_per_s": ours["output_tokens_per_s"],
                       "transformers_output_tokens_per_s": theirs["output_tokens_per_s"],
                       "speedup": round(ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 2),
                       **_phases(ours, theirs), "transformers_generate": theirs})
    return rounds


def run_throughput(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    if args.rounds < 1 or (args.rounds > 1 and args.prompts_file):
        raise ValueError("rounds: must be >= 1, and 1 with --prompts-file (later rounds would hit the prefix cache)")
    if args.num_prompts < 1 or args.baseline_prompts < 0:
        raise ValueError(f"num_prompts: must be >= 1 (got {args.num_prompts}); baseline_prompts: >= 0, 0 skips the "
                         f"one-at-a-time run (got {args.baseline_prompts})")
    rng = random.Random(args.seed)
    batched_prompts = _prompts(engine, args, args.num_prompts, rng)
    _run(engine, _prompts(engine, args, 1, rng), 4, one_at_a_time=True)  # warm-up
    fp32_cpu = engine.device.type == "cpu" and engine.dtype == torch.float32 and not engine.config.quantization
    rate_before, peak_before = (gemm_rate(), fma_peak()) if fp32_cpu else (0.0, None)
    print(f"batched: {args.num_prompts} requests ...", file=sys.stderr)
    batched = _run(engine, batched_prompts, args.output_len, one_at_a_time=False)
    bounds = (_bounds(_run_flops(engine, batched_prompts, args.output_len), batched["seconds"],
                      max(rate_before, gemm_rate()), peak_before and max(peak_before, fma_peak() or 0.0))
              if fp32_cpu else {"gemm_bound": None, "fma_peak": None})
    rounds = _against_transformers(engine, args, rng, (batched_prompts, batched)) if args.compare_transformers else []
    alone = None
    if args.baseline_prompts:
        print(f"one at a time: {args.baseline_prompts} requests ...", file=sys.stderr)
        alone = _run(engine, _prompts(engine, args, args.baseline_prompts, rng), args.output_len, one_at_a_time=True)
    decode_prompt = _prompts(engine, args, 1, rng)[0][:16]
    # Alternating rounds, medians: a shared machine drifts, and both paths should see the same drift.
    engine_rates, bare_rates = [], []
    for _ in range(3):
        engine_rates.append(_decode_rate_engine(engine, decode_prompt, args.output_len // 2))
        bare_rates.append(_decode_rate_bare(engine, decode_prompt, args.output_len // 2))
    engine_rate, bare_rate = statistics.median(engine_rates), statistics.median(bare_rates)
    peak = (torch.cuda.max_memory_allocated() if engine.device.type == "cuda"
            else peak_resident_bytes())
    return {
        "bench": "throughput",
        "model": engine.config.model,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "input_len": args.input_len if not args.prompts_file else None,
        "output_len": args.output_len,
        **batched,
        "one_at_a_time": alone,
        "speedup_vs_one_at_a_time": (round(batched["output_tokens_per_s"] / alone["output_tokens_per_s"], 2)
                                     if alone else None),
        "batch1_decode_tokens_per_s": round(engine_rate, 2),
        "single_sequence_decode_tokens_per_s": round(bare_rate, 2),
        "batch1_vs_single_sequence": round(engine_rate / bare_rate, 3),
        "transformers_generate": rounds[0]["transformers_generate"] if rounds else None,
        # The median over --rounds pairs, each run back to back: the machine drifts between rounds.
        "speedup_vs_transformers": statistics.median(r["speedup"] for r in rounds) if rounds else None,
        # The run in two phases, medians over the rounds likewise: prefill is large GEMMs in both engines.
        **{f"speedup_vs_transformers_{phase}": (statistics.median(r[f"speedup_{phase}"] for r in rounds)
                                                 if rounds and rounds[0][f"speedup_{phase}"] is not None else None)
           for phase in ("to_first_tokens", "after_first_tokens")},
        "transformers_rounds": [{k: v for k, v in r.items() if k != "transformers_generate"} for r in rounds],
        **bounds,
        # What a float32 engine at the BLAS GEMM rate, or at the hardware's peak, could beat transformers by:
        # transformers' seconds over the bound's.
        **{f"speedup_vs_transformers_at_{name}": (
            round(rounds[0]["transformers_generate"]["seconds"] / bounds[name]["seconds"], 2)
            if rounds and bounds[name] else None) for name in ("gemm_bound", "fma_peak")},
        "prefix_cache_hit_rate": round(engine.kv.stats.hit_rate, 3),
        "preemptions": engine.scheduler.num_preemptions,
        "weight_bytes": weight_bytes(engine.runner.model),
        "peak_memory_bytes": peak,
        "peak_memory_kind": "cuda_allocated" if engine.device.type == "cuda" else "process_max_rss",
    }

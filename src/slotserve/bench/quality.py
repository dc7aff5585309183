"""`slotserve bench quality`: the engine as configured against the float32 reference of the same model, in the
same run. The reference multiplies the checkpoint's exact weights in float32 throughout (a GGUF's dequantized
values; no int8 linears, float32 prefill); the engine may round (a bfloat16 prefill, `--quantization int8`).

Quality: perplexity of a fixed text (English prose and Python), how often the two agree on the text's next
tokens, and greedy completions of fixed prompts compared token for token. Speed: batch-1 decode tokens/s and
the time of one decode step over many sequences.

This module imports torch only when it runs, so the CLI can build its parser without it.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from slotserve.config import EngineConfig
    from slotserve.engine.llm_engine import LLMEngine
    from slotserve.entrypoints.llm import LLM

# Written for this benchmark (so no model has memorised it): ordinary prose, then ordinary code.
QUALITY_TEXT = '''\
The old harbour town wakes slowly in winter. Before sunrise the fishing boats leave one by one, their \
lights moving across the dark water like a line of small stars, and by the time the bakery opens the \
first of them is already on its way back. The market fills up around nine. People buy bread, apples \
and whatever fish came in that morning, and they talk about the weather, which is the only subject \
everyone in town agrees is worth discussing. In the afternoon the wind usually picks up, the cafes \
close their terraces, and children walk home from school along the sea wall, daring each other to \
stand still when the waves break against it. Visitors often say that nothing happens here. The people \
who live here would say that this is exactly the point.

Below is a small Python module that keeps a running summary of numbers without storing them all.

import math
from dataclasses import dataclass


@dataclass
class RunningStats:
    """Count, mean and variance of a stream of numbers (Welford's method)."""

    count: int = 0
    mean: float = 0.0
    _m2: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self._m2 += delta * (value - self.mean)

    @property
    def variance(self) -> float:
        return self._m2 / (self.count - 1) if self.count > 1 else 0.0

    @property
    def stdev(self) -> float:
        return math.sqrt(self.variance)


def summarize(values: list[float]) -> str:
    stats = RunningStats()
    for value in values:
        stats.add(value)
    return f"n={stats.count} mean={stats.mean:.3f} stdev={stats.stdev:.3f}"
'''

GREEDY_PROMPTS = [
    "The three most important things to know about photosynthesis are",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n",
    "Here is a short story about a lighthouse keeper who finds a message in a bottle.\n\n",
    "Question: What is the difference between a list and a tuple in Python?\nAnswer:",
    "import json\n\n\ndef load_config(path):\n",
    "The history of the printing press began",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt in the comparison")
    parser.add_argument("--decode-steps", type=int, default=32, help="tokens timed in the batch-1 decode")
    parser.add_argument("--batch", type=int, default=32, help="sequences in the batched decode step")
    parser.add_argument("--context-len", type=int, default=256, help="context of each sequence in that step")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of the speed figures; medians")


def run_quality(config: EngineConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Loads `config`'s model twice, as the reference and as configured, and measures both side by side."""
    import torch

    from slotserve.bench.bounds import prefill_dtype
    from slotserve.config import PrefillPrecision
    from slotserve.entrypoints.llm import LLM

    load_start = os.getloadavg()
    reference = replace(config, quantization=None, prefill_precision=PrefillPrecision.FLOAT32)
    llms = {"reference": LLM.from_config(reference), "engine": LLM.from_config(config)}
    engines = {name: llm.engine for name, llm in llms.items()}
    ids = engines["reference"].tokenizer.encode(QUALITY_TEXT)
    logprobs = {name: _text_logprobs(engine, ids) for name, engine in engines.items()}
    greedy = {name: _greedy(llm, args.new_tokens) for name, llm in llms.items()}
    # Alone, each prompt is computed whole: a prefix-cache hit on the batched run's blocks would split it
    # into other chunks, which round differently (only decode steps are bitwise batch-invariant).
    alone = {}
    for name, llm in llms.items():
        llm.engine.kv.enable_prefix_caching = False
        alone[name] = _greedy(llm, args.new_tokens, one_at_a_time=True)
        llm.engine.kv.enable_prefix_caching = config.enable_prefix_caching
    # Alternating rounds: a shared machine drifts, and both models should see the same drift.
    speed: dict[str, dict[str, list[float]]] = {name: {"batch1": [], "step": []} for name in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            speed[name]["batch1"].append(_decode_rate(engine, ids[:16], args.decode_steps))
            speed[name]["step"].append(_batched_step_seconds(engine, args.batch, args.context_len))
    result: dict[str, Any] = {
        "bench": "quality",
        "model": config.model,
        "threads": torch.get_num_threads(),
        "text_tokens": len(ids),
    }
    for name, engine in engines.items():
        result[name] = {
            "quantization": engine.config.quantization,
            "prefill_dtype": str(prefill_dtype(engine.runner.model)).removeprefix("torch."),
            "load_seconds": round(engine.load_seconds, 2),
            "perplexity": round(_perplexity(logprobs[name], ids), 4),
            "decode_batch1_tokens_per_s": round(statistics.median(speed[name]["batch1"]), 2),
            f"decode_step_{args.batch}seq_ms": round(1000 * statistics.median(speed[name]["step"]), 1),
        }
    ref, ours = result["reference"], result["engine"]
    prefixes = [_common_prefix(a, b) for a, b in zip(greedy["reference"], greedy["engine"], strict=True)]
    result["comparison"] = {
        "perplexity_ratio": round(ours["perplexity"] / ref["perplexity"], 4),
        "text_top1_agreement": round(_top1_agreement(logprobs["reference"], logprobs["engine"]), 4),
        "text_mean_kl": round(_mean_kl(logprobs["reference"], logprobs["engine"]), 5),
        "greedy_prompts": len(prefixes),
        "greedy_tokens": args.new_tokens,
        "greedy_identical_fraction": round(sum(p == args.new_tokens for p in prefixes) / len(prefixes), 3),
        "greedy_mean_common_prefix": round(statistics.mean(prefixes), 1),
        "greedy_common_prefixes": prefixes,
        # Decode rows are bitwise batch-invariant (docs/performance.md); a prompt's prefill is not, in general.
        "reference_greedy_same_alone_and_batched": alone["reference"] == greedy["reference"],
        "engine_greedy_same_alone_and_batched": alone["engine"] == greedy["engine"],
        "decode_batch1_speedup": round(ours["decode_batch1_tokens_per_s"] / ref["decode_batch1_tokens_per_s"], 2),
        f"decode_step_{args.batch}seq_speedup": round(ref[f"decode_step_{args.batch}seq_ms"]
                                                      / ours[f"decode_step_{args.batch}seq_ms"], 2),
    }
    result["load_average"] = {"start": [round(x, 2) for x in load_start],
                              "end": [round(x, 2) for x in os.getloadavg()]}
    return result


def _with_blocks(engine: LLMEngine, num_tokens: int, body: Callable[[list[int]], Any]) -> Any:
    """Runs `body(block_table)` on fresh blocks for `num_tokens` tokens, then returns them to the pool."""
    blocks = engine.kv.pool.allocate(engine.kv.blocks_for(num_tokens))
    try:
        return body(blocks)
    finally:
        engine.kv.pool.free(blocks)


def _text_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Log-probabilities [len(ids) - 1, vocab] of every next token of the text, one forward pass."""
    from slotserve.engine.model_runner import ScheduledSeq, Want

    logits = _with_blocks(engine, len(ids), lambda blocks: engine.runner.execute(
        [ScheduledSeq(ids, 0, blocks, want=Want.ALL)])[0].logits)
    return logits[:-1].log_softmax(dim=-1)


def _perplexity(logprobs: torch.Tensor, ids: list[int]) -> float:
    targets = logprobs.new_tensor(ids[1:]).long().unsqueeze(1)
    return math.exp(-logprobs.gather(1, targets).mean().item())


def _top1_agreement(reference: torch.Tensor, other: torch.Tensor) -> float:
    return (reference.argmax(dim=-1) == other.argmax(dim=-1)).float().mean().item()


def _mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean KL(reference || other) of the next-token distributions, in nats."""
    return (reference.exp() * (reference - other)).sum(dim=-1).mean().item()


def _greedy(llm: LLM, new_tokens: int, one_at_a_time: bool = False) -> list[list[int]]:
    """Each prompt's greedy tokens, the prompts in one batch or one after another."""
    from slotserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    batches = [[p] for p in GREEDY_PROMPTS] if one_at_a_time else [GREEDY_PROMPTS]
    return [out.outputs[0].token_ids for batch in batches for out in llm.generate(batch, params, use_tqdm=False)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _decode_rate(engine: LLMEngine, prompt: list[int], steps: int) -> float:
    """Batch-1 decode tokens/s through the model runner and argmax (after the prompt's prefill)."""
    from slotserve.engine.model_runner import ScheduledSeq

    def run(blocks: list[int]) -> float:
        runner = engine.runner
        token = int(runner.execute([ScheduledSeq(prompt, 0, blocks)])[0].logits[0].argmax())
        start = time.perf_counter()
        for pos in range(len(prompt), len(prompt) + steps):
            token = int(runner.execute([ScheduledSeq([token], pos, blocks)])[0].logits[0].argmax())
        return steps / (time.perf_counter() - start)
    return _with_blocks(engine, len(prompt) + steps + 1, run)


def _batched_step_seconds(engine: LLMEngine, batch: int, context_len: int, steps: int = 3) -> float:
    """Median seconds of one decode step over `batch` sequences of `context_len` tokens each.

    Timing only, so nothing is prefilled: the attention reads whatever the blocks hold, which is
    the same work as reading a real context."""
    from slotserve.engine.model_runner import ScheduledSeq

    tables = [engine.kv.pool.allocate(engine.kv.blocks_for(context_len + steps)) for _ in range(batch)]
    try:
        times = []
        for step in range(steps + 1):  # the first step warms up
            seqs = [ScheduledSeq([1000 + i], context_len + step, table) for i, table in enumerate(tables)]
            start = time.perf_counter()
            engine.runner.execute(seqs)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    finally:
        for table in tables:
            engine.kv.pool.free(table)

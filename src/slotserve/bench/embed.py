"""`slotserve bench embed`: embeddings per second for a batch of sentences, through the engine."""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from slotserve.engine.llm_engine import LLMEngine
from slotserve.pooling_params import PoolingParams

_WORDS = ["model", "engine", "token", "cache", "batch", "vector", "kernel", "thread", "memory", "prompt", "paris",
          "python", "sort", "list", "weather", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]


def run_embed(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)

    def sentences(count: int) -> list[str]:
        # Random, so the prefix cache does not flatter the figure.
        return [" ".join(rng.choice(_WORDS) for _ in range(args.words)) for _ in range(count)]

    def embed_all(prefix: str, batch: list[str]) -> float:
        start = time.perf_counter()
        for i, sentence in enumerate(batch):
            engine.add_request(f"{prefix}-{i}", sentence, PoolingParams())
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    embed_all("warmup", sentences(4))
    batch = sentences(args.num_sentences)
    tokens = sum(len(engine.tokenizer.encode(s)) for s in batch)
    seconds = embed_all("bench", batch)
    return {
        "bench": "embed", "model": engine.config.model, "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."), "sentences": len(batch), "tokens": tokens,
        "seconds": round(seconds, 3), "embeddings_per_s": round(len(batch) / seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1),
    }

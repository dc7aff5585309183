"""`slotserve bench serve`: load a running server with streamed completions and report request
throughput, output tokens/s, TTFT, TPOT and ITL (mean, median, p99)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class _Result:
    ok: bool = False
    error: str | None = None
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to load")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: all at once)")
    p.add_argument("--seed", type=int, default=0)


async def _one(client: httpx.AsyncClient, body: dict[str, Any], limit: asyncio.Semaphore | None) -> _Result:
    result = _Result()
    async with limit or contextlib.nullcontext():
        start = last = time.perf_counter()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        result.output_tokens = chunk["usage"]["completion_tokens"]
                    if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                        continue
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
            result.e2e = time.perf_counter() - start
            result.ok = True
        except httpx.HTTPError as e:
            result.error = f"{type(e).__name__}: {e}"
    return result


def _summary(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": round(statistics.fmean(values) * scale, 2), "median": round(statistics.median(values) * scale, 2),
            "p99": round(p99 * scale, 2)}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None,
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        tasks = []
        start = time.perf_counter()
        for _ in range(args.num_prompts):
            body = {"model": model, "prompt": [rng.randrange(1000, 100_000) for _ in range(args.input_len)],
                    "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(_one(client, body, limit)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "bench": "serve", "base_url": args.base_url, "model": model,
        "num_prompts": args.num_prompts, "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "input_len": args.input_len, "output_len": args.output_len,
        "max_concurrency": args.max_concurrency,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "seconds": round(seconds, 3),
        "request_throughput": round(len(done) / seconds, 3),
        "output_tokens_per_s": round(output_tokens / seconds, 2),
        "total_tokens_per_s": round((output_tokens + len(done) * args.input_len) / seconds, 2),
        "ttft_ms": _summary([r.ttft for r in done]),
        "tpot_ms": _summary(tpots),
        "itl_ms": _summary([x for r in done for x in r.itls]),
    }


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the figures
    return asyncio.run(_run(args))

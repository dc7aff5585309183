"""`slotserve bench serve`: load a running server with streamed completions and report request
throughput, output tokens/s, TTFT, TPOT and ITL (mean, median, p99).

With `--duration`, requests keep coming for that long at `--max-concurrency`; with `--cancel-fraction`,
that share of the streams is dropped by the client after a random number of tokens. Afterwards the
server's /metrics tell whether every sequence ended and every KV block went back to the pool."""

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
    cancelled: bool = False  # the client dropped the stream on purpose
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
    p.add_argument("--duration", type=float, default=None,
                   help="seconds to keep sending requests (at --max-concurrency) instead of --num-prompts")
    p.add_argument("--cancel-fraction", type=float, default=0.0,
                   help="share of the streams the client drops after a random number of tokens")
    p.add_argument("--poll-debug", type=float, default=None, metavar="SECONDS",
                   help="also GET /debug/engine every SECONDS during the run (what polling it costs the server)")
    p.add_argument("--settle-timeout", type=float, default=30.0,
                   help="seconds to wait afterwards for the server to report no sequence and every KV block free")


async def _one(client: httpx.AsyncClient, body: dict[str, Any], limit: asyncio.Semaphore | None,
               cancel_after: int | None = None) -> _Result:
    """One streamed completion; `cancel_after` chunks with text, then the client closes the stream."""
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
                    if cancel_after is not None and len(result.itls) + 1 >= cancel_after:
                        result.cancelled = True
                        return result
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


async def run_load(args: argparse.Namespace) -> dict[str, Any]:
    """The load `args` describe against the server at `args.base_url`, and its figures."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None,
                                 limits=httpx.Limits(max_connections=None)) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]

        def request() -> tuple[dict[str, Any], int | None]:
            body = {"model": model, "prompt": [rng.randrange(1000, 100_000) for _ in range(args.input_len)],
                    "max_tokens": args.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            cancel = rng.random() < args.cancel_fraction
            return body, rng.randrange(1, max(args.output_len, 2)) if cancel else None

        polls = [0]
        poller = asyncio.create_task(_poll(client, args.poll_debug, polls)) if args.poll_debug else None
        start = time.perf_counter()
        if args.duration is not None:
            results = await _for_duration(client, request, args.duration, args.max_concurrency or 1)
        else:
            limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
            tasks = []
            for _ in range(args.num_prompts):
                body, cancel_after = request()
                tasks.append(asyncio.create_task(_one(client, body, limit, cancel_after)))
                if args.request_rate != float("inf"):
                    await asyncio.sleep(rng.expovariate(args.request_rate))
            results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
        if poller is not None:
            poller.cancel()
        after = await _settled(client, args.settle_timeout)
    done = [r for r in results if r.ok]
    cancelled = [r for r in results if r.cancelled]
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "bench": "serve", "base_url": args.base_url, "model": model,
        "num_prompts": len(results), "completed": len(done), "cancelled": len(cancelled),
        "failed": len(results) - len(done) - len(cancelled),
        "errors": sorted({r.error for r in results if r.error})[:3],
        "input_len": args.input_len, "output_len": args.output_len,
        "max_concurrency": args.max_concurrency, "duration": args.duration, "cancel_fraction": args.cancel_fraction,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "seconds": round(seconds, 3),
        "request_throughput": round(len(done) / seconds, 3),
        "output_tokens_per_s": round(output_tokens / seconds, 2),
        "total_tokens_per_s": round((output_tokens + len(done) * args.input_len) / seconds, 2),
        "ttft_ms": _summary([r.ttft for r in done]),
        "tpot_ms": _summary(tpots),
        "itl_ms": _summary([x for r in done for x in r.itls]),
        "debug_polls": polls[0],
        "after": after,
    }


async def _for_duration(client: httpx.AsyncClient, request, duration: float, concurrency: int) -> list[_Result]:
    """`concurrency` clients, each sending its next request when the last one ends, until `duration` is up."""
    deadline = time.perf_counter() + duration
    results: list[_Result] = []

    async def client_loop() -> None:
        while time.perf_counter() < deadline:
            body, cancel_after = request()
            results.append(await _one(client, body, None, cancel_after))

    await asyncio.gather(*[client_loop() for _ in range(concurrency)])
    return results


async def _poll(client: httpx.AsyncClient, every: float, polls: list[int]) -> None:
    while True:
        response = await client.get("/debug/engine")
        response.raise_for_status()
        polls[0] += 1
        await asyncio.sleep(every)


async def _settled(client: httpx.AsyncClient, timeout: float) -> dict[str, Any]:
    """The server's gauges once nothing runs or waits and every KV block is free (or as they are at the
    timeout): `settled` says which."""
    deadline = time.perf_counter() + timeout
    while True:
        text = (await client.get("/metrics")).text
        gauges = {line.split("{")[0].removeprefix("slotserve:"): float(line.rsplit(" ", 1)[1])
                  for line in text.splitlines() if line.startswith("slotserve:") and "_bucket" not in line}
        state = {name: gauges.get(name) for name in ("num_requests_running", "num_requests_waiting",
                                                     "kv_cache_blocks", "kv_cache_free_blocks")}
        settled = (state["num_requests_running"] == 0 and state["num_requests_waiting"] == 0
                   and state["kv_cache_free_blocks"] == state["kv_cache_blocks"])
        if settled or time.perf_counter() > deadline:
            return {"settled": settled, **state}
        await asyncio.sleep(0.1)


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the figures
    return asyncio.run(run_load(args))

"""`python -m slotserve.bench.dev attention`: ways of reading the paged KV cache in a decode step, timed on one
attention layer (default: Qwen3-0.6B's shape, 16 sequences of ~750 context tokens)."""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from slotserve.kv_cache.block_table import cache_index
from slotserve.layers.attention import Attention, AttentionMetadata, GatherWorkspace, paged_decode_available


def _time(attn: Attention, q, k, v, meta: AttentionMetadata, repeats: int) -> float:
    with torch.inference_mode():
        for _ in range(3):
            attn(q, k, v, meta)
        start = time.perf_counter()
        for _ in range(repeats):
            attn(q, k, v, meta)
    return (time.perf_counter() - start) / repeats


def run_attention(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    bs, n = args.block_size, args.num_seqs
    lengths = [args.context_len + rng.randrange(-args.context_len // 8, args.context_len // 8 + 1) for _ in range(n)]
    blocks_per_seq = [-(-length // bs) for length in lengths]
    num_blocks = sum(blocks_per_seq) + 8
    attn = Attention(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim**-0.5)
    shape = (num_blocks * bs, args.num_kv_heads, args.head_dim)
    attn.k_cache, attn.v_cache = torch.randn(shape), torch.randn(shape)
    q = torch.randn(n, args.num_heads, args.head_dim)
    k = torch.randn(n, args.num_kv_heads, args.head_dim)
    v = torch.randn(n, args.num_kv_heads, args.head_dim)

    ids = list(range(num_blocks))
    consecutive, start = [], 0
    for count in blocks_per_seq:
        consecutive.append(ids[start:start + count])
        start += count
    rng.shuffle(ids)  # blocks as a busy pool hands them out: scattered
    scattered = [ids[sum(blocks_per_seq[:i]):sum(blocks_per_seq[:i + 1])] for i in range(n)]

    workspace = GatherWorkspace()

    def meta(tables: list[list[int]], mode: str) -> AttentionMetadata:
        indices = torch.tensor([cache_index(t, ln - 1, bs) for t, ln in zip(tables, lengths, strict=True)])
        return AttentionMetadata.build([1] * n, lengths, indices, tables, bs, decode_mode=mode, workspace=workspace)

    timings = {
        "gather_per_seq_ms": _time(attn, q, k, v, meta(scattered, "per_seq"), args.repeats),
        "batched_gather_ms": _time(attn, q, k, v, meta(scattered, "batched"), args.repeats),
        "in_place_consecutive_ms": _time(attn, q, k, v, meta(consecutive, "batched"), args.repeats),
    }
    if paged_decode_available(q.device, q.dtype):
        timings["paged_kernel_ms"] = _time(attn, q, k, v, meta(scattered, "paged"), args.repeats)
    return {
        "bench": "attention",
        "num_seqs": n, "mean_context": round(sum(lengths) / n, 1), "block_size": bs,
        "heads": args.num_heads, "kv_heads": args.num_kv_heads, "head_dim": args.head_dim,
        "threads": torch.get_num_threads(),
        **{name: round(seconds * 1e3, 3) for name, seconds in timings.items()},
        "batched_speedup_vs_gather_per_seq": round(timings["gather_per_seq_ms"] / timings["batched_gather_ms"], 2),
        "paged_speedup_vs_batched_gather": (round(timings["batched_gather_ms"] / timings["paged_kernel_ms"], 2)
                                            if "paged_kernel_ms" in timings else None),
    }

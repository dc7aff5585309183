"""`slotserve bench kv-restore`: time to first token of a long prompt whose prefix is computed, against the same
prompt after the prefix was saved to the KV disk tier and the engine restarted (a fresh engine over the same
directory), in one run. The saved files are dropped from the page cache before the restart
(posix_fadvise DONTNEED), so the restore reads the disk. Greedy, so both runs must give the same tokens
(`same_tokens`)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slotserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the command line imports this module's arguments without torch
    from slotserve.config import EngineConfig
    from slotserve.engine.llm_engine import LLMEngine
    from slotserve.entrypoints.llm import LLM

_QUESTION = "\n\nIn one sentence: what does the code above do?"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix-len", type=int, default=4000, help="tokens of the saved prefix (default 4000)")
    p.add_argument("--output-len", type=int, default=16, help="greedy tokens compared between the runs")
    p.add_argument("--repeats", type=int, default=2, help="restored requests timed, each after a restart")
    p.add_argument("--dir", default=None, help="the disk tier's directory (default: a temporary one, removed)")


def _prefix_tokens(engine: LLMEngine, length: int) -> list[int]:
    """`length` tokens of real text: this package's own source, file after file."""
    root = Path(__file__).resolve().parents[1]
    tokens: list[int] = []
    for path in sorted(root.rglob("*.py")):
        tokens += engine.tokenizer.encode(path.read_text())
        if len(tokens) >= length:
            return tokens[:length]
    raise ValueError(f"prefix_len: the sources hold only {len(tokens)} tokens")


def _drop_page_cache(directory: Path) -> None:
    for path in directory.rglob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _first_token(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, list[int], int]:
    """Seconds from adding the request to its first token, its greedy tokens and the prompt tokens it found cached."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request("bench", prompt, params)
    first, tokens, cached = None, [], 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if first is None and o.outputs and o.outputs[0].token_ids:
                first = time.perf_counter() - start
            if o.finished:
                tokens, cached = o.outputs[0].token_ids, o.num_cached_tokens
    return first, tokens, cached


def run_kv_restore(config: EngineConfig, args: argparse.Namespace) -> dict[str, Any]:
    from slotserve.entrypoints.llm import LLM

    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="slotserve-kv-"))
    config = dataclasses.replace(config, kv_offload_dir=str(directory))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    try:
        llm = LLM.from_config(config)
        prefix = _prefix_tokens(llm.engine, args.prefix_len)
        prompt = prefix + llm.engine.tokenizer.encode(_QUESTION)
        recompute_s, want, recompute_cached = _first_token(llm, prompt, params)
        start = time.perf_counter()
        saved = llm.save_cache(prefix, name="bench-kv-restore")
        save_s = time.perf_counter() - start
        written = llm.engine.stats().kv_disk.bytes_written
        llm.shutdown()
        del llm
        restores = []
        for _ in range(args.repeats):
            _drop_page_cache(directory)
            start = time.perf_counter()
            llm = LLM.from_config(config)
            load_s = time.perf_counter() - start
            restore_s, got, cached = _first_token(llm, prompt, params)
            stats = llm.engine.stats()
            restores.append({"ttft_s": round(restore_s, 4), "engine_load_s": round(load_s, 2),
                             "cached_tokens": cached, "disk_hit_tokens": stats.prefix_cache_disk_hit_tokens,
                             "bytes_read": stats.kv_disk.bytes_read, "same_tokens": got == want})
            llm.shutdown()
            del llm
    finally:
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    worst = max(r["ttft_s"] for r in restores)
    return {
        "bench": "kv-restore", "model": config.model, "prompt_tokens": len(prompt), "prefix_tokens": len(prefix),
        "recompute_ttft_s": round(recompute_s, 4), "recompute_cached_tokens": recompute_cached,
        "save_s": round(save_s, 4), "saved_tokens": saved.num_saved_tokens, "bytes_written": written,
        "restores": restores, "restore_ttft_s": worst, "ratio": round(worst / recompute_s, 4),
        "same_tokens": all(r["same_tokens"] for r in restores), "page_cache_dropped": True,
    }

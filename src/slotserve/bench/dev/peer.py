"""`python -m slotserve.bench.dev peer --llama-bench PATH`: the engine's single-request prefill and batch-1 decode
beside llama.cpp's `llama-bench` on the same GGUF, in alternating rounds (one engine round, one llama-bench run),
so that both see the same machine: on a shared VM the read rate moves by 1.5x within minutes, and figures taken
minutes apart compare the neighbours' load as much as the engines. Prints each side's medians and the median
of the rounds' ratios (engine over llama.cpp)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
from typing import Any

import torch

from slotserve import model_store
from slotserve.bench.latency import random_prompt, timed_request
from slotserve.engine.llm_engine import LLMEngine


def gguf_of(model: str) -> str:
    """The GGUF file behind the engine's `-m`: an alias's assembled file, or the path given."""
    alias = model_store.ALIASES.get(model)
    path = model_store.gguf_path(alias) if alias else model
    if not str(path).lower().endswith(".gguf") or not os.path.isfile(path):
        raise ValueError(f"--model {model!r}: the peer benchmark needs an alias or a .gguf file")
    return str(path)


def _llama_round(args: argparse.Namespace, gguf: str) -> tuple[float, float]:
    """(prefill, decode) tokens/s of one llama-bench run (`-r 1`) on the engine's thread count."""
    command = [args.llama_bench, "-m", gguf, "-p", str(args.input_len), "-n", str(args.output_len), "-r", "1",
               "-t", str(torch.get_num_threads()), "-o", "json"]
    rows = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    rate = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    return rate["prefill"], rate["decode"]


def _engine_round(engine: LLMEngine, args: argparse.Namespace, rng: random.Random, i: int) -> tuple[float, float]:
    prefill = timed_request(engine, f"prefill-{i}", random_prompt(rng, args.input_len), 1)[0]
    decode = timed_request(engine, f"decode-{i}", random_prompt(rng, 16), args.output_len)[1]
    return args.input_len / prefill, (args.output_len - 1) / decode


def run_peer(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    gguf = gguf_of(args.model)
    rng = random.Random(0)
    _engine_round(engine, args, rng, -1)  # warm-up: first-call costs of both
    _llama_round(args, gguf)
    ours, theirs = [], []
    for i in range(args.rounds):
        ours.append(_engine_round(engine, args, rng, i))
        theirs.append(_llama_round(args, gguf))
    result: dict[str, Any] = {"bench": "peer", "model": args.model, "gguf": gguf, "rounds": args.rounds,
                              "input_len": args.input_len, "output_len": args.output_len,
                              "threads": torch.get_num_threads()}
    for j, phase in enumerate(("prefill", "decode")):
        result[f"{phase}_tokens_per_s"] = round(statistics.median(o[j] for o in ours), 2)
        result[f"llama_cpp_{phase}_tokens_per_s"] = round(statistics.median(t[j] for t in theirs), 2)
        result[f"{phase}_ratio"] = round(statistics.median(o[j] / t[j] for o, t in zip(ours, theirs, strict=True)), 3)
    return result

"""`python -m slotserve.bench.dev peer --llama-bench PATH`: the engine's single-request prefill and batch-1 decode
beside llama.cpp's `llama-bench` on the same GGUF, in alternating rounds (one engine round, one llama-bench run),
so that both see the same machine: on a shared VM the read rate moves by 1.5x within minutes, and figures taken
minutes apart compare the neighbours' load as much as the engines. Prints each side's medians and the median
of the rounds' ratios (engine over llama.cpp). A llama-bench that dies of an illegal instruction (llama.cpp's
repacked AMX GEMM does on some Xeons) is run again without repacking, and the figures say so."""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import subprocess
from dataclasses import dataclass, field
from typing import Any

import torch

from slotserve import model_store
from slotserve.bench.latency import random_prompt, timed_request
from slotserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("slotserve")
NO_REPACK = ["--repack", "0"]


class PeerError(RuntimeError):
    """llama-bench failed; the message has its exit status and the end of its output."""


def gguf_of(model: str) -> str:
    """The GGUF file behind the engine's `-m`: an alias's assembled file, or the path given."""
    alias = model_store.ALIASES.get(model)
    path = model_store.gguf_path(alias) if alias else model
    if not str(path).lower().endswith(".gguf") or not os.path.isfile(path):
        raise ValueError(f"--model {model!r}: the peer benchmark needs an alias or a .gguf file")
    return str(path)


@dataclass
class LlamaBench:
    """llama-bench on one GGUF, and the options it needed to run on this machine."""

    binary: str
    gguf: str
    extra: list[str] = field(default_factory=list)

    def round(self, input_len: int, output_len: int, threads: int) -> tuple[float, float]:
        """(prefill, decode) tokens/s of one run (`-r 1`)."""
        rate = self.rates(input_len, output_len, threads, 1)
        return rate["prefill"], rate["decode"]

    def rates(self, input_len: int, output_len: int, threads: int, repeats: int) -> dict[str, float]:
        """Tokens/s by phase ("prefill" where input_len, "decode" where output_len), averaged over `repeats`."""
        command = [self.binary, "-m", self.gguf, "-p", str(input_len), "-n", str(output_len), "-r", str(repeats),
                   "-t", str(threads), "-o", "json", *self.extra]
        done = subprocess.run(command, capture_output=True, text=True)
        # -SIGILL: the binary itself; 128 + SIGILL: through a shell.
        if done.returncode in (-signal.SIGILL, 128 + signal.SIGILL) and not self.extra:
            logger.warning("llama-bench died of an illegal instruction; running it again with %s", " ".join(NO_REPACK))
            self.extra = NO_REPACK
            return self.rates(input_len, output_len, threads, repeats)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip()[-500:]
            raise PeerError(f"{' '.join(command)} exited with {done.returncode}: {tail}")
        return {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in json.loads(done.stdout)}

    def config(self) -> dict[str, Any]:
        return {"repack": self.extra != NO_REPACK, "options": self.extra}


def _engine_round(engine: LLMEngine, args: argparse.Namespace, rng: random.Random, i: int) -> tuple[float, float]:
    prefill = timed_request(engine, f"prefill-{i}", random_prompt(rng, args.input_len), 1)[0]
    decode = timed_request(engine, f"decode-{i}", random_prompt(rng, 16), args.output_len)[1]
    return args.input_len / prefill, (args.output_len - 1) / decode


def run_peer(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    llama = LlamaBench(args.llama_bench, gguf_of(args.model))
    threads = torch.get_num_threads()
    rng = random.Random(0)
    _engine_round(engine, args, rng, -1)  # warm-up: first-call costs of both
    llama.round(args.input_len, args.output_len, threads)
    ours, theirs = [], []
    for i in range(args.rounds):
        ours.append(_engine_round(engine, args, rng, i))
        theirs.append(llama.round(args.input_len, args.output_len, threads))
    result: dict[str, Any] = {"bench": "peer", "model": args.model, "gguf": llama.gguf, "rounds": args.rounds,
                              "input_len": args.input_len, "output_len": args.output_len, "threads": threads,
                              "llama_cpp": llama.config()}
    for j, phase in enumerate(("prefill", "decode")):
        result[f"{phase}_tokens_per_s"] = round(statistics.median(o[j] for o in ours), 2)
        result[f"llama_cpp_{phase}_tokens_per_s"] = round(statistics.median(t[j] for t in theirs), 2)
        result[f"{phase}_ratio"] = round(statistics.median(o[j] / t[j] for o, t in zip(ours, theirs, strict=True)), 3)
    return result

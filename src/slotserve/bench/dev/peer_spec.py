"""`python -m slotserve.bench.dev peer-spec --llama-bin DIR --speculative-config JSON`: batch-1 speculative decode
beside llama.cpp's own on the same GGUF files and prompts (bench spec's code edits and free chat), alternating
per prompt (one engine request, one llama.cpp run). n-gram runs `llama-lookup`, a draft model
`llama-speculative -md` with the draft's GGUF; both greedy, the same number of proposals, the engine's thread
count. Prints each side's decode tokens/s (prefill left out on both) and the ratio, per prompt set.

llama.cpp's repacked weights crash llama-speculative on some CPUs (a Xeon with AMX here), so its runs use
`--no-repack`; a plain `llama-bench` figure (repacked where it runs) is printed beside them for scale."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
from typing import Any

import torch

from slotserve.bench.dev.peer import LlamaBench, PeerError, gguf_of
from slotserve.bench.spec import decode_run, prompt_sets
from slotserve.config import SpeculativeMethod
from slotserve.engine.llm_engine import LLMEngine
from slotserve.sampling_params import SamplingParams

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_ACCEPTED = re.compile(r"accept\s*=\s*([\d.]+)%")


def _llama_command(args: argparse.Namespace, engine: LLMEngine, prompt: str, threads: int) -> list[str]:
    spec = engine.config.speculative_config
    k = str(spec.num_speculative_tokens)
    common = ["-m", gguf_of(args.model), "-p", prompt, "-n", str(args.output_len), "--temp", "0",
              "-t", str(threads), "-c", "4096", "--spec-draft-n-max", k, "--no-repack"]
    if spec.method is SpeculativeMethod.NGRAM:
        return [os.path.join(args.llama_bin, "llama-lookup"), *common]
    return [os.path.join(args.llama_bin, "llama-speculative"), *common, "-md", gguf_of(spec.model),
            "-td", str(threads)]


def _llama_run(command: list[str]) -> tuple[float, float | None]:
    """(decode tokens/s, accepted share of proposals) of one llama.cpp run."""
    done = subprocess.run(command, capture_output=True, text=True)
    text = done.stdout + done.stderr
    decoded = _DECODED.search(text)
    if done.returncode != 0 or decoded is None:
        raise PeerError(f"{command[0]} exited with {done.returncode}: {text.strip()[-500:]}")
    accepted = _ACCEPTED.search(text)
    return float(decoded.group(3)), (float(accepted.group(1)) / 100 if accepted else None)


def run_peer_spec(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    spec = engine.config.speculative_config
    if spec is None:
        raise ValueError("speculative_config: peer-spec compares speculative decoding; pass --speculative-config")
    threads = torch.get_num_threads()
    plain = LlamaBench(os.path.join(args.llama_bin, "llama-bench"), gguf_of(args.model)).rates(
        0, args.output_len, threads, 3)["decode"]
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    result: dict[str, Any] = {"bench": "peer_spec", "model": args.model, "method": spec.method.value,
                              "draft": spec.model, "num_speculative_tokens": spec.num_speculative_tokens,
                              "output_len": args.output_len, "threads": threads,
                              "llama_cpp_plain_decode_tokens_per_s": round(plain, 2)}
    for name, prompts in prompt_sets(engine).items():
        ours, theirs, accepted = [], [], []
        decode_run(engine, [prompts[0][1]], params, 1)  # warm-up: the first request's one-off costs
        for text, ids in prompts[:args.num_prompts]:
            run = decode_run(engine, [ids], params, 1)
            ours.append(run.decoded / run.seconds)
            rate, share = _llama_run(_llama_command(args, engine, text, threads))
            theirs.append(rate)
            accepted.append(share)
        result[name] = {
            "decode_tokens_per_s": round(statistics.mean(ours), 2),
            "llama_cpp_decode_tokens_per_s": round(statistics.mean(theirs), 2),
            "llama_cpp_acceptance_rate": None if None in accepted else round(statistics.mean(accepted), 3),
            "ratio": round(statistics.median(o / t for o, t in zip(ours, theirs, strict=True)), 3),
        }
    return result

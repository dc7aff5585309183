"""`python -m slotserve.bench.dev {kernels,attention,threads,peer,peer-spec} [args]`: the developer benchmarks."""

from __future__ import annotations

import argparse
import json
import sys

from slotserve.bench.dev.threads import add_arguments as threads_args
from slotserve.entrypoints.engine_args import add_engine_args, make_llm, run_command


def cmd_dev_bench(args: argparse.Namespace) -> int:
    if args.bench == "kernels":
        from slotserve.bench.dev.kernels import run_kernels

        result = run_kernels(make_llm(args).engine, args)
    elif args.bench == "peer":
        from slotserve.bench.dev.peer import run_peer

        result = run_peer(make_llm(args).engine, args)
    elif args.bench == "peer-spec":
        from slotserve.bench.dev.peer_spec import run_peer_spec

        result = run_peer_spec(make_llm(args).engine, args)
    elif args.bench == "threads":
        from slotserve.bench.dev.threads import run_threads

        # Its --threads / --cpu-affinity are the counts and cores to measure; the engine starts on defaults.
        engine_args = argparse.Namespace(**{**vars(args), "threads": None, "cpu_affinity": None})
        result = run_threads(args, lambda: make_llm(engine_args).engine)
    else:
        from slotserve.bench.dev.attention import run_attention

        result = run_attention(args)
    print(json.dumps(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m slotserve.bench.dev",
                                     description="Developer benchmarks that print JSON figures.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    bench = parser.add_subparsers(dest="bench", required=True)
    b = bench.add_parser("attention", help="decode attention over the paged cache: ways of reading it")
    b.add_argument("--num-seqs", type=int, default=16)
    b.add_argument("--context-len", type=int, default=750)
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--num-heads", type=int, default=16)
    b.add_argument("--num-kv-heads", type=int, default=8)
    b.add_argument("--head-dim", type=int, default=128)
    b.add_argument("--repeats", type=int, default=20)
    b = bench.add_parser("kernels", help="machine limits (bandwidth, GEMM) and the engine's speed against them")
    b.add_argument("--prefill-len", type=int, default=512)
    b.add_argument("--batch", type=int, default=32, help="sequences in the batched decode step")
    b.add_argument("--context-len", type=int, default=256, help="context of each sequence in the batched decode")
    b.add_argument("--decode-steps", type=int, default=16)
    b.add_argument("--repeats", type=int, default=3)
    add_engine_args(b)
    b = bench.add_parser("peer", help="prefill and batch-1 decode beside llama.cpp's llama-bench, alternating")
    b.add_argument("--llama-bench", required=True, help="the llama-bench binary")
    b.add_argument("--input-len", type=int, default=512)
    b.add_argument("--output-len", type=int, default=64)
    b.add_argument("--rounds", type=int, default=5)
    add_engine_args(b)
    b = bench.add_parser("peer-spec", help="batch-1 speculative decode beside llama-lookup / llama-speculative")
    b.add_argument("--llama-bin", required=True, help="the directory of llama.cpp's built binaries")
    b.add_argument("--num-prompts", type=int, default=4, help="of each set (code edits, free chat)")
    b.add_argument("--output-len", type=int, default=128)
    add_engine_args(b)
    b = bench.add_parser("threads", help="parfor pool: dispatch cost vs ThreadPoolExecutor, matmul on 1..N threads")
    threads_args(b)
    add_engine_args(b, cpu_options=False)
    parser.set_defaults(func=cmd_dev_bench)
    return parser


if __name__ == "__main__":
    sys.exit(run_command(build_parser()))

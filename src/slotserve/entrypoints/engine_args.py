"""The engine's command-line options, shared by `slotserve` and `python -m slotserve.bench.dev`: the options, the
engine configuration and `LLM` they make, and the runner of a command line. Torch-free at import (the engine's
modules load inside the functions), so that `--help` answers at once."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable


def add_engine_args(p: argparse.ArgumentParser, cpu_options: bool = True) -> None:
    from slotserve.model_store import DEFAULT_MODEL
    from slotserve.parallel.threadpool import parse_cpu_list

    g = p.add_argument_group("model and engine")
    g.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"an alias (see `slotserve models`), a Hugging Face directory or a .gguf file "
                        f"(default: {DEFAULT_MODEL})")
    g.add_argument("--dtype", default="auto",
                   help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--max-model-len", type=int, default=None, help="context length limit (prompt + output)")
    g.add_argument("--kv-cache-memory", type=parse_size, default=None, help="KV cache size, e.g. 512M or 2G")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=1024,
                   help="tokens computed per step; longer prompts are prefilled in chunks")
    g.add_argument("--no-prefix-caching", action="store_true", help="do not reuse cached prompt prefixes")
    g.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="the prefix cache's disk tier: evicted and saved KV blocks are kept as files here and read "
                        "back on a prefix hit, also after a restart with the same model (docs/kv_offload.md)")
    g.add_argument("--kv-offload-bytes", type=parse_size, default=8 << 30,
                   help="the most the disk tier's files take, e.g. 20G; the least recently used go first "
                        "(default 8G)")
    g.add_argument("--task", default="auto", choices=["auto", "generate", "embed"],
                   help="embed: serve embeddings (last-token pooling); auto: embed for embedding checkpoints")
    g.add_argument("--quantization", default=None, choices=["int8", "q8_0"],
                   help="int8: dynamically quantized int8 linear layers; q8_0: a float checkpoint's linear and "
                        "embedding weights as GGUF Q8_0 blocks, quantized as they load, a quarter of float32's "
                        "memory (CPU, float32; faster decode, slightly different output)")
    g.add_argument("--prefill-precision", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="what a GGUF model's prefill and a bfloat16 checkpoint's vision tower multiply in; auto: "
                        "bfloat16 where the CPU has bfloat16 dot products (AMX, AVX512-BF16), else float32 (the "
                        "weights' exact values)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}\'')
    g = p.add_argument_group("parallel (one model over several ranks)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks to split the model over (heads, MLP width, vocabulary); default 1")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="serve: replicas of the whole engine behind one front end, each on its share of the cores "
                        "(with --distributed-executor-backend ray, on the machines of a Ray cluster); default 1")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE: split the experts across the ranks instead of splitting each expert")
    g.add_argument("--expert-comm", default="all-to-all", choices=["all-to-all", "all-gather"],
                   help="how expert parallel moves tokens to their experts' ranks (default all-to-all)")
    g.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                   help="mp: worker processes on this machine (the default); ray: Ray actors (the ranks, or the "
                        "data-parallel replicas), on any machines of a Ray cluster (RAY_ADDRESS; pip install "
                        "'slotserve[ray]')")
    g.add_argument("--distributed-timeout", type=float, default=120.0,
                   help="seconds a collective or a worker may take before the engine gives up (default 120)")
    g.add_argument("--ubatches", type=int, default=1,
                   help="micro-batch overlap: run a large step as N micro-batches, one computing while another's "
                        "collectives travel (N >= 2; default 1: off)")
    g.add_argument("--ubatch-decode-threshold", type=int, default=32,
                   help="decode-only steps of fewer tokens are not split (default 32)")
    g.add_argument("--ubatch-prefill-threshold", type=int, default=512,
                   help="other steps of fewer tokens are not split (default 512)")
    g.add_argument("--ubatch-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="split only the kinds of steps measured to run faster split (default on)")
    g = p.add_argument_group("images (vision-language models)")
    g.add_argument("--limit-mm-per-prompt", type=int, default=4, help="most images one prompt may carry (default 4)")
    g.add_argument("--image-min-pixels", type=int, default=None,
                   help="resize smaller images up to this many pixels (default: the model's preprocessor config)")
    g.add_argument("--image-max-pixels", type=int, default=None,
                   help="resize larger images down to this many pixels (default: the model's preprocessor config)")
    if cpu_options:
        g = p.add_argument_group("CPU")
        g.add_argument("--threads", type=int, default=None,
                       help="CPU threads for torch and the thread pool, per rank (default: SLOTSERVE_THREADS, else the "
                            "cores this process may use)")
        g.add_argument("--cpu-affinity", type=_cpu_list(parse_cpu_list), default=None,
                       help="run on these cores only, one pool worker pinned to each, e.g. 0-3 or 0,2")


def _cpu_list(parse: Callable[[str], list[int]]) -> Callable[[str], tuple[int, ...]]:
    def parse_arg(text: str) -> tuple[int, ...]:
        try:
            return tuple(parse(text))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse_arg


def parse_size(text: str) -> int:
    """A byte count written as 512M, 2G, 64k or a plain integer."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G)") from None


def engine_config(args: argparse.Namespace):
    from slotserve.config import EngineConfig

    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                        kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=not args.no_prefix_caching, task=args.task,
                        quantization=args.quantization, prefill_precision=args.prefill_precision,
                        threads=args.threads, cpu_affinity=args.cpu_affinity,
                        tensor_parallel_size=args.tensor_parallel_size,
                        data_parallel_size=args.data_parallel_size,
                        enable_expert_parallel=args.enable_expert_parallel, expert_comm=args.expert_comm,
                        distributed_executor_backend=args.distributed_executor_backend,
                        distributed_timeout=args.distributed_timeout, ubatches=args.ubatches,
                        ubatch_decode_threshold=args.ubatch_decode_threshold,
                        ubatch_prefill_threshold=args.ubatch_prefill_threshold,
                        ubatch_adaptive=args.ubatch_adaptive,
                        limit_mm_per_prompt=args.limit_mm_per_prompt, image_min_pixels=args.image_min_pixels,
                        image_max_pixels=args.image_max_pixels, speculative_config=args.speculative_config,
                        kv_offload_dir=args.kv_offload_dir, kv_offload_bytes=args.kv_offload_bytes)


def make_llm(args: argparse.Namespace):
    from slotserve.entrypoints.llm import LLM

    return LLM.from_config(engine_config(args))


def run_command(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Runs the command line `argv` (default: sys.argv) as `parser` reads it: each command is its `func`; a
    ValueError or OSError is one line on stderr and exit status 2."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:
        print(f"slotserve: error: {e}", file=sys.stderr)
        return 2

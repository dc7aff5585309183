"""The `slotserve` command: generate, chat, serve, models, bench (the developer benchmarks are
`python -m slotserve.bench.dev`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

_STARTED = time.perf_counter()

# Torch-free imports, after _STARTED: the start of `bench latency`'s "time to first token".
from slotserve import envs  # noqa: E402
from slotserve.bench.kv_restore import add_arguments as kv_restore_args  # noqa: E402
from slotserve.bench.quality import add_arguments as quality_args  # noqa: E402
from slotserve.bench.replicas import add_arguments as replicas_bench_args  # noqa: E402
from slotserve.bench.serve import add_arguments as serve_bench_args  # noqa: E402
from slotserve.entrypoints.engine_args import (  # noqa: E402
    add_engine_args,
    engine_config,
    make_llm,
    parse_size,
    run_command,
)


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int | None) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    g.add_argument("--top-p", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=20, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.05)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampling for reproducible output")


def _chat_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("chat")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--chat-template-kwargs", default=None, help='JSON, e.g. \'{"enable_thinking": false}\'')
    g.add_argument("--no-think", action="store_true", help="Qwen3: disable thinking (enable_thinking=false)")


def _params(args: argparse.Namespace):
    from slotserve.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens, stop=args.stop, seed=args.seed,
    )


def _template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    if args.no_think:
        kwargs["enable_thinking"] = False
    return kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    llm = make_llm(args)
    images = [Path(path) for path in args.image or []]
    prompt = {"prompt": args.prompt, "multi_modal_data": {"image": images}} if images else args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        content = [*({"type": "image", "image": image} for image in images), {"type": "text", "text": args.prompt}]
        prompt = llm.render_chat([*messages, {"role": "user", "content": content}], _template_kwargs(args))
    for piece in llm.stream(prompt, _params(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = make_llm(args)
    params = _params(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("Chatting with", args.model, "- /exit to quit, /reset to forget the conversation.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        prompt = llm.render_chat(history, _template_kwargs(args))
        reply = []
        try:
            for piece in llm.stream(prompt, params):
                reply.append(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass  # stop this reply, keep the conversation
        except ValueError as e:  # e.g. the conversation outgrew the context
            print(f"\nerror: {e}", file=sys.stderr)
            history.pop()
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from slotserve.engine.async_llm import EngineStartError
    from slotserve.entrypoints.openai.api_server import ServerSettings, serve
    from slotserve.entrypoints.openai.limits import RequestLimits
    from slotserve.entrypoints.openai.reasoning import ReasoningParserKind

    if args.model_positional:
        args.model = args.model_positional
    config = dataclasses.replace(engine_config(args), stall_timeout=args.stall_timeout)
    settings = ServerSettings(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or envs.api_key(),
        max_queued_requests=args.max_queued_requests,
        limits=RequestLimits(max_body_bytes=args.max_request_bytes, max_n=args.max_n, max_stop=args.max_stop,
                             max_logit_bias=args.max_logit_bias, allow_image_urls=args.allow_image_urls,
                             image_fetch_timeout=args.image_fetch_timeout, max_image_bytes=args.max_image_bytes),
        log_interval=args.log_interval,
        engine_death_exit_delay=args.engine_death_exit_delay,
        reasoning_parser=ReasoningParserKind(args.reasoning_parser) if args.reasoning_parser else None,
        # The snapshot shows code paths and queue contents: on for a server only this machine reaches.
        debug_endpoints=args.debug_endpoints == "on" or (args.debug_endpoints == "auto"
                                                         and args.host in ("127.0.0.1", "localhost", "::1")),
    )

    try:
        return asyncio.run(serve(config, settings, args.host, args.port, args.log_level, args.shutdown_timeout))
    except EngineStartError as e:
        print(f"slotserve: error: {e}", file=sys.stderr)
        return 2


def cmd_top(args: argparse.Namespace) -> int:
    from slotserve.entrypoints.top import run_top

    try:
        return run_top(args)
    except KeyboardInterrupt:
        return 0


def cmd_models(args: argparse.Namespace) -> int:
    from slotserve.model_store import list_models

    rows = list_models()
    if args.json:
        print(json.dumps([vars(r) for r in rows], default=str))
        return 0
    print(f"cache: {envs.cache_dir()}")
    print(f"{'alias':30} {'size':>9}  {'installed':9}  {'ready':5}  description")
    for r in rows:
        name = r.alias + (" (default)" if r.is_default else "")
        print(f"{name:30} {r.size / 1e6:7.0f}MB  {'yes' if r.installed else 'no':9}  "
              f"{'yes' if r.converted else 'no':5}  {r.description}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "latency":
        from slotserve.bench.latency import run_latency

        result = run_latency(make_llm, args, started=_STARTED)
    elif args.bench == "embed":
        from slotserve.bench.embed import run_embed

        args.task = "embed"
        result = run_embed(make_llm(args).engine, args)
    elif args.bench == "parallel":
        from slotserve.bench.parallel import run_parallel

        result = run_parallel(make_llm, args)
    elif args.bench == "ubatch":
        from slotserve.bench.ubatch import run_ubatch

        result = run_ubatch(make_llm, args)
    elif args.bench == "structured":
        from slotserve.bench.structured import run_structured

        result = run_structured(make_llm(args).engine, args)
    elif args.bench == "vision":
        from slotserve.bench.vision import run_vision

        result = run_vision(args)
    elif args.bench == "quality":
        from slotserve.bench.quality import run_quality

        result = run_quality(engine_config(args), args)
    elif args.bench == "spec":
        from slotserve.bench.spec import run_spec

        result = run_spec(make_llm(args).engine, args)
    elif args.bench == "replicas":
        from slotserve.bench.replicas import run_replicas

        result = run_replicas(args)
    elif args.bench == "kv-restore":
        from slotserve.bench.kv_restore import run_kv_restore

        result = run_kv_restore(engine_config(args), args)
    elif args.bench == "serve":
        from slotserve.bench.serve import run_serve_bench

        result = run_serve_bench(args)
    else:
        from slotserve.bench.throughput import run_throughput

        result = run_throughput(make_llm(args).engine, args)
    print(json.dumps(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotserve", description="Run Qwen models: generate, chat, benchmark.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete one prompt and print it as it is generated")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image for a vision-language model (repeatable), before the prompt's text")
    _chat_args(p)
    add_engine_args(p)
    _sampling_args(p, max_tokens=256)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal (streams replies, keeps the conversation)")
    _chat_args(p)
    add_engine_args(p)
    _sampling_args(p, max_tokens=1024)
    p.set_defaults(func=cmd_chat)

    from slotserve.entrypoints.openai.limits import RequestLimits

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (engine core in its own process)")
    p.add_argument("model_positional", nargs="?", metavar="MODEL", help="same as --model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or SLOTSERVE_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: --model)")
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between stats lines (0: off)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run on after SIGTERM/SIGINT; then they end with an error")
    p.add_argument("--engine-death-exit-delay", type=float, default=5.0,
                   help="seconds the server answers 503 after its engine died, before it exits with code 1")
    g = p.add_argument_group("request limits")
    limits = RequestLimits()
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="sequences in flight (n of each prompt) beyond which new requests get 503 (default: no limit)")
    g.add_argument("--max-request-bytes", type=parse_size, default=limits.max_body_bytes,
                   help=f"largest request body; larger ones get 413 (default {limits.max_body_bytes >> 20}M)")
    g.add_argument("--max-n", type=int, default=limits.max_n,
                   help=f"most sequences one request may start: n times its prompts (default {limits.max_n})")
    g.add_argument("--max-stop", type=int, default=limits.max_stop,
                   help=f"most stop strings, and most stop token ids, per request (default {limits.max_stop})")
    g.add_argument("--max-logit-bias", type=int, default=limits.max_logit_bias,
                   help=f"most logit_bias entries per request (default {limits.max_logit_bias})")
    p.add_argument("--debug-endpoints", default="auto", choices=["auto", "on", "off"],
                   help="GET /debug/engine: threads, stacks, queues, steps (auto: on for a loopback --host)")
    p.add_argument("--stall-timeout", type=float, default=300.0,
                   help="seconds the core loop may have work without finishing a step before the watchdog reports it")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3"],
                   help="put what the model writes inside <think>...</think> into reasoning_content")
    g.add_argument("--allow-image-urls", action="store_true",
                   help="fetch images given by http(s) URL (default: data: URLs only)")
    g.add_argument("--image-fetch-timeout", type=float, default=limits.image_fetch_timeout,
                   help=f"seconds one image's download may take (default {limits.image_fetch_timeout:g})")
    g.add_argument("--max-image-bytes", type=parse_size, default=limits.max_image_bytes,
                   help=f"largest image download (default {limits.max_image_bytes >> 20}M)")
    add_engine_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("top", help="a running server's engine threads, queues and steps, refreshed each second")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one view and exit")
    p.set_defaults(func=cmd_top)

    p = sub.add_parser("models", help="list the model aliases and whether each is installed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("bench", help="benchmarks that print JSON figures")
    bench = p.add_subparsers(dest="bench", required=True)
    b = bench.add_parser("latency", help="load time, time to first token, prefill and decode tokens/s")
    b.add_argument("--input-len", type=int, default=512, help="prompt tokens for the prefill figure")
    b.add_argument("--output-len", type=int, default=128, help="tokens decoded for the decode figure")
    b.add_argument("--repeats", type=int, default=3, help="runs of each measurement; the median is reported")
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("parallel", help="the same steps on 1 rank and on --tensor-parallel-size ranks (default 2)")
    b.add_argument("--input-len", type=int, default=256, help="prompt tokens of the prefill, and the decode context")
    b.add_argument("--batch", type=int, default=8, help="decode rows of the batched decode step")
    b.add_argument("--repeats", type=int, default=5, help="timed steps of each kind; the median is reported")
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("ubatch", help="micro-batch overlap: steps with and without it, the communication it hides, "
                                        "over the real collectives and with an injected latency; a Chrome trace")
    b.add_argument("--input-len", type=int, default=256, help="prompt tokens per sequence of the prefill step")
    b.add_argument("--prefill-batch", type=int, default=2, help="sequences of the prefill step (default 2)")
    b.add_argument("--decode-batch", type=int, default=32, help="rows of the decode step (default 32)")
    b.add_argument("--decode-context", type=int, default=64, help="tokens of context of each decode row")
    b.add_argument("--repeats", type=int, default=3, help="timed steps of each kind and mode; the median is reported")
    b.add_argument("--latency-ms", type=float, default=2.0, help="latency added to each collective in the "
                                                                 "injected_latency section (default 2)")
    b.add_argument("--trace", default="ubatch-trace.json",
                   help="Chrome trace of the real section; the injected one's gets '-injected' before the suffix")
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("embed", help="embeddings per second for a batch of sentences (task embed)")
    b.add_argument("--num-sentences", type=int, default=64)
    b.add_argument("--words", type=int, default=16, help="words per random sentence")
    b.add_argument("--seed", type=int, default=0)
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("structured", help="structured outputs: the decode step with none, one and all requests "
                                            "under a JSON schema, the masks' time, schema compile time")
    b.add_argument("--batch", type=int, default=32, help="requests in the decode batch")
    b.add_argument("--input-len", type=int, default=32, help="prompt tokens of each request")
    b.add_argument("--steps", type=int, default=16, help="decode steps timed per setting; the median is reported")
    b.add_argument("--schemas", type=int, default=5, help="new schemas compiled for the compile figure")
    b.add_argument("--repeats", type=int, default=10, help="timed runs of the masks")
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("vision", help="Qwen3-VL: images/s through the vision tower and time to first token with "
                                        "one image, also with the tower in float32, beside transformers")
    b.add_argument("--model", "-m", default=None, help="a Qwen3-VL directory (default: a random model of --shape)")
    b.add_argument("--shape", default="qwen3-vl-2b", choices=["qwen3-vl-2b", "qwen3-vl-8b"],
                   help="the published model whose shapes the random model takes")
    b.add_argument("--text-layers", type=int, default=4, help="text layers of the random model (2B: 28, 8B: 36)")
    b.add_argument("--image-size", type=int, default=448, help="side of the square test images, in pixels")
    b.add_argument("--images", type=int, default=4, help="images per timed call of the vision tower")
    b.add_argument("--repeats", type=int, default=3, help="timed runs of each measurement; the median is reported")
    b.add_argument("--prefill-precision", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="the engine's (see serve --help); bfloat16 puts even a float32 checkpoint's tower in bfloat16")
    b.add_argument("--quantization", default=None, choices=["q8_0"],
                   help="q8_0: the text model's weights as Q8_0 blocks (what lets an 8B one fit in 24 GB)")
    b.add_argument("--no-transformers", action="store_true", help="time slotserve alone")
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("quality", help="the engine as configured against the model's float32 reference: "
                                         "perplexity, greedy agreement, decode speed")
    quality_args(b)
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("spec", help="speculative decoding (--speculative-config): decode tokens/s with and without "
                                      "it, at batch 1 and several clients, on code edits and on free chat")
    b.add_argument("--output-len", type=int, default=128, help="most tokens per answer (greedy; EOS ends it)")
    b.add_argument("--num-prompts", type=int, default=8, help="prompts of each kind (at most 8)")
    b.add_argument("--clients", type=int, nargs="+", default=[8], help="requests at once, besides 1 (default 8)")
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("kv-restore", help="time to first token of a long prompt computed, and restored from the KV "
                                            "disk tier after a restart of the engine; their ratio")
    kv_restore_args(b)
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("serve", help="load a running server: request throughput, TTFT, TPOT, ITL")
    serve_bench_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("replicas", help="one server against --data-parallel-size replicas on the same cores, "
                                          "the same load in alternating rounds; output tokens/s and their ratio")
    replicas_bench_args(b)
    b.set_defaults(func=cmd_bench)
    b = bench.add_parser("throughput", help="many requests at once vs one at a time; output tokens/s")
    b.add_argument("--num-prompts", type=int, default=32, help="requests in the batched run")
    b.add_argument("--input-len", type=int, default=128, help="prompt tokens of each random prompt")
    b.add_argument("--output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    b.add_argument("--baseline-prompts", type=int, default=4, help="requests timed one at a time")
    b.add_argument("--prompts-file", default=None, help="text file, one prompt per line, instead of random ones")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    b.add_argument("--compare-transformers", action="store_true",
                   help="also time Hugging Face generate on the same prompts in one padded batch")
    b.add_argument("--rounds", type=int, default=1,
                   help="with --compare-transformers: pairs of runs (fresh prompts each), median speed-up reported")
    add_engine_args(b)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())

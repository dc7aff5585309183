"""`slotserve bench spec`: decode with and without speculative decoding on one loaded engine, at batch 1 and with
several clients at once, on code-editing prompts (the answer repeats the prompt's code) and on free chat; each
twice, in the order without, with, with, without. Greedy, so every run must give the same tokens (reported as
`same_tokens`)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

from slotserve.engine.llm_engine import LLMEngine
from slotserve.sampling_params import SamplingParams

_CODE = '''def parse_records(lines):
    records = []
    for index, line in enumerate(lines):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(",")
        if len(fields) != 4:
            raise ValueError(f"line {index}: expected 4 fields, got {len(fields)}")
        name, age, city, email = (field.strip() for field in fields)
        records.append({"name": name, "age": int(age), "city": city, "email": email})
    return records


def summarize(records):
    by_city = {}
    for record in records:
        by_city.setdefault(record["city"], []).append(record["age"])
    return {city: sum(ages) / len(ages) for city, ages in by_city.items()}
'''

CODE_EDITS = [
    "Rename the variable `records` to `rows` everywhere. Reply with the whole code only.",
    "Add type hints to both functions. Reply with the whole code only.",
    "Rename `summarize` to `average_age_by_city`. Reply with the whole code only.",
    "Make `parse_records` skip lines that start with `//` as well as `#`. Reply with the whole code only.",
    "Add a docstring to each function. Reply with the whole code only.",
    "Change the error message to say 'bad line' instead of 'line'. Reply with the whole code only.",
    "Replace the dict in `summarize` with a collections.defaultdict. Reply with the whole code only.",
    "Make the email field lowercase when it is stored. Reply with the whole code only.",
]

CHAT = [
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works to a new programmer.",
    "What are three good habits for writing maintainable software? Explain each.",
    "Describe the water cycle in a few paragraphs.",
    "Write a friendly email inviting a colleague to a code review session.",
    "Why is the sky blue? Give a clear explanation.",
    "Compare Python lists and tuples, with examples of when to use each.",
    "Give me a plan for learning to cook simple meals in a month.",
]


@dataclass
class Run:
    tokens: dict[str, list[int]]
    seconds: float  # of each round from its last first token on (decode), summed
    decoded: int  # tokens in those seconds


def run_spec(engine: LLMEngine, args: argparse.Namespace) -> dict[str, Any]:
    if engine.config.speculative_config is None:
        raise ValueError("speculative_config: bench spec compares decoding with it and without; pass "
                         "--speculative-config")
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    sets = {name: [ids for _, ids in prompts] for name, prompts in prompt_sets(engine).items()}
    decode_run(engine, sets["chat"][:1], params, 1)  # warm-up: threads, caches and kernels
    result: dict[str, Any] = {"bench": "spec", "model": engine.config.model,
                              "speculative_config": _config(engine), "output_len": args.output_len}
    for name, prompts in sets.items():
        prompts = prompts[:args.num_prompts]
        for clients in sorted({1, *args.clients}):
            row: dict[str, Any] = {}
            runs: dict[bool, list[Run]] = {False: [], True: []}
            batch = [prompts[i % len(prompts)] for i in range(max(len(prompts), clients))]  # repeated to fill it
            before = engine.stats().speculation
            for on in (False, True, True, False):  # the machine's drift weighs on both alike
                engine.core.speculate(on)
                runs[on].append(decode_run(engine, prompts if clients == 1 else batch, params, clients))
            after = engine.stats().speculation
            for on in (False, True):
                rate = sum(r.decoded for r in runs[on]) / sum(r.seconds for r in runs[on])
                row["spec" if on else "plain"] = {"decode_tokens_per_s": round(rate, 2)}
            proposed, accepted = after.proposed - before.proposed, after.accepted - before.accepted
            verified = after.verified - before.verified
            row["spec"]["acceptance_rate"] = round(accepted / proposed, 3) if proposed else 0.0
            row["spec"]["mean_accepted_length"] = round(1 + accepted / verified, 3) if verified else 0.0
            row["speedup"] = round(row["spec"]["decode_tokens_per_s"] / row["plain"]["decode_tokens_per_s"], 3)
            row["same_tokens"] = all(r.tokens == runs[False][0].tokens for r in runs[False] + runs[True])
            result[f"{name}_clients_{clients}"] = row
    engine.core.speculate(True)
    return result


def prompt_sets(engine: LLMEngine) -> dict[str, list[tuple[str, list[int]]]]:
    """Each prompt set's prompts as chat-templated text and its token ids."""
    asks = {"code_edit": [f"```python\n{_CODE}```\n\n{ask}" for ask in CODE_EDITS], "chat": CHAT}
    sets = {}
    for name, texts in asks.items():
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        sets[name] = [(p, engine.tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    return sets


def _config(engine: LLMEngine) -> dict[str, Any]:
    spec = engine.config.speculative_config
    return {"method": spec.method.value, "num_speculative_tokens": spec.num_speculative_tokens, "model": spec.model}


def decode_run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, clients: int) -> Run:
    """The prompts, `clients` at a time (each round waits for its slowest); decode time counts from each round's
    last first token, so prefill is left out of the figure."""
    tokens: dict[str, list[int]] = {}
    seconds, decoded = 0.0, 0
    for start in range(0, len(prompts), clients):
        ids = [f"spec-{start + i}" for i in range(len(prompts[start:start + clients]))]
        for request_id, prompt in zip(ids, prompts[start:start + clients], strict=True):
            engine.add_request(request_id, prompt, params)
        latest: dict[str, int] = {}
        began, at_start = None, {}
        while len(tokens) < start + len(ids):
            for out in engine.step():
                latest[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
            if began is None and len(latest) == len(ids):
                began, at_start = time.perf_counter(), dict(latest)
        seconds += time.perf_counter() - began
        decoded += sum(len(tokens[r]) - at_start[r] for r in ids)
    return Run(tokens, seconds, decoded)

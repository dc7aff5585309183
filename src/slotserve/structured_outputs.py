"""Constrained decoding: a request's `StructuredOutputsParams` become a grammar that llguidance matches token
by token; at each step the tokens the grammar does not allow next are masked out of the request's logits row.

llguidance, not xgrammar: it is one self-contained wheel with no Python dependencies, where xgrammar pulls in
transformers and triton. Both are fast enough here: with either, a step's mask costs a fraction of writing it
into a logits row, and a new schema compiles in milliseconds.

Grammars compile on a thread of their own (`GrammarCompiler`), once per distinct constraint: each request gets a
copy of the compiled matcher. A request whose grammar is not ready yet waits, while others run.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import numpy as np
import torch

from slotserve.sampling_params import StructuredOutputsParams

# JSON as small models write it best: no free whitespace between tokens, which a weak model can fill forever.
_JSON_OPTIONS = {"whitespace_flexible": False}
_CACHED_GRAMMARS = 256
# What a schema leaves unbounded, bounded (as llama.cpp's JSON grammars bound numbers): at a temperature a small
# model can go on writing one string or number until max_tokens. Numbers: 16 integer digits and 10 decimals,
# no exponent (llguidance bounds digits only through a range and a step). Strings: a few paragraphs, so that a
# description is not cut (the model would start another key and write it again).
STRING_MAX_LENGTH = 2048
INTEGER_BOUND = 10**16 - 1
NUMBER_BOUND = 1e16  # exclusive
NUMBER_STEP = 1e-10  # llguidance takes no finer step: it reads the float's decimal digits
# json_object: an object of any values, bounded as above.
_ANY_VALUE = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
                        {"type": "array", "items": {"$ref": "#/$defs/value"}},
                        {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}}]}
_JSON_OBJECT = {"$defs": {"value": _ANY_VALUE}, "type": "object", "additionalProperties": {"$ref": "#/$defs/value"}}
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


class GrammarError(ValueError):
    """A constraint that is not a valid schema, regex or grammar; the message says what is wrong."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    try:
        if params.json is not None:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            return llguidance.LLMatcher.grammar_from_json_schema(bounded(schema), defaults=_JSON_OPTIONS)
        if params.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema(bounded(_JSON_OBJECT), defaults=_JSON_OPTIONS)
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            return llguidance.grammar_from("choice", params.choice)
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as e:  # not JSON, or a GBNF grammar that does not convert
        raise GrammarError(f"structured_outputs: {e}") from None


def bounded(schema: object) -> object:
    """A copy of a JSON schema whose strings, integers and numbers are bounded where the schema leaves them
    open: strings to `STRING_MAX_LENGTH` characters, integers and numbers as above. What the schema says is
    kept, and a bound that would leave no value is not added."""
    schema = copy.deepcopy(schema)
    _bound(schema)
    return schema


def _bound(schema: object) -> None:
    if not isinstance(schema, dict):
        return
    types = schema.get("type", [])
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    free = not {"enum", "const"} & schema.keys()
    open_string = free and "string" in types and not {"maxLength", "pattern", "format"} & schema.keys()
    if open_string and schema.get("minLength", 0) <= STRING_MAX_LENGTH:
        schema["maxLength"] = STRING_MAX_LENGTH
    if free and types & {"integer", "number"}:
        bound = NUMBER_BOUND if "number" in types else INTEGER_BOUND
        lowest = schema.get("minimum", schema.get("exclusiveMinimum"))
        highest = schema.get("maximum", schema.get("exclusiveMaximum"))
        if lowest is None and (highest is None or (_number(highest) and highest > -bound)):
            schema["exclusiveMinimum" if "number" in types else "minimum"] = -bound
        if highest is None and (lowest is None or (_number(lowest) and lowest < bound)):
            schema["exclusiveMaximum" if "number" in types else "maximum"] = bound
        if "number" in types and "multipleOf" not in schema:
            schema["multipleOf"] = NUMBER_STEP
    for key in _SUBSCHEMAS:
        _bound(schema.get(key))
    for key in _SUBSCHEMA_LISTS:
        for sub in schema.get(key) if isinstance(schema.get(key), list) else []:
            _bound(sub)
    for key in _SUBSCHEMA_MAPS:
        for sub in schema.get(key).values() if isinstance(schema.get(key), dict) else []:
            _bound(sub)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check(params: StructuredOutputsParams) -> None:
    """GrammarError (a ValueError) naming the problem where the constraint cannot compile; cheap, no tokenizer."""
    error = llguidance.LLMatcher.validate_grammar(grammar_text(params))
    if error:
        raise GrammarError(f"structured_outputs: {_field(params)}: {_one_line(error)}")


def _one_line(error: str) -> str:
    """llguidance's message, which draws carets under the grammar over several lines, as one line."""
    return " ".join(line.strip() for line in error.splitlines() if line.strip())


def _field(params: StructuredOutputsParams) -> str:
    return next(name for name in ("json", "regex", "choice", "grammar") if getattr(params, name) is not None) \
        if not params.json_object else "json_object"


def _key(params: StructuredOutputsParams) -> str:
    """One constraint's identity, for the cache: equal schemas written with their keys in another order are one."""
    return json.dumps([params.json, params.json_object, params.regex, params.choice, params.grammar], sort_keys=True)


class GrammarCompiler:
    """Compiles constraints off the core loop, for one model's tokenizer; keeps the last few hundred compiled."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._tokenizer_args = (tokenizer_file, vocab_size, eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled matcher (GrammarError where it does not compile); the same one for equal
        constraints. Copy it (`deep_copy`) for each request."""
        key = _key(params)
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._pool.submit(self._compile, params)
                if len(self._compiled) > _CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
            return future

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        if self._tokenizer is None:  # about a second for a 150k vocabulary: once, and not before it is needed
            file, vocab, eos = self._tokenizer_args
            self._tokenizer = llguidance.LLTokenizer(file.read_text(), n_vocab=vocab, eos_token=eos)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"structured_outputs: {_field(params)}: {_one_line(matcher.get_error())}")
        return matcher

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Grammar:
    """One request's place in its grammar: which tokens may come next, and the tokens so far."""

    def __init__(self, compiled: Future) -> None:
        self._compiled, self.matcher = compiled, None
        self.error: str | None = None  # why it failed to compile

    def ready(self) -> bool:
        """Whether the grammar's compile has ended (see `error` for one that failed)."""
        if self.matcher is None and self.error is None and self._compiled.done():
            try:
                self.matcher = self._compiled.result().deep_copy()
            except GrammarError as e:
                self.error = str(e)
        return self.matcher is not None or self.error is not None

    def accept(self, token_id: int) -> None:
        """Once the output is complete the grammar allows only EOS, which ends the request as EOS always does."""
        self.matcher.consume_token(token_id)


def mask_(logits: torch.Tensor, rows: list[int], grammars: list[Grammar]) -> None:
    """Sets to -inf, in place, every token of `logits[rows[i]]` that `grammars[i]` does not allow next."""
    width = logits.shape[1]
    words = np.stack([np.frombuffer(g.matcher.compute_bitmask(), dtype=np.uint8) for g in grammars])
    # Bit j of little-endian 32-bit word w is token 32w + j: in byte order, least significant bit first.
    banned = np.unpackbits(words, axis=1, bitorder="little")[:, :width] == 0
    if logits.device.type == "cpu" and logits.is_contiguous():
        # In place through numpy: a fifth of the time of torch's masked fill of an indexed row (0.4 ms a row).
        values = logits.numpy()
        for i, row in enumerate(rows):
            np.copyto(values[row], -np.inf, where=banned[i])
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(torch.from_numpy(banned).to(logits.device), float("-inf"))

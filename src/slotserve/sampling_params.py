"""Per-request decoding settings, with vLLM's names, defaults and meanings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Temperatures below this are treated as greedy: dividing logits by a tiny number overflows.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's names): exactly one of a JSON schema, any JSON object,
    a regular expression, a choice of strings, or a grammar (Lark, or llama.cpp's GBNF)."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError("structured_outputs: give exactly one of json, json_object, regex, choice, grammar"
                             + (f" (got {', '.join(given)})" if given else ""))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object: must be a bool, got {self.json_object!r}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise ValueError("structured_outputs.json: must be a JSON schema (an object, or its text)")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name}: must be a string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of strings")


@dataclass
class SamplingParams:
    """How to sample one request. Validated on construction; a bad value raises ValueError naming the field.

    After construction `stop` and `stop_token_ids` are always lists and `top_k` is 0 when disabled.
    """

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16  # None = up to the context limit
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to return per sampled token; 0 = the sampled one only
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (structured_outputs.py)

    def __post_init__(self) -> None:
        _check_int("n", self.n, lo=1)
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=-1)
        if self.top_k == -1:
            self.top_k = 0
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            # torch.Generator.manual_seed accepts exactly this range.
            _check_int("seed", self.seed, lo=-(2**63), hi=2**64 - 1)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        self._check_logit_bias()
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), lo=0, hi=MAX_LOGPROBS)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs: must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias: must be a dict of token id -> bias, got {self.logit_bias!r}")
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"logit_bias: keys must be int token ids >= 0, got {token_id!r}")
            _check_float(f"logit_bias[{token_id}]", bias, lo=-100.0, hi=100.0)

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop: must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop: stop strings must be non-empty")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids: must be a list of int token ids >= 0, got {ids!r}")
        return list(ids)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if not _is_int(value):
        raise ValueError(f"{name}: must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}: must be {allowed}, got {value}")


def _check_float(name: str, value: Any, lo: float, hi: float | None = None, lo_open: bool = False) -> None:
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if value < lo or (lo_open and value == lo) or (hi is not None and value > hi):
        low = ("> " if lo_open else ">= ") if hi is None else ("in (" if lo_open else "in [")
        allowed = f"{low}{lo:g}" + ("" if hi is None else f", {hi:g}]")
        raise ValueError(f"{name}: must be {allowed}, got {value}")

"""Tool calls in Qwen's format (the Hermes one of Qwen2.5's and Qwen3's chat templates): a completion's
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks parsed whole or as they stream, and OpenAI-form
history messages prepared for the chat template.

Both parsers follow the same rules, so that a streamed answer adds up to the non-streamed one:
- a block opens at `<tool_call>` and closes at the first `</tool_call>` after it;
- a block whose body is not a JSON object with a string "name" and an object "arguments" ("parameters" is
  accepted in its place, and a JSON string holding an object for either) stays in the content as the text the
  model wrote, and so does an unterminated block;
- the content is the text outside the parsed blocks with the whitespace at its two ends stripped (None when
  nothing is left); whitespace between pieces of text is kept.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from slotserve.outputs import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ToolCallDelta:
    """One entry of OpenAI's `delta.tool_calls`: `id` and `name` come on a call's first delta only."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True)
class StreamDelta:
    content: str | None
    tool_calls: list[ToolCallDelta]


def parse_tool_calls(text: str) -> ParsedOutput:
    """The content and the calls of a whole completion."""
    outside: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, start + len(OPEN))
        if end < 0:
            break
        outside.append(text[pos:start])
        call = _parse_block(text[start + len(OPEN):end])
        if call is None:
            outside.append(text[start:end + len(CLOSE)])
        else:
            calls.append(call)
        pos = end + len(CLOSE)
    outside.append(text[pos:])
    return ParsedOutput("".join(outside).strip() or None, calls)


class ToolCallStream:
    """Parses a completion as it streams: `feed` each new piece of text, then call `finish` once.

    Text outside blocks is passed on as soon as it cannot be the start of `<tool_call>`, less the whitespace
    at its ends (held back until text follows it); a call is passed on whole, in one delta, once its block
    closes."""

    def __init__(self) -> None:
        self._buffer = ""  # outside text held back, or the body so far of the open block
        self._in_block = False
        self._calls: list[ToolCall] = []
        self._content = _Trimmer()

    @property
    def calls(self) -> list[ToolCall]:
        """The calls completed so far."""
        return list(self._calls)

    def feed(self, delta: str) -> StreamDelta:
        # Where `</tool_call>` can first end: the body before this delta was already searched.
        scan = max(0, len(self._buffer) - len(CLOSE) + 1) if self._in_block else 0
        self._buffer += delta
        text: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._in_block:
                end = self._buffer.find(CLOSE, scan)
                if end < 0:
                    break
                body, self._buffer, self._in_block = self._buffer[:end], self._buffer[end + len(CLOSE):], False
                call = _parse_block(body)
                if call is None:
                    text.append(OPEN + body + CLOSE)
                else:
                    deltas.append(ToolCallDelta(len(self._calls), call.id, call.name, call.arguments))
                    self._calls.append(call)
            else:
                start = self._buffer.find(OPEN)
                if start < 0:
                    cut = len(self._buffer) - _partial_open(self._buffer)
                    text.append(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    break
                text.append(self._buffer[:start])
                self._buffer, self._in_block, scan = self._buffer[start + len(OPEN):], True, 0
        return StreamDelta(self._content.push("".join(text)) or None, deltas)

    def finish(self) -> StreamDelta:
        """What is still held back: a partial tag, or an unterminated block, as content."""
        rest = OPEN + self._buffer if self._in_block else self._buffer
        self._buffer, self._in_block = "", False
        return StreamDelta(self._content.push(rest) or None, [])


def messages_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-form chat history as Qwen's chat templates render it right: an assistant turn's call arguments
    given as a JSON string become the object (Qwen2.5's template always `tojson`s them, so a string would be
    encoded twice; Qwen3's inserts a string as is, with the client's spacing rather than the model's), and its
    missing content becomes '' (Qwen3's template concatenates it). The messages given are not changed."""
    return [_assistant_for_template(m) if m.get("role") == "assistant" else m for m in messages]


def _parse_block(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body, parse_constant=_reject_constant)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj["arguments"] if "arguments" in obj else obj.get("parameters")
        if isinstance(args, str):
            args = json.loads(args, parse_constant=_reject_constant)
        if not isinstance(args, dict):
            return None
        arguments = json.dumps(args, ensure_ascii=False)
        # A lone surrogate (a "\ud800" escape) could not be sent as UTF-8: UnicodeEncodeError, a ValueError.
        (obj["name"] + arguments).encode("utf-8")
    except (ValueError, RecursionError):
        return None
    return ToolCall(f"call_{secrets.token_hex(12)}", obj["name"], arguments)


def _reject_constant(name: str) -> None:
    # NaN and Infinity are Python's extension: re-serialized they would not be JSON.
    raise ValueError(f"{name} is not JSON")


def _partial_open(text: str) -> int:
    """The length of the longest end of `text` that `<tool_call>` starts with."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0


class _Trimmer:
    """Passes text on with the whitespace at its two ends dropped, as `str.strip` drops it from the whole:
    whitespace before the first other character is dropped, and whitespace after the last one so far is held
    back until more text follows it (dropped if none does)."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out, self._held = self._held + body, text[len(body):]
        return out


def _assistant_for_template(message: dict[str, Any]) -> dict[str, Any]:
    out = {**message}
    if out.get("content") is None:
        out["content"] = ""
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [_call_for_template(c) for c in out["tool_calls"]]
    return out


def _call_for_template(call: Any) -> Any:
    # The templates read `function` when it is there, else the call itself (`{"name", "arguments"}`).
    if not isinstance(call, dict):
        return call
    if isinstance(call.get("function"), dict):
        return {**call, "function": _with_object_arguments(call["function"])}
    return _with_object_arguments(call)


def _with_object_arguments(function: dict[str, Any]) -> dict[str, Any]:
    args = function.get("arguments")
    if not isinstance(args, str):
        return function
    try:
        parsed = json.loads(args)
    except (ValueError, RecursionError):
        return function  # rendered as the client sent it
    return {**function, "arguments": parsed} if isinstance(parsed, dict) else function

"""Reasoning parsers (`--reasoning-parser`): split a reply into `reasoning_content` and `content`.

The Qwen3 rule, for the whole reply and for its stream alike:

- it starts with `<think>` (Qwen3 with thinking on): the text after that tag up to the first `</think>` is the
  reasoning, as is (the newlines just inside the tags are kept); the text after `</think>` is the content;
- it does not start with `<think>` but holds a `</think>` (Qwen3-2507 thinking, QwQ: `<think>` was in the
  prompt): the text before the first `</think>` is the reasoning, the text after it the content;
- it holds no `</think>`: after an opening `<think>` (a reply cut off by `max_tokens`) it is all reasoning;
  otherwise (thinking off, or a model that does not reason) it is all content, as is.

Leading newlines of the content after a `</think>` are dropped (Qwen3 writes `</think>\\n\\n`; its chat template
strips them the same way). Only the first `<think>`/`</think>` pair counts: any later tag is content. An empty
part is None.

`starts_in_reasoning=True` is for a prompt that ends inside an open `<think>` (DeepSeek-R1, QwQ): the reply is
read as if it began with `<think>`, so its reasoning streams at once and a reply cut short is all reasoning.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParserKind(enum.Enum):
    """The values of `--reasoning-parser`."""

    QWEN3 = "qwen3"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning_content: str | None
    content: str | None


def split_reasoning(text: str, *, starts_in_reasoning: bool = False) -> ReasoningSplit:
    """The whole reply split by the rule in this module's docstring."""
    opened = starts_in_reasoning or text.startswith(THINK_START)
    body = text[len(THINK_START):] if opened and not starts_in_reasoning else text
    reasoning, closed, content = body.partition(THINK_END)
    if closed:
        return ReasoningSplit(reasoning or None, content.lstrip("\n") or None)
    if opened:
        return ReasoningSplit(body or None, None)
    return ReasoningSplit(None, body or None)


class _State(enum.Enum):
    START = enum.auto()  # whether the reply opens with <think> is not known yet
    UNTAGGED = enum.auto()  # no opening <think>: reasoning if a </think> comes, else content
    REASONING = enum.auto()
    CONTENT = enum.auto()


class ReasoningStream:
    """Splits one choice's text deltas as they arrive: what all `feed` calls and then `finish` return adds up
    to `split_reasoning` of the whole text, however it was cut.

    Text that could still be the start of a tag is held back until a later delta decides it. A reply that does
    not open with `<think>` is held back whole until its `</think>` (or its end, when it is all content), since
    until then it cannot be told which part it belongs to: pass `starts_in_reasoning` where the prompt says.
    """

    def __init__(self, *, starts_in_reasoning: bool = False) -> None:
        self._state = _State.REASONING if starts_in_reasoning else _State.START
        self._held = ""
        self._scanned = 0  # of the held untagged text, this much is known to start no </think>
        self._content_started = False

    def feed(self, delta: str) -> ReasoningSplit:
        """The parts of `delta` (and of what was held back) that are decided now."""
        self._held += delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state is _State.START:
                if self._held.startswith(THINK_START):
                    self._held = self._held[len(THINK_START):]
                    self._state = _State.REASONING
                elif THINK_START.startswith(self._held):
                    break
                else:
                    self._state = _State.UNTAGGED
            elif self._state is _State.UNTAGGED:
                # Searching only the new text keeps a long untagged reply linear.
                end = self._held.find(THINK_END, self._scanned)
                if end < 0:
                    self._scanned = max(0, len(self._held) - len(THINK_END) + 1)
                    break
                reasoning.append(self._held[:end])
                self._held = self._held[end + len(THINK_END):]
                self._state = _State.CONTENT
            elif self._state is _State.REASONING:
                end = self._held.find(THINK_END)
                if end < 0:
                    cut = len(self._held) - _partial_tag_len(self._held, THINK_END)
                    reasoning.append(self._held[:cut])
                    self._held = self._held[cut:]
                    break
                reasoning.append(self._held[:end])
                self._held = self._held[end + len(THINK_END):]
                self._state = _State.CONTENT
            else:
                if not self._content_started:
                    self._held = self._held.lstrip("\n")
                    self._content_started = bool(self._held)
                content.append(self._held)
                self._held = ""
                break
        return ReasoningSplit("".join(reasoning) or None, "".join(content) or None)

    def finish(self) -> ReasoningSplit:
        """What is still held back, at the end of the reply."""
        held, self._held = self._held, ""
        if self._state is _State.REASONING:
            return ReasoningSplit(held or None, None)
        return ReasoningSplit(None, held or None)


def _partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0

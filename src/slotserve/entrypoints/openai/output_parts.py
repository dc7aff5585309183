"""A chat answer as the Responses and Messages APIs show it: a list of parts (reasoning, text, one per tool call),
whole, or opened, extended and closed as the answer streams. Both APIs build their items (blocks) from these
parts, so that a streamed answer adds up to the same parts as the answer read whole."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from slotserve.entrypoints.openai.chat_output import ChatDelta, ParsedMessage
from slotserve.outputs import ToolCall


class PartKind(enum.Enum):
    REASONING = "reasoning"
    TEXT = "text"
    TOOL_CALL = "tool_call"


@dataclass(frozen=True)
class Part:
    kind: PartKind
    text: str = ""  # the reasoning or the text; a tool call's arguments
    call: ToolCall | None = None  # TOOL_CALL only


class PartPhase(enum.Enum):
    ADDED = "added"  # `part` has no text yet
    DELTA = "delta"  # `delta` extends it
    DONE = "done"  # `part` is whole


@dataclass(frozen=True)
class PartEvent:
    phase: PartPhase
    index: int  # the part's position in the answer
    part: Part
    delta: str = ""


def answer_parts(message: ParsedMessage) -> list[Part]:
    """The parts of a whole answer: its reasoning, its text, its calls; one empty text part for an empty answer
    (clients read the first text block of an answer)."""
    parts = []
    if message.reasoning:
        parts.append(Part(PartKind.REASONING, message.reasoning))
    if message.content:
        parts.append(Part(PartKind.TEXT, message.content))
    parts += [Part(PartKind.TOOL_CALL, call.arguments, call) for call in message.tool_calls]
    return parts or [Part(PartKind.TEXT)]


class PartStream:
    """One choice's deltas (`ChoiceParser.parse`) as part events: reasoning and text are opened by their first
    delta and closed when another kind of part follows; a tool call arrives whole and closes at once."""

    def __init__(self) -> None:
        self.parts: list[Part] = []  # those closed, in order
        self._open: PartKind | None = None
        self._text: list[str] = []

    def feed(self, delta: ChatDelta) -> list[PartEvent]:
        events = []
        if delta.reasoning:
            events += self._extend(PartKind.REASONING, delta.reasoning)
        if delta.content:
            events += self._extend(PartKind.TEXT, delta.content)
        for piece in delta.tool_calls:
            events += self._close()
            call = ToolCall(piece.id or "", piece.name or "", piece.arguments)
            whole, index = Part(PartKind.TOOL_CALL, call.arguments, call), len(self.parts)
            events += [PartEvent(PartPhase.ADDED, index, Part(PartKind.TOOL_CALL, "", call)),
                       PartEvent(PartPhase.DELTA, index, whole, call.arguments),
                       PartEvent(PartPhase.DONE, index, whole)]
            self.parts.append(whole)
        return events

    def finish(self) -> list[PartEvent]:
        """Closes the open part; an answer that had none gets one empty text part, as `answer_parts` gives."""
        events = self._close()
        if not self.parts:
            empty = Part(PartKind.TEXT)
            events += [PartEvent(PartPhase.ADDED, 0, empty), PartEvent(PartPhase.DONE, 0, empty)]
            self.parts.append(empty)
        return events

    def _extend(self, kind: PartKind, text: str) -> list[PartEvent]:
        events = []
        if self._open is not kind:
            events += self._close()
            self._open = kind
            events.append(PartEvent(PartPhase.ADDED, len(self.parts), Part(kind)))
        self._text.append(text)
        events.append(PartEvent(PartPhase.DELTA, len(self.parts), Part(kind), text))
        return events

    def _close(self) -> list[PartEvent]:
        if self._open is None:
            return []
        whole = Part(self._open, "".join(self._text))
        self._open, self._text = None, []
        self.parts.append(whole)
        return [PartEvent(PartPhase.DONE, len(self.parts) - 1, whole)]

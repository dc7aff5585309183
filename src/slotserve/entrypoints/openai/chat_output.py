"""A chat answer's text split into the reasoning (`--reasoning-parser`), the tool calls (when the request offers
tools) and the content, whole or delta by delta, typed (`ParsedMessage`, `ChatDelta`) and as OpenAI's message;
and the grammar that makes `tool_choice` "required" or a named function hold."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from slotserve.entrypoints.openai.reasoning import THINK_END, THINK_START, ReasoningStream, split_reasoning
from slotserve.entrypoints.openai.tool_calls import ToolCallDelta, ToolCallStream, parse_tool_calls
from slotserve.outputs import ToolCall
from slotserve.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class ChatOutputOptions:
    reasoning: bool  # split out what the model writes inside <think>...</think>
    starts_in_reasoning: bool  # the prompt leaves a <think> open: the answer begins inside it
    tools: bool  # parse <tool_call> blocks


def output_options(prompt: str, reasoning_parser: bool, tools: bool) -> ChatOutputOptions:
    """Reads off the rendered prompt where the answer starts: a prompt that closes the think block itself
    (Qwen3 with enable_thinking false) leaves nothing to split."""
    closed = prompt.rstrip().endswith(THINK_END)
    starts_inside = prompt.rfind(THINK_START) > prompt.rfind(THINK_END)
    return ChatOutputOptions(reasoning_parser and not closed, reasoning_parser and starts_inside, tools)


@dataclass(frozen=True)
class ChatDelta:
    """What a piece of one choice's text adds: reasoning, content, and the tool calls it completes (each whole)."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class ParsedMessage:
    """A whole answer: its reasoning, its content and its tool calls."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...]


class ChoiceParser:
    """One choice's text, split as it streams."""

    def __init__(self, options: ChatOutputOptions) -> None:
        self.reasoning = ReasoningStream(starts_in_reasoning=options.starts_in_reasoning) if options.reasoning \
            else None
        self.tools = ToolCallStream() if options.tools else None

    @property
    def called(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)

    def parse(self, text: str, last: bool = False) -> ChatDelta:
        """What this piece of text (`last`: the choice ends with it) adds to the reasoning, content and calls."""
        reasoning = None
        if self.reasoning is not None:
            part = self.reasoning.feed(text)
            reasoning, text = part.reasoning_content, part.content or ""
            if last:
                rest = self.reasoning.finish()
                reasoning = (reasoning or "") + (rest.reasoning_content or "") or None
                text += rest.content or ""
        calls: list[ToolCallDelta] = []
        if self.tools is not None:
            part = self.tools.feed(text)
            text, calls = part.content or "", list(part.tool_calls)
            if last:
                rest = self.tools.finish()
                text += rest.content or ""
                calls += rest.tool_calls
        return ChatDelta(reasoning or None, text or None, tuple(calls))

    def feed(self, text: str, last: bool = False) -> dict[str, Any]:
        """The chat-completion delta's fields for this piece of text (`last`: the choice ends with it)."""
        parsed = self.parse(text, last)
        delta: dict[str, Any] = {}
        if parsed.reasoning:
            delta["reasoning_content"] = parsed.reasoning
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [_delta_json(c) for c in parsed.tool_calls]
        return delta


def parse_message(text: str, options: ChatOutputOptions) -> ParsedMessage:
    """The whole answer split into its reasoning, content and tool calls."""
    reasoning, content = None, text
    if options.reasoning:
        split = split_reasoning(text, starts_in_reasoning=options.starts_in_reasoning)
        reasoning, content = split.reasoning_content, split.content
    if options.tools and content:
        parsed = parse_tool_calls(content)
        return ParsedMessage(reasoning, parsed.content, tuple(parsed.tool_calls))
    return ParsedMessage(reasoning, content, ())


def message(text: str, options: ChatOutputOptions) -> dict[str, Any]:
    """The whole answer as an assistant message."""
    parsed = parse_message(text, options)
    out: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if options.reasoning:
        out["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in parsed.tool_calls]
    return out


def _delta_json(call: ToolCallDelta) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": call.arguments}
    out: dict[str, Any] = {"index": call.index}
    if call.id is not None:
        out.update(id=call.id, type="function")
    if call.name is not None:
        function["name"] = call.name
    out["function"] = function
    return out


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None) -> list[dict[str, Any]]:
    """The offered functions (each `{"name", "parameters", ...}`); ValueError naming what is malformed."""
    functions = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError(f"tools[{i}]: must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"tools[{i}].function.name: must be a non-empty string")
        if not isinstance(function.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
        functions.append(function)
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in {f["name"] for f in functions}:
            raise ValueError(f"tool_choice: names the function {name!r}, which is not among the tools")
    elif tool_choice not in (None, "auto", "none", "required"):
        raise ValueError(f"tool_choice: must be 'auto', 'none', 'required' or a named function, got {tool_choice!r}")
    elif tool_choice == "required" and not functions:
        raise ValueError("tool_choice: 'required' needs tools")
    return functions


def tool_grammar(functions: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None,
                 token_id: dict[str, int | None], parallel: bool = True) -> StructuredOutputsParams | None:
    """For `required` (one or more calls of any tool; one with `parallel` false) or a named function (one call of
    it): a grammar of
    `<tool_call>` blocks whose JSON is a call of an offered function with arguments of its schema. The tags are
    the tokenizer's own tokens where it has them (`token_id`), as the model was trained to write them."""
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen, repeat = [f for f in functions if f["name"] == name], ""
    elif tool_choice == "required":
        chosen, repeat = functions, "+" if parallel else ""
    else:
        return None
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]},
                             "arguments": f.get("parameters") or {"type": "object"}}} for f in chosen]
    # No free whitespace inside the JSON, as for response_format (structured_outputs.py): a weak model fills it.
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": {"whitespace_flexible": False}}

    def tag(text: str) -> str:
        return f"<[{token_id[text]}]>" if token_id.get(text) is not None else json.dumps(text)

    lark = (f"start: call{repeat}\n"
            f"call: {tag('<tool_call>')} \"\\n\" body \"\\n\" {tag('</tool_call>')} \"\\n\"?\n"
            f"body: %json {json.dumps(schema)}\n")
    return StructuredOutputsParams(grammar=lark)

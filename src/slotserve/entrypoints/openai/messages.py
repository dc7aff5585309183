"""POST /v1/messages, Anthropic's Messages API, on the chat-completions path: the request becomes a chat request
(system and messages, tools, stop sequences), runs as one, and its answer comes back as content blocks (thinking,
text, tool_use), whole or as Anthropic's streaming events. Errors take Anthropic's shape."""

from __future__ import annotations

import enum
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Annotated, Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from slotserve.entrypoints.openai.errors import ServerError
from slotserve.entrypoints.openai.output_parts import Part, PartEvent, PartKind, PartPhase, PartStream, answer_parts
from slotserve.entrypoints.openai.protocol import ChatCompletionRequest, reject_unsupported, sampling_extensions
from slotserve.entrypoints.openai.serving import ChatRun, Finish, OpenAIServing, sse_event

PATH = "/v1/messages"
# Anthropic's error type for each status this server answers with; other 4xx are invalid requests.
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class _Block(BaseModel):
    # Fields that change nothing here (cache_control, citations, ...) are accepted and ignored.
    model_config = ConfigDict(extra="allow")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class Base64Source(BaseModel):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(BaseModel):
    type: Literal["url"]
    url: str


class ImageBlock(_Block):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class MessageParam(BaseModel):
    role: Literal["user", "assistant"]
    content: list[Block] = Field(min_length=1)

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return [{"type": "text", "text": value}] if isinstance(value, str) else value


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["custom"] | None = None  # server tools (web search, ...) are not run here
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # effort: not a knob here

    format: OutputFormat | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None  # Qwen3's enable_thinking: on unless "disabled"
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None

    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {"container": (None,), "mcp_servers": (None, [])}

    @field_validator("system", mode="before")
    @classmethod
    def _system_text(cls, value: Any) -> Any:
        return [{"type": "text", "text": value}] if isinstance(value, str) else value


class StopReason(enum.Enum):
    END_TURN = "end_turn"
    MAX_TOKENS = "max_tokens"
    STOP_SEQUENCE = "stop_sequence"
    TOOL_USE = "tool_use"


def error_body(e: ServerError) -> dict[str, Any]:
    """An error as Anthropic writes it."""
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: a user turn's tool results become tool messages ahead of its other
    blocks, an assistant turn's tool_use blocks its tool_calls and its thinking its reasoning_content."""
    system = "\n".join(block.text for block in body.system or [])
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, message in enumerate(body.messages):
        where = f"messages[{i}].content"
        if message.role == "assistant":
            messages.append(_assistant(message.content))
            continue
        rest = []
        for j, block in enumerate(message.content):
            if isinstance(block, ToolResultBlock):
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _content(block.content)})
            elif isinstance(block, ToolUseBlock | ThinkingBlock):
                raise ValueError(f"{where}[{j}].type: a user message cannot hold {block.type} blocks")
            else:
                rest.append(block)
        if rest:
            messages.append({"role": "user", "content": _content(rest)})
    return messages


def _assistant(blocks: list[Block]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if isinstance(b, TextBlock))}
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    if calls:
        out["tool_calls"] = calls
    thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
    if thinking:
        out["reasoning_content"] = thinking
    return out


def _content(blocks: str | list[TextBlock | ImageBlock]) -> str | list[dict[str, Any]]:
    """Text blocks joined into one string; with images, chat content parts."""
    if isinstance(blocks, str):
        return blocks
    if all(isinstance(b, TextBlock) for b in blocks):
        return "".join(b.text for b in blocks)
    parts: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        else:
            source = block.source
            url = source.url if isinstance(source, UrlSource) else f"data:{source.media_type};base64,{source.data}"
            parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that answers `body`."""
    # In OpenAI's key order: the chat template writes each tool out as JSON.
    tools = [{"type": "function", "function": {"name": t.name, **({"description": t.description} if t.description
                                                                  else {}), "parameters": t.input_schema}}
             for t in body.tools or []]
    choice = _tool_choice(body.tool_choice, bool(tools))
    parallel = body.tool_choice is None or not body.tool_choice.disable_parallel_tool_use
    extensions = sampling_extensions(body)
    template = dict(extensions.pop("chat_template_kwargs", None) or {})
    if body.thinking is not None:
        template["enable_thinking"] = body.thinking.type != "disabled"
    fmt = body.output_config.format if body.output_config else None
    return ChatCompletionRequest(
        messages=chat_messages(body), max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, stop=body.stop_sequences, tools=tools or None, tool_choice=choice,
        parallel_tool_calls=parallel, chat_template_kwargs=template or None,
        response_format={"type": "json_schema", "json_schema": {"schema": fmt.json_schema}} if fmt else None,
        **extensions)


def _tool_choice(choice: ToolChoice | None, has_tools: bool) -> str | dict[str, Any] | None:
    """Anthropic's tool choice as chat's: `any` is `required`, `tool` a named function."""
    if choice is None:
        return None
    if choice.type in ("any", "tool") and not has_tools:
        raise ValueError(f"tool_choice: type {choice.type!r} needs tools")
    if choice.type != "tool":
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if not choice.name:
        raise ValueError("tool_choice.name: a tool choice of type 'tool' names the tool")
    return {"type": "function", "function": {"name": choice.name}}


def stop_reason(finish: Finish, called: bool) -> tuple[StopReason, str | None]:
    """Why the answer ended, and the stop sequence that ended it."""
    if finish.reason == "length":
        return StopReason.MAX_TOKENS, None
    if called:
        return StopReason.TOOL_USE, None
    if isinstance(finish.stop, str):  # a stop string: one of stop_sequences (a token id is the end of turn)
        return StopReason.STOP_SEQUENCE, finish.stop
    return StopReason.END_TURN, None


def content_block(part: Part, started: bool = False) -> dict[str, Any]:
    """The content block of one part; `started`: as it opens, empty."""
    if part.kind is PartKind.TOOL_CALL:
        return {"type": "tool_use", "id": part.call.id, "name": part.call.name,
                "input": {} if started else json.loads(part.text)}
    if part.kind is PartKind.REASONING:
        return {"type": "thinking", "thinking": part.text, "signature": ""}
    return {"type": "text", "text": part.text}


class MessagesAPI:
    """The endpoint."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, body: MessagesRequest, raw: Request, request_id: str):
        reject_unsupported(body, body.unsupported_fields)
        run = await self.serving.start_chat(chat_request(body), request_id)
        message_id = f"msg_{request_id}"
        if body.stream:
            return self.serving.sse(run.streams, self._stream(run, message_id),
                                    lambda e: sse_event(error_body(e), "error"))
        message, finish = await self.serving.collect_chat(raw, run)
        reason, sequence = stop_reason(finish, bool(message.tool_calls))
        return JSONResponse({**self._message(message_id, finish.prompt_tokens, finish.completion_tokens),
                             "content": [content_block(p) for p in answer_parts(message)],
                             "stop_reason": reason.value, "stop_sequence": sequence})

    def _message(self, message_id: str, input_tokens: int, output_tokens: int) -> dict[str, Any]:
        return {"id": message_id, "type": "message", "role": "assistant", "model": self.serving.model_name,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}

    async def _stream(self, run: ChatRun, message_id: str) -> AsyncIterator[str]:
        def emit(kind: str, **fields: Any) -> str:
            return sse_event({"type": kind, **fields}, kind)

        yield emit("message_start", message=self._message(message_id, run.prompt_tokens, 0))
        parts = PartStream()
        async for delta, finish in self.serving.stream_chat(run):
            events = parts.feed(delta) + (parts.finish() if finish is not None else [])
            for event in events:
                for line in _block_events(emit, event):
                    yield line
            if finish is not None:
                called = any(p.kind is PartKind.TOOL_CALL for p in parts.parts)
                reason, sequence = stop_reason(finish, called)
                yield emit("message_delta", delta={"stop_reason": reason.value, "stop_sequence": sequence},
                           usage={"output_tokens": finish.completion_tokens})
        yield emit("message_stop")


def _block_events(emit: Callable[..., str], event: PartEvent) -> Iterator[str]:
    part = event.part
    if event.phase is PartPhase.ADDED:
        yield emit("content_block_start", index=event.index, content_block=content_block(part, started=True))
    elif event.phase is PartPhase.DELTA:
        if part.kind is PartKind.TOOL_CALL:
            delta = {"type": "input_json_delta", "partial_json": event.delta}
        elif part.kind is PartKind.REASONING:
            delta = {"type": "thinking_delta", "thinking": event.delta}
        else:
            delta = {"type": "text_delta", "text": event.delta}
        yield emit("content_block_delta", index=event.index, delta=delta)
    else:
        yield emit("content_block_stop", index=event.index)


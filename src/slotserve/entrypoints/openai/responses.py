"""POST /v1/responses, OpenAI's Responses API, on the chat-completions path: the request becomes a chat request
(messages, tools, response_format), runs as one, and its answer comes back as output items (reasoning, message,
function_call), whole or as the Responses streaming events. Answers are kept for `previous_response_id` in a
bounded in-memory store."""

from __future__ import annotations

import itertools
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Annotated, Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from slotserve.entrypoints.openai.errors import ServerError
from slotserve.entrypoints.openai.output_parts import Part, PartEvent, PartKind, PartPhase, PartStream, answer_parts
from slotserve.entrypoints.openai.protocol import ChatCompletionRequest, reject_unsupported, sampling_extensions
from slotserve.entrypoints.openai.serving import ChatRun, Finish, OpenAIServing, sse_event

# Each stored response holds its whole conversation (up to --max-request-bytes of input, images included), so
# the store is bounded by count: 256 entries hold at most 2 GB at the default 8M limit, and KBs for text chats.
STORE_CAPACITY = 256


class _Item(BaseModel):
    # Fields that change nothing here (ids, statuses, annotations, ...) are accepted and ignored.
    model_config = ConfigDict(extra="allow")


class InputText(_Item):
    type: Literal["input_text"]
    text: str


class OutputText(_Item):
    type: Literal["output_text"]
    text: str


class Refusal(_Item):
    type: Literal["refusal"]
    refusal: str


class InputImage(_Item):
    type: Literal["input_image"]
    image_url: str | None = None  # a data: URL, or http(s) with --allow-image-urls; file ids are not supported
    detail: str = "auto"


ContentPart = Annotated[InputText | OutputText | Refusal | InputImage, Field(discriminator="type")]


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> Any:
        return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningText(_Item):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]
_ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    # As for chat: fields that change nothing (user, metadata, ...) are accepted; unimplemented ones get a 400.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: dict[str, Any] | None = None

    unsupported_fields: ClassVar[dict[str, tuple[Any, ...]]] = {
        "background": (None, False), "conversation": (None,), "prompt": (None,), "include": (None, []),
        "reasoning": (None,), "top_logprobs": (None, 0), "truncation": (None, "disabled"), "max_tool_calls": (None,),
    }

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, value: Any) -> Any:
        """A string is one user message; an item with a role and no type is a message."""
        if isinstance(value, str):
            return [{"type": "message", "role": "user", "content": value}]
        if isinstance(value, list):
            return [{**v, "type": "message"} if isinstance(v, dict) and "type" not in v and "role" in v else v
                    for v in value]
        return value


class ResponseStore:
    """The conversations of the last STORE_CAPACITY stored responses, for `previous_response_id`; the least
    recently used goes first."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[InputItem, ...]] = OrderedDict()

    def get(self, response_id: str) -> tuple[InputItem, ...]:
        """The conversation through that response's output; a 404 for an id not (or no longer) stored."""
        if response_id not in self._items:
            raise ServerError(404, "NotFoundError", f"previous_response_id: no stored response {response_id!r}",
                              "previous_response_id")
        self._items.move_to_end(response_id)
        return self._items[response_id]

    def put(self, response_id: str, items: Sequence[InputItem]) -> None:
        self._items[response_id] = tuple(items)
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


def chat_messages(instructions: str | None, items: Sequence[InputItem], first: int = 0) -> list[dict[str, Any]]:
    """The conversation as chat messages: `instructions` the system message, a function call joins the assistant
    turn before it, a reasoning item becomes the reasoning_content of the assistant turn right after it. `first`
    is the position of the request's own input among `items`, for the errors' field names."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning = None
    for i, item in enumerate(items):
        where = f"input[{i - first}]"
        if isinstance(item, ReasoningItem):
            reasoning = "".join(part.text for part in item.content or []) or None
            continue
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _content(item.output, f"{where}.output")})
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _content(item.content, f"{where}.content")})
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        if messages[-1]["role"] == "assistant" and reasoning is not None:
            messages[-1]["reasoning_content"] = reasoning
        reasoning = None
    return messages


def _content(parts: str | list[ContentPart], where: str) -> str | list[dict[str, Any]]:
    """Text parts joined into one string; with images, chat content parts."""
    if isinstance(parts, str):
        return parts
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if isinstance(part, InputImage):
            if part.image_url is None:
                raise ValueError(f"{where}[{j}].image_url: give the image as a URL (file ids are not supported)")
            out.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            out.append({"type": "text", "text": part.refusal if isinstance(part, Refusal) else part.text})
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def chat_request(body: ResponsesRequest, history: Sequence[InputItem]) -> ChatCompletionRequest:
    """The chat request that answers `body` after the stored conversation `history`."""
    tools = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                                                          exclude_none=True)} for t in body.tools or []]
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text else None
    response_format = None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ValueError("text.format.schema: a json_schema format needs its schema")
        response_format = {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                                  "schema": fmt.json_schema, "strict": fmt.strict}}
    elif fmt is not None:
        response_format = {"type": fmt.type}
    messages = chat_messages(body.instructions, [*history, *body.input], len(history))
    if not messages:
        raise ValueError("input: must not be empty")
    return ChatCompletionRequest(
        messages=messages,
        max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p, tools=tools or None,
        tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls, response_format=response_format,
        **sampling_extensions(body))


def output_item(part: Part, item_id: str, status: str, started: bool = False) -> dict[str, Any]:
    """The output item of one part; `started`: as it opens, before its content."""
    if part.kind is PartKind.TOOL_CALL:
        return {"id": item_id, "type": "function_call", "call_id": part.call.id, "name": part.call.name,
                "arguments": part.text, "status": status}
    content = [] if started else [_content_part(part)]
    if part.kind is PartKind.REASONING:
        return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _content_part(part: Part) -> dict[str, Any]:
    if part.kind is PartKind.REASONING:
        return {"type": "reasoning_text", "text": part.text}
    return {"type": "output_text", "text": part.text, "annotations": [], "logprobs": []}


def _item_id(kind: PartKind) -> str:
    prefix = {PartKind.REASONING: "rs", PartKind.TEXT: "msg", PartKind.TOOL_CALL: "fc"}[kind]
    return f"{prefix}_{uuid.uuid4().hex}"


def _status(finish: Finish) -> str:
    return "incomplete" if finish.reason == "length" else "completed"


def _usage(finish: Finish) -> dict[str, Any]:
    # Cached and reasoning tokens are not counted apart here.
    return {"input_tokens": finish.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": finish.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}


class _Events:
    """A stream's events, numbered in order."""

    def __init__(self) -> None:
        self._numbers = itertools.count()

    def __call__(self, kind: str, **fields: Any) -> str:
        return sse_event({"type": kind, "sequence_number": next(self._numbers), **fields}, kind)

    def error(self, e: ServerError) -> str:
        return self("error", code=e.kind, message=e.message, param=e.param)


class ResponsesAPI:
    """The endpoint, with its store of answered conversations."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore | None = None) -> None:
        self.serving, self.store = serving, store or ResponseStore()

    async def create(self, body: ResponsesRequest, raw: Request, request_id: str):
        reject_unsupported(body, body.unsupported_fields)
        history = self.store.get(body.previous_response_id) if body.previous_response_id else ()
        run = await self.serving.start_chat(chat_request(body, history), request_id)
        response_id, created = f"resp_{request_id}", int(time.time())
        if body.stream:
            events = _Events()
            return self.serving.sse(run.streams, self._stream(body, run, response_id, created, history, events),
                                    events.error)
        message, finish = await self.serving.collect_chat(raw, run)
        parts = answer_parts(message)
        status = _status(finish)
        output = [output_item(p, _item_id(p.kind), status if i == len(parts) - 1 else "completed")
                  for i, p in enumerate(parts)]
        self._keep(body, response_id, history, output)
        return JSONResponse(self._response(body, response_id, created, status, output, finish))

    async def _stream(self, body: ResponsesRequest, run: ChatRun, response_id: str, created: int,
                      history: Sequence[InputItem], emit: _Events) -> AsyncIterator[str]:
        started = self._response(body, response_id, created, "in_progress", [], None)
        yield emit("response.created", response=started)
        yield emit("response.in_progress", response=started)
        parts, ids, done = PartStream(), {}, {}
        finish = None
        async for delta, finish in self.serving.stream_chat(run):
            status = _status(finish) if finish is not None else "completed"
            for event in parts.feed(delta) + (parts.finish() if finish is not None else []):
                for line in _part_events(emit, event, ids, done, status):
                    yield line
        output = [done[i] for i in sorted(done)]
        self._keep(body, response_id, history, output)
        status = _status(finish)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        yield emit(kind, response=self._response(body, response_id, created, status, output, finish))

    def _keep(self, body: ResponsesRequest, response_id: str, history: Sequence[InputItem],
              output: list[dict[str, Any]]) -> None:
        if body.store:
            self.store.put(response_id, [*history, *body.input, *_ITEMS.validate_python(output)])

    def _response(self, body: ResponsesRequest, response_id: str, created: int, status: str,
                  output: list[dict[str, Any]], finish: Finish | None) -> dict[str, Any]:
        fmt = body.text.format if body.text and body.text.format else TextFormat(type="text")
        choice = body.tool_choice or "auto"
        return {
            "id": response_id, "object": "response", "created_at": created, "status": status,
            "model": self.serving.model_name, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": _usage(finish) if finish is not None else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "parallel_tool_calls": body.parallel_tool_calls, "text": {"format": fmt.model_dump(by_alias=True,
                                                                                           exclude_none=True)},
            "truncation": "disabled", "reasoning": None, "metadata": body.metadata or {},
        }


def _part_events(emit: _Events, event: PartEvent, ids: dict[int, str], done: dict[int, dict[str, Any]],
                 status: str) -> Iterator[str]:
    """The Responses events of one part event; `done` collects the finished items, `status` is theirs."""
    part, index = event.part, event.index
    where = {"output_index": index}
    if event.phase is PartPhase.ADDED:
        ids[index] = _item_id(part.kind)
        yield emit("response.output_item.added", **where,
                   item=output_item(part, ids[index], "in_progress", started=True))
        if part.kind is not PartKind.TOOL_CALL:
            yield emit("response.content_part.added", item_id=ids[index], **where, content_index=0,
                       part=_content_part(part))
        return
    where["item_id"] = ids[index]
    if event.phase is PartPhase.DELTA:
        if part.kind is PartKind.TOOL_CALL:
            yield emit("response.function_call_arguments.delta", **where, delta=event.delta)
        elif part.kind is PartKind.REASONING:
            yield emit("response.reasoning_text.delta", **where, content_index=0, delta=event.delta)
        else:
            yield emit("response.output_text.delta", **where, content_index=0, delta=event.delta, logprobs=[])
        return
    done[index] = item = output_item(part, ids[index], status)
    if part.kind is PartKind.TOOL_CALL:
        yield emit("response.function_call_arguments.done", **where, name=part.call.name, arguments=part.text)
    else:
        if part.kind is PartKind.REASONING:
            yield emit("response.reasoning_text.done", **where, content_index=0, text=part.text)
        else:
            yield emit("response.output_text.done", **where, content_index=0, text=part.text, logprobs=[])
        yield emit("response.content_part.done", **where, content_index=0, part=_content_part(part))
    yield emit("response.output_item.done", output_index=index, item=item)

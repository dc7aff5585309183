"""The completion and chat-completion endpoints: requests in, OpenAI-shaped JSON or SSE out; and the chat run
(`start_chat`, then `collect_chat` or `stream_chat`) that the Responses and Messages APIs answer through."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from slotserve.engine.async_llm import AsyncLLM, RequestStream
from slotserve.entrypoints.openai.chat_output import (
    ChatDelta,
    ChatOutputOptions,
    ChoiceParser,
    ParsedMessage,
    check_tools,
    message,
    output_options,
    parse_message,
    tool_grammar,
)
from slotserve.entrypoints.openai.errors import ServerError, as_server_error, unavailable
from slotserve.entrypoints.openai.images import fetch_images
from slotserve.entrypoints.openai.kv_cache_api import SlotTable
from slotserve.entrypoints.openai.limits import RequestLimits
from slotserve.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from slotserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from slotserve.entrypoints.openai.reasoning import ReasoningParserKind
from slotserve.entrypoints.openai.tool_calls import messages_for_template
from slotserve.multimodal.chat import flatten_messages
from slotserve.multimodal.prompts import ImageLike
from slotserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams

logger = logging.getLogger("slotserve")


@dataclass
class _Choice:
    """What one choice (prompt i, sample j) has accumulated."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class ChatRun:
    """A one-prompt chat request queued in the engine, with how its text is to be split."""

    request_id: str
    streams: list[RequestStream]
    params: SamplingParams
    options: ChatOutputOptions

    @property
    def prompt_tokens(self) -> int:
        return sum(len(s.prompt_token_ids) for s in self.streams)


@dataclass(frozen=True)
class Finish:
    """How a choice ended, and the tokens its request took."""

    reason: str  # "stop" | "length" | "abort"
    stop: int | str | None  # the stop string or stop token id that ended it
    prompt_tokens: int
    completion_tokens: int


class ClientDisconnectedError(Exception):
    """The client went away before its answer was ready; its requests have been aborted."""


class EngineStreamResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends: done, failed, cancelled, or the
    client gone (noticed while waiting for tokens too, not only when a write fails)."""

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        async def stream() -> None:
            with contextlib.suppress(OSError):  # a write to a closed connection
                await self.stream_response(send)
            group.cancel_scope.cancel()

        async def listen() -> None:
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(stream)
                group.start_soon(listen)
        finally:
            with anyio.CancelScope(shield=True):
                await _close(self.streams)


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, metrics: ServerMetrics, limits: RequestLimits,
                 max_queued_sequences: int | None = None, reasoning_parser: ReasoningParserKind | None = None) -> None:
        self.engine, self.model_name, self.metrics, self.limits = engine, model_name, metrics, limits
        self.max_queued_sequences = max_queued_sequences
        self.reasoning_parser = reasoning_parser
        vocab = engine.tokenizer.backend
        self._tag_ids = {tag: vocab.token_to_id(tag) for tag in ("<tool_call>", "</tool_call>")}
        self._starting = 0  # sequences of requests still being tokenized: counted against the queue limit
        self.slots = SlotTable(engine.config.max_num_seqs)  # llama.cpp's slots: the prompt each last took

    # ---- endpoints ----------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request, request_id: str):
        body.unsupported()
        prompts = body.prompts()
        body.check_limits(self.limits, len(prompts))
        logprobs = body.logprobs
        params = body.sampling_params(body.max_tokens, logprobs)
        if body.id_slot is not None:
            self.slots.check(body.id_slot)
        streams = await self._start(request_id, prompts, params)
        self.slots.record(body.id_slot, streams[-1].prompt_token_ids)
        if body.stream:
            return self._sse(streams, self._completion_chunks(body, request_id, streams, params))
        choices, usage = await self._collect(raw, streams, params)
        return JSONResponse({
            "id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name, "usage": usage,
            "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                         "stop_reason": c.stop_reason,
                         "logprobs": _completion_logprobs(c.logprobs) if logprobs is not None else None}
                        for c in choices],
        })

    async def chat(self, body: ChatCompletionRequest, raw: Request, request_id: str):
        run = await self.start_chat(body, request_id)
        if body.stream:
            return self._sse(run.streams, self._chat_chunks(body, request_id, run))
        choices, usage = await self._collect(raw, run.streams, run.params)
        messages = [message(c.text, run.options) for c in choices]
        top = body.top_logprobs if body.logprobs else None
        return JSONResponse({
            "id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "usage": usage,
            "choices": [{"index": c.index, "message": m,
                         "finish_reason": "tool_calls" if "tool_calls" in m and c.finish_reason == "stop"
                         else c.finish_reason, "stop_reason": c.stop_reason,
                         "logprobs": _chat_logprobs(c.logprobs, top) if body.logprobs else None}
                        for c, m in zip(choices, messages, strict=True)],
        })

    async def start_chat(self, body: ChatCompletionRequest, request_id: str) -> ChatRun:
        """Checks a chat request, renders its prompt and queues it: what every chat-shaped API runs."""
        body.unsupported()
        body.check_limits(self.limits, 1)
        top = body.top_logprobs if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ValueError("top_logprobs: needs logprobs to be true")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, (top or 0) if body.logprobs else None)
        functions = check_tools(body.tools, body.tool_choice)
        calls_tools = bool(functions) and body.tool_choice != "none"
        grammar = tool_grammar(functions, body.tool_choice, self._tag_ids, body.parallel_tool_calls) \
            if calls_tools else None
        if grammar is not None:
            if params.structured_outputs is not None:
                raise ValueError("tool_choice: a required or named tool call cannot be combined with another "
                                 "constraint (response_format, structured_outputs)")
            params = replace(params, structured_outputs=grammar)
        prompt, images = await asyncio.to_thread(self._render, body)
        options = output_options(prompt, self.reasoning_parser is not None, calls_tools)
        if body.id_slot is not None:
            self.slots.check(body.id_slot)
        streams = await self._start(request_id, [prompt], params, await fetch_images(images, self.limits))
        self.slots.record(body.id_slot, streams[0].prompt_token_ids)
        return ChatRun(request_id, streams, params, options)

    async def collect_chat(self, raw: Request, run: ChatRun) -> tuple[ParsedMessage, Finish]:
        """Runs a one-choice chat request to the end: the answer parsed, and how it ended."""
        (choice,), usage = await self._collect(raw, run.streams, run.params)
        return parse_message(choice.text, run.options), Finish(
            choice.finish_reason or "abort", choice.stop_reason, usage["prompt_tokens"], usage["completion_tokens"])

    async def stream_chat(self, run: ChatRun) -> AsyncIterator[tuple[ChatDelta, Finish | None]]:
        """A one-choice chat request's parsed deltas as they come; the last one comes with how it ended."""
        tracker = self.metrics.track(run.request_id, run.prompt_tokens)
        parser = ChoiceParser(run.options)
        async for _, comp in self._outputs(run.streams, tracker):
            done = comp.finish_reason is not None
            finish = Finish(comp.finish_reason, comp.stop_reason, tracker.prompt_tokens, tracker.completion_tokens) \
                if done else None
            yield parser.parse(comp.text, last=done), finish

    async def embeddings(self, body: EmbeddingRequest, raw: Request, request_id: str):
        prompts = body.prompts()
        body.check_limits(self.limits, len(prompts))
        streams = await self._start(request_id, prompts, PoolingParams(dimensions=body.dimensions))
        vectors: dict[int, list[float]] = {}

        async def run() -> None:
            async for i, out in self._merged(streams):
                vectors[i] = out.embedding

        await _unless_disconnected(raw, run(), streams)
        prompt_tokens = sum(len(s.prompt_token_ids) for s in streams)
        self.metrics.track(request_id, prompt_tokens).finish("stop")
        data = []
        for i in sorted(vectors):
            vector = vectors[i]
            if body.encoding_format == "base64":
                vector = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        return JSONResponse({"object": "list", "data": data, "model": self.model_name,
                             "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}})

    def _render(self, body: ChatCompletionRequest) -> tuple[str, list[ImageLike]]:
        """The prompt, and the images of its placeholders in order."""
        messages, images = flatten_messages(messages_for_template(body.messages))
        try:
            return self.engine.tokenizer.apply_chat_template(
                messages, tools=body.tools, add_generation_prompt=body.add_generation_prompt,
                **(body.chat_template_kwargs or {})), images
        except TypeError as e:  # a template given a kwarg it cannot take
            raise ValueError(f"chat_template_kwargs: {e}") from None

    # ---- running requests ---------------------------------------------------------------------

    async def _start(self, request_id: str, prompts: list[str | list[int]], params: SamplingParams | PoolingParams,
                     images: list[ImageLike] = ()) -> list[RequestStream]:
        """Queues every prompt, or none: a bad one aborts those already queued."""
        if not prompts:
            raise ValueError("prompt: must not be empty")
        need = len(prompts) * getattr(params, "n", 1)
        limit = self.max_queued_sequences
        if limit is not None:
            if need > limit:
                raise ValueError(f"n: {need} sequences can never fit the queue of {limit} (--max-queued-requests)")
            if self.engine.num_sequences_in_flight + self._starting + need > limit:
                raise unavailable(f"too many sequences in flight (limit {limit}); retry later")
        self._starting += need
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, params, images))
        except BaseException:
            await _close(streams)
            raise
        finally:
            self._starting -= need
        return streams

    async def _merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of all prompts' requests as they arrive, tagged with the prompt's position. Each stream
        is read only when the consumer asks for more, so a slow consumer gets merged deltas."""
        waiting = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=waiting.get):
                    i = waiting.pop(future)
                    try:
                        out = future.result()
                    except StopAsyncIteration:
                        continue
                    yield i, out
                    waiting[asyncio.ensure_future(anext(streams[i]))] = i
        finally:
            for future in waiting:
                if future.done() and not future.cancelled():
                    future.exception()  # read, so asyncio does not report it as lost
                future.cancel()
            await _close(streams)

    async def _collect(self, raw: Request, streams: list[RequestStream],
                       params: SamplingParams) -> tuple[list[_Choice], dict[str, int]]:
        """Runs a non-streaming request to the end; a client that disconnects aborts it."""
        choices = {}
        tracker = self.metrics.track(streams[0].request_id, sum(len(s.prompt_token_ids) for s in streams))

        async def run() -> None:
            async for i, out in self._merged(streams):
                tracker.delta(out)
                for comp in out.outputs:
                    _accumulate(choices.setdefault(i * params.n + comp.index, _Choice(i * params.n + comp.index)),
                                comp)

        try:
            await _unless_disconnected(raw, run(), streams)
        except BaseException:
            tracker.finish("abort")
            raise
        ordered = [choices[k] for k in sorted(choices)]
        tracker.finish(*[c.finish_reason for c in ordered])
        return ordered, tracker.usage()

    # ---- streaming ----------------------------------------------------------------------------

    def sse(self, streams: list[RequestStream], events: AsyncIterator[str],
            error_event: Callable[[ServerError], str], last: str = "") -> StreamingResponse:
        """A streamed answer: `events` as they come (each a whole SSE event), then `last`; an error raised
        mid-stream becomes `error_event`, the API's own, since the status line is long gone."""
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield event
            except Exception as e:
                error = as_server_error(e)
                logger.warning("request %s ended with an error mid-stream: %s", streams[0].request_id, error)
                yield error_event(error)
            if last:
                yield last

        return EngineStreamResponse(body(), streams)

    def _sse(self, streams: list[RequestStream], chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            async for chunk in chunks:
                yield sse_event(chunk)

        return self.sse(streams, events(), lambda error: sse_event(error.body()), "data: [DONE]\n\n")

    async def _completion_chunks(self, body: CompletionRequest, request_id: str, streams: list[RequestStream],
                                 params: SamplingParams) -> AsyncIterator[dict[str, Any]]:
        base = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        tracker = self.metrics.track(request_id, sum(len(s.prompt_token_ids) for s in streams))
        async for chunk in self._stream_choices(streams, params, base, tracker, lambda _i, comp: {
                "text": comp.text,
                "logprobs": _completion_logprobs(comp.logprobs) if body.logprobs is not None else None}):
            yield chunk
        if body.stream_options and body.stream_options.include_usage:
            yield {**base, "choices": [], "usage": tracker.usage()}

    async def _chat_chunks(self, body: ChatCompletionRequest, request_id: str,
                           run: ChatRun) -> AsyncIterator[dict[str, Any]]:
        base = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}
        top = body.top_logprobs or 0
        tracker = self.metrics.track(request_id, run.prompt_tokens)
        for j in range(run.params.n):
            yield {**base, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
        parsers: dict[tuple[int, int], ChoiceParser] = {}

        def render(i: int, comp: CompletionOutput) -> dict[str, Any]:
            parser = parsers.setdefault((i, comp.index), ChoiceParser(run.options))
            done = comp.finish_reason is not None
            out = {"delta": parser.feed(comp.text, last=done),
                   "logprobs": _chat_logprobs(comp.logprobs, top) if body.logprobs else None}
            if done and parser.called and comp.finish_reason == "stop":
                out["finish_reason"] = "tool_calls"
            return out

        async for chunk in self._stream_choices(run.streams, run.params, base, tracker, render):
            yield chunk
        if body.stream_options and body.stream_options.include_usage:
            yield {**base, "choices": [], "usage": tracker.usage()}

    async def _stream_choices(self, streams: list[RequestStream], params: SamplingParams, base: dict[str, Any],
                              tracker: RequestTracker, render) -> AsyncIterator[dict[str, Any]]:
        async for i, comp in self._outputs(streams, tracker):
            choice = {"index": i * params.n + comp.index, "finish_reason": comp.finish_reason, **render(i, comp)}
            if comp.finish_reason is not None:
                choice["stop_reason"] = comp.stop_reason
            yield {**base, "choices": [choice]}

    async def _outputs(self, streams: list[RequestStream],
                       tracker: RequestTracker) -> AsyncIterator[tuple[int, CompletionOutput]]:
        """Every choice's deltas that carry something, with their prompt's position, counted by `tracker`."""
        reasons = []
        try:
            async for i, out in self._merged(streams):
                tracker.delta(out)
                for comp in out.outputs:
                    if not comp.text and not comp.token_ids and comp.finish_reason is None:
                        continue
                    if comp.finish_reason is not None:
                        reasons.append(comp.finish_reason)
                    yield i, comp
        finally:
            tracker.finish(*(reasons or ["abort"]))


async def _close(streams: list[RequestStream]) -> None:
    for stream in streams:
        await stream.aclose()


async def _unless_disconnected(raw: Request, work: Awaitable[None], streams: list[RequestStream]) -> None:
    """Awaits `work`; if the client disconnects first, aborts it (and its streams) and raises
    ClientDisconnectedError."""
    task = asyncio.ensure_future(work)

    async def listen() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.create_task(listen())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await _close(streams)
    if task.cancelled():
        raise ClientDisconnectedError("the client disconnected")
    task.result()


def _accumulate(choice: _Choice, comp: CompletionOutput) -> None:
    choice.text += comp.text
    choice.token_ids += comp.token_ids
    choice.logprobs += comp.logprobs or []
    if comp.finish_reason is not None:
        choice.finish_reason, choice.stop_reason = comp.finish_reason, comp.stop_reason


def _chosen(position: PositionLogprobs) -> tuple[int, Any]:
    # The sampled token is the entry whose rank the sampler fixed first: dicts keep insertion order.
    return next(iter(position.items()))


def _completion_logprobs(positions: list[PositionLogprobs] | None) -> dict[str, Any]:
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for position in positions or []:
        _, entry = _chosen(position)
        tokens.append(entry.decoded_token)
        token_logprobs.append(entry.logprob)
        top.append({e.decoded_token: e.logprob for e in position.values()})
        offsets.append(offset)
        offset += len(entry.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _chat_logprobs(positions: list[PositionLogprobs] | None, top: int | None) -> dict[str, Any]:
    content = []
    for position in positions or []:
        _, entry = _chosen(position)
        alternatives = sorted(position.values(), key=lambda e: e.rank)[: top or 0]
        content.append({
            "token": entry.decoded_token, "logprob": entry.logprob,
            "bytes": list((entry.decoded_token or "").encode()),
            "top_logprobs": [{"token": e.decoded_token, "logprob": e.logprob,
                              "bytes": list((e.decoded_token or "").encode())} for e in alternatives],
        })
    return {"content": content}


def sse_event(data: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event; `event` names it (the Responses and Messages APIs name theirs)."""
    name = f"event: {event}\n" if event else ""
    return f"{name}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def new_request_id() -> str:
    return uuid.uuid4().hex

"""The completion and chat-completion endpoints: requests in, OpenAI-shaped JSON or SSE out."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from slotserve.engine.async_llm import AsyncLLM, RequestStream
from slotserve.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from slotserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from slotserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams


@dataclass
class _Choice:
    """What one choice (prompt i, sample j) has accumulated."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_name: str, metrics: ServerMetrics) -> None:
        self.engine, self.model_name, self.metrics = engine, model_name, metrics

    # ---- endpoints ----------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request, request_id: str):
        logprobs = body.logprobs
        params = body.sampling_params(body.max_tokens, logprobs)
        streams = await self._start(request_id, body.prompts(), params)
        if body.stream:
            return self._sse(self._completion_chunks(body, request_id, streams, params))
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
        top = body.top_logprobs if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise ValueError("top_logprobs: needs logprobs to be true")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, (top or 0) if body.logprobs else None)
        try:
            prompt = self.engine.tokenizer.apply_chat_template(
                [_flatten_content(m) for m in body.messages], tools=body.tools,
                add_generation_prompt=body.add_generation_prompt, **(body.chat_template_kwargs or {}))
        except TypeError as e:  # a template given a kwarg it cannot take
            raise ValueError(f"chat_template_kwargs: {e}") from None
        streams = await self._start(request_id, [prompt], params)
        if body.stream:
            return self._sse(self._chat_chunks(body, request_id, streams, params))
        choices, usage = await self._collect(raw, streams, params)
        return JSONResponse({
            "id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "usage": usage,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                         "logprobs": _chat_logprobs(c.logprobs, top) if body.logprobs else None}
                        for c in choices],
        })

    async def embeddings(self, body: EmbeddingRequest, raw: Request, request_id: str):
        streams = await self._start(request_id, body.prompts(), PoolingParams(dimensions=body.dimensions))
        vectors: dict[int, list[float]] = {}
        async for i, out in self._merged(streams):
            vectors[i] = out.embedding
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

    # ---- running requests ---------------------------------------------------------------------

    async def _start(self, request_id: str, prompts: list[str | list[int]],
                     params: SamplingParams | PoolingParams) -> list[RequestStream]:
        """Queues every prompt, or none: a bad one aborts those already queued."""
        if not prompts:
            raise ValueError("prompt: must not be empty")
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.engine.add_request(f"{request_id}-{i}", prompt, params))
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        return streams

    async def _merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Deltas of all prompts' requests as they arrive, tagged with the prompt's position."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except BaseException as e:
                queue.put_nowait((i, e))
                raise
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                await stream.aclose()

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

        task = asyncio.create_task(run())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await raw.is_disconnected():
                task.cancel()
                tracker.finish("abort")
                await asyncio.gather(task, return_exceptions=True)
                raise asyncio.CancelledError("client disconnected")
        task.result()
        ordered = [choices[k] for k in sorted(choices)]
        tracker.finish(*[c.finish_reason for c in ordered])
        return ordered, tracker.usage()

    # ---- streaming ----------------------------------------------------------------------------

    def _sse(self, chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def _completion_chunks(self, body: CompletionRequest, request_id: str, streams: list[RequestStream],
                                 params: SamplingParams) -> AsyncIterator[dict[str, Any]]:
        base = {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        tracker = self.metrics.track(request_id, sum(len(s.prompt_token_ids) for s in streams))
        async for chunk in self._stream_choices(streams, params, base, tracker, lambda comp: {
                "text": comp.text,
                "logprobs": _completion_logprobs(comp.logprobs) if body.logprobs is not None else None}):
            yield chunk
        if body.stream_options and body.stream_options.include_usage:
            yield {**base, "choices": [], "usage": tracker.usage()}

    async def _chat_chunks(self, body: ChatCompletionRequest, request_id: str, streams: list[RequestStream],
                           params: SamplingParams) -> AsyncIterator[dict[str, Any]]:
        base = {"id": f"chatcmpl-{request_id}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name}
        top = body.top_logprobs or 0
        tracker = self.metrics.track(request_id, sum(len(s.prompt_token_ids) for s in streams))
        for j in range(params.n):
            yield {**base, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
        async for chunk in self._stream_choices(streams, params, base, tracker, lambda comp: {
                "delta": {"content": comp.text} if comp.text else {},
                "logprobs": _chat_logprobs(comp.logprobs, top) if body.logprobs else None}):
            yield chunk
        if body.stream_options and body.stream_options.include_usage:
            yield {**base, "choices": [], "usage": tracker.usage()}

    async def _stream_choices(self, streams: list[RequestStream], params: SamplingParams, base: dict[str, Any],
                              tracker: RequestTracker, render) -> AsyncIterator[dict[str, Any]]:
        reasons = []
        try:
            async for i, out in self._merged(streams):
                tracker.delta(out)
                for comp in out.outputs:
                    if not comp.text and not comp.token_ids and comp.finish_reason is None:
                        continue
                    choice = {"index": i * params.n + comp.index, **render(comp),
                              "finish_reason": comp.finish_reason}
                    if comp.finish_reason is not None:
                        choice["stop_reason"] = comp.stop_reason
                        reasons.append(comp.finish_reason)
                    yield {**base, "choices": [choice]}
        finally:
            tracker.finish(*(reasons or ["abort"]))


def _accumulate(choice: _Choice, comp: CompletionOutput) -> None:
    choice.text += comp.text
    choice.token_ids += comp.token_ids
    choice.logprobs += comp.logprobs or []
    if comp.finish_reason is not None:
        choice.finish_reason, choice.stop_reason = comp.finish_reason, comp.stop_reason


def _flatten_content(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI content parts [{"type": "text", "text": ...}] become one string (text is all we serve)."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError("messages: only text content parts are supported")
            texts.append(part.get("text", ""))
        return {**message, "content": "".join(texts)}
    return message


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


def new_request_id() -> str:
    return uuid.uuid4().hex

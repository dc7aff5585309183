"""The front-end engine: an asyncio client of the engine-core process, with one output stream per request.

It tokenizes and validates in the caller's process, sends requests over ZMQ, and routes the deltas
that come back to the right request's queue. A request whose consumer goes away (client disconnect,
task cancelled) is aborted in the engine, which frees its blocks within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence

import zmq
import zmq.asyncio

from slotserve import faults
from slotserve.config import EngineConfig, ModelConfig
from slotserve.engine.input_processor import InputProcessor
from slotserve.engine.protocol import (
    AbortRequests,
    AddRequest,
    CoreCommand,
    Dead,
    Debug,
    EngineStats,
    GetDebug,
    GetStats,
    KVSave,
    Outputs,
    Ready,
    RequestFailed,
    Shutdown,
    Stats,
    decode_event,
    encode,
)
from slotserve.faults import FaultPoint
from slotserve.model_store import resolve_model
from slotserve.multimodal.prompts import ImageLike, ImagePrompting
from slotserve.outputs import EmbeddingOutput, RequestOutput
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams
from slotserve.tokenizer import Tokenizer

logger = logging.getLogger("slotserve")


class EngineDeadError(RuntimeError):
    """The engine-core process stopped; requests cannot be served."""


class EngineStartError(RuntimeError):
    """The engine-core process failed before it was ready."""


class RequestAbortedError(RuntimeError):
    """The engine ended a request before it finished (the server is shutting down)."""


class _Stream:
    """One request's deltas not yet read. A reader that falls behind gets them merged into one, so what it
    pins grows with the request's output (at most max_tokens per sequence), not with the number of steps."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sequence_ids: list[str]) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.sequence_ids = sequence_ids
        self.finished = False
        self._pending: RequestOutput | EmbeddingOutput | None = None
        self._texts: dict[int, list[str]] = {}  # the pending output's text pieces, joined when it is read
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput | EmbeddingOutput) -> None:
        out.request_id, out.prompt_token_ids = self.request_id, self.prompt_token_ids
        if isinstance(out, RequestOutput):
            out.prompt = self.prompt
        if self._pending is None or isinstance(out, EmbeddingOutput):
            self._pending = out
            self._texts = {c.index: [c.text] for c in getattr(out, "outputs", ())}
        else:
            self._merge(out)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        self._error = self._error or error
        self._ready.set()

    async def get(self) -> RequestOutput | EmbeddingOutput:
        """The next (merged) delta; an error only once every delta before it has been read."""
        await self._ready.wait()
        out, self._pending = self._pending, None
        if out is None:
            raise self._error
        if self._error is None:
            self._ready.clear()
        for comp in getattr(out, "outputs", ()):
            comp.text = "".join(self._texts.pop(comp.index))
        return out

    def _merge(self, out: RequestOutput) -> None:
        pending = self._pending
        by_index = {c.index: c for c in pending.outputs}
        for comp in out.outputs:
            into = by_index.get(comp.index)
            if into is None:
                pending.outputs.append(comp)
                self._texts[comp.index] = [comp.text]
                continue
            self._texts[comp.index].append(comp.text)
            into.token_ids.extend(comp.token_ids)
            if comp.logprobs is not None:
                into.logprobs = [*(into.logprobs or []), *comp.logprobs]
            if comp.finish_reason is not None:
                into.finish_reason, into.stop_reason = comp.finish_reason, comp.stop_reason
            into.cumulative_logprob = comp.cumulative_logprob
        pending.finished = out.finished
        pending.metrics.update(out.metrics)
        pending.prompt_logprobs = pending.prompt_logprobs or out.prompt_logprobs
        pending.num_cached_tokens = out.num_cached_tokens


class RequestStream:
    """The deltas of one request. Closing it before the last one aborts the request in the engine."""

    def __init__(self, engine: AsyncLLM, key: str, stream: _Stream) -> None:
        self.engine, self._key, self._stream = engine, key, stream

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._stream.prompt_token_ids

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput | EmbeddingOutput:
        if self._stream.finished:
            raise StopAsyncIteration
        try:
            item = await self._stream.get()
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                self._stream.finished = True
                self.engine._streams.pop(self._key, None)
            raise
        if item.finished:
            self._stream.finished = True
            self.engine._streams.pop(self._key, None)
        return item

    async def aclose(self) -> None:
        if not self._stream.finished:
            self._stream.finished = True
            self.engine._streams.pop(self._key, None)
            if not self.engine.is_dead:
                await self.engine._abort([self._key], self._stream.sequence_ids)


class AsyncLLM:
    def __init__(self, config: EngineConfig, model_path, tokenizer: Tokenizer, log_level: str = "INFO") -> None:
        self.config, self.tokenizer = config, tokenizer
        self.model_path, self.model_config = model_path, ModelConfig.from_dir(model_path)
        self._log_level = log_level
        self._ctx = zmq.asyncio.Context()
        base = os.path.join(tempfile.gettempdir(), f"slotserve-{uuid.uuid4().hex[:12]}")
        self._input_address, self._output_address = f"ipc://{base}-in", f"ipc://{base}-out"
        self._commands = self._ctx.socket(zmq.PUSH)
        self._commands.bind(self._input_address)
        self._events = self._ctx.socket(zmq.PULL)
        self._events.bind(self._output_address)
        # Keyed by the engine's own ids: a caller's id may repeat, and a finished request's last deltas
        # may still be on their way when a new request reuses it.
        self._streams: dict[str, _Stream] = {}
        self._keys = itertools.count()
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count(1)
        self._process: multiprocessing.Process | None = None
        self._tasks: list[asyncio.Task] = []
        self.input_processor: InputProcessor | None = None
        self.dead_reason: str | None = None
        self.dead = asyncio.Event()
        self.kv_offload_dir: str | None = None  # this model's directory of the KV disk tier, once started

    @classmethod
    async def create(cls, config: EngineConfig, log_level: str = "INFO", start_timeout: float = 900) -> AsyncLLM:
        """Starts the engine-core process and returns once it has loaded the model."""
        path = resolve_model(config.model)  # assemble/convert here, once, before the core needs it
        engine = cls(config, path, Tokenizer.from_dir(path), log_level)
        await engine._start(start_timeout)
        return engine

    async def _start(self, timeout: float) -> None:
        spawn = multiprocessing.get_context("spawn")
        self._process = spawn.Process(
            target=_run_engine_core, name="EngineCore", daemon=True,
            args=(self.config, self._input_address, self._output_address, self._log_level))
        self._process.start()
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            if await self._events.poll(timeout=200):
                event = decode_event(await self._events.recv())
                if isinstance(event, Ready):
                    break
                self._cleanup()
                why = event.message if isinstance(event, Dead) else f"it sent {type(event).__name__} first"
                raise EngineStartError(f"engine core failed to start: {why}")
            if not self._process.is_alive():
                self._cleanup()
                raise EngineStartError(f"engine core exited during start-up (exit code {self._process.exitcode})")
            if asyncio.get_running_loop().time() > deadline:
                self._process.kill()
                self._cleanup()
                raise EngineStartError(f"engine core not ready after {timeout:.0f} s")
        self.max_model_len, self.task, self.kv_offload_dir = event.max_model_len, event.task, event.kv_offload_dir
        prompting = ImagePrompting.for_model(self.model_path, self.model_config, self.config.limit_mm_per_prompt,
                                             self.config.image_min_pixels, self.config.image_max_pixels)
        self.input_processor = InputProcessor(self.tokenizer, event.vocab_size, event.max_model_len, event.task,
                                              event.hidden_size, prompting)
        self._tasks = [asyncio.create_task(self._receive_events(), name="slotserve-events"),
                       asyncio.create_task(self._watch_process(), name="slotserve-watchdog")]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    # ---- requests -----------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_sequences_in_flight(self) -> int:
        return sum(len(s.sequence_ids) for s in self._streams.values())

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
                          images: Sequence[ImageLike] = (), kv_save: KVSave | None = None) -> RequestStream:
        """Validates and queues a request (ValueError for bad input, EngineDeadError when the engine is
        gone); iterate the returned stream for its deltas. `request_id` is the caller's name for it:
        it is put on its outputs and may repeat. `images`: a vision-language model's, in placeholder order."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        key = str(next(self._keys))
        # Tokenizing a long prompt, or decoding and resizing images, takes seconds: not on the event loop.
        processed = await asyncio.to_thread(self.input_processor.process, key, prompt, params, images, kv_save)
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        stream = _Stream(request_id, processed.prompt, processed.prompt_token_ids,
                         [s.request_id for s in processed.sequences])
        self._streams[key] = stream
        try:
            await self._send(AddRequest(processed))
        except BaseException:
            self._streams.pop(key, None)
            raise
        return RequestStream(self, key, stream)

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yields the request's deltas as they come. Leaving the loop early aborts the request."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def _abort(self, keys: list[str], sequence_ids: list[str]) -> None:
        with contextlib.suppress(EngineDeadError):
            await self._send(AbortRequests(keys, sequence_ids))

    async def abort_all(self, reason: str) -> None:
        """Ends every request in flight with RequestAbortedError(reason), and frees them in the engine."""
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.fail(RequestAbortedError(reason))
        if streams and not self.is_dead:
            await self._abort(list(streams), [seq for s in streams.values() for seq in s.sequence_ids])

    async def _send(self, command: CoreCommand, timeout: float = 10.0) -> None:
        """A PUSH to a process that is gone would wait forever: check, and bound the wait."""
        if self.is_dead or not self._process.is_alive():
            raise EngineDeadError(self.dead_reason or "engine core process is not running")
        try:
            await asyncio.wait_for(self._commands.send(encode(command)), timeout)
        except TimeoutError:
            raise EngineDeadError(f"engine core did not take a message within {timeout:.0f} s") from None

    async def stats(self, timeout: float = 5.0) -> EngineStats:
        return await self._ask(GetStats, timeout)

    async def debug(self, timeout: float = 5.0) -> dict:
        """The engine process's snapshot: threads and stacks, queues, scheduler, recent steps, watchdog. The IPC
        loop answers it, so it comes back while the core loop is stuck."""
        return await self._ask(GetDebug, timeout)

    async def _ask(self, question: type[GetStats | GetDebug], timeout: float):
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        token = next(self._tokens)
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters[token] = waiter
        try:
            await self._send(question(token), timeout)
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._stats_waiters.pop(token, None)

    # ---- background tasks ---------------------------------------------------------------------

    async def _receive_events(self) -> None:
        while True:
            data = await self._events.recv()
            faults.check(FaultPoint.FRONTEND_EVENTS)
            event = decode_event(data)
            if isinstance(event, Outputs):
                for out in [*event.outputs, *event.embeddings]:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
            elif isinstance(event, Stats | Debug):
                waiter = self._stats_waiters.get(event.token)
                if waiter is not None and not waiter.done():
                    waiter.set_result(event.stats if isinstance(event, Stats) else event.snapshot)
            elif isinstance(event, RequestFailed):
                stream = self._streams.get(event.request_id)
                if stream is not None:
                    stream.fail(ValueError(event.message))
            elif isinstance(event, Dead):
                self._fail_all(f"engine core died: {event.message}")
                return

    async def _watch_process(self) -> None:
        while self._process.is_alive():
            await asyncio.sleep(0.5)
        await asyncio.sleep(0.5)  # let a "dead" event the process sent on its way out arrive with its reason
        self._fail_all(f"engine core process exited (exit code {self._process.exitcode})")

    def _task_ended(self, task: asyncio.Task) -> None:
        """A background task that raises would leave every request waiting forever: it ends the engine."""
        if task.cancelled() or task.exception() is None:
            return
        e = task.exception()
        logger.error("front-end task %s died", task.get_name(), exc_info=e)
        self._fail_all(f"front-end task {task.get_name()} died: {type(e).__name__}: {e}")
        if self._process is not None and self._process.is_alive():
            self._process.kill()

    def _fail_all(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error("%s; failing %d in-flight requests", reason, len(self._streams))
        for stream in self._streams.values():
            stream.fail(EngineDeadError(reason))
        for waiter in self._stats_waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineDeadError(reason))
        self.dead.set()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine-core process (politely, then by force) and closes the sockets."""
        for task in self._tasks:
            task.cancel()
        if self._process is not None and self._process.is_alive():
            with contextlib.suppress(EngineDeadError):
                await self._send(Shutdown(), timeout)
            deadline = asyncio.get_running_loop().time() + timeout
            while self._process.is_alive() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            if self._process.is_alive():
                self._process.kill()
        self._cleanup()

    def _cleanup(self) -> None:
        self._commands.close(linger=0)
        self._events.close(linger=0)
        self._ctx.term()
        for address in (self._input_address, self._output_address):
            path = address.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)


def _run_engine_core(*args) -> None:
    """The engine-core process's entry: the core is imported there, never in the front end."""
    from slotserve.engine.core_process import run_engine_core

    run_engine_core(*args)

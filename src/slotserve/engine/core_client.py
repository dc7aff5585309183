"""The front end's client of one engine-core process: its two sockets, the output streams of the requests it
runs, and the watch on the process.

Each client fails only its own requests when its process ends, so several of them (data-parallel replicas,
engine/async_llm.py) share one front end without sharing a fate. The process is started on this machine by
multiprocessing (`LocalCore`) or as a Ray actor (engine/ray_replicas.py); both are `CoreProcess`es.
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
from typing import Protocol

import zmq
import zmq.asyncio

from slotserve import faults
from slotserve.config import EngineConfig
from slotserve.engine.protocol import (
    AbortRequests,
    AddRequest,
    CoreCommand,
    Dead,
    Debug,
    EngineStats,
    GetDebug,
    GetStats,
    Outputs,
    ProcessedRequest,
    Ready,
    RequestFailed,
    Shutdown,
    Stats,
    decode_event,
    encode,
)
from slotserve.faults import FaultPoint
from slotserve.outputs import EmbeddingOutput, RequestOutput

logger = logging.getLogger("slotserve")


class EngineDeadError(RuntimeError):
    """The engine-core process stopped; requests cannot be served."""


class EngineStartError(RuntimeError):
    """The engine-core process failed before it was ready."""


class RequestAbortedError(RuntimeError):
    """The engine ended a request before it finished (the server is shutting down)."""


class CoreProcess(Protocol):
    """Where an engine core runs: told its sockets' addresses at start, watched and killed by its client."""

    def start(self, config: EngineConfig, input_address: str, output_address: str, log_level: str) -> None: ...

    def is_alive(self) -> bool: ...

    def exit_reason(self) -> str:
        """How it ended, following the core's name: "process exited (exit code 1)"."""
        ...

    def kill(self) -> None: ...


class LocalCore:
    """An engine core in a process of its own on this machine (spawned: the core is imported there only)."""

    def __init__(self) -> None:
        self.process: multiprocessing.Process | None = None

    def start(self, config: EngineConfig, input_address: str, output_address: str, log_level: str) -> None:
        self.process = multiprocessing.get_context("spawn").Process(
            target=_run_engine_core, name="EngineCore", daemon=True,
            args=(config, input_address, output_address, log_level))
        self.process.start()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def is_alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def exit_reason(self) -> str:
        return f"process exited (exit code {self.process.exitcode})"

    def kill(self) -> None:
        if self.is_alive():
            self.process.kill()


def ipc_addresses() -> tuple[str, str]:
    """Fresh unix-socket addresses for one core's commands and events."""
    base = os.path.join(tempfile.gettempdir(), f"slotserve-{uuid.uuid4().hex[:12]}")
    return f"ipc://{base}-in", f"ipc://{base}-out"


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

    def __init__(self, core: CoreClient, key: str, stream: _Stream) -> None:
        self.core, self._key, self._stream = core, key, stream

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
                self.core.streams.pop(self._key, None)
            raise
        if item.finished:
            self._stream.finished = True
            self.core.streams.pop(self._key, None)
        return item

    async def aclose(self) -> None:
        if not self._stream.finished:
            self._stream.finished = True
            self.core.streams.pop(self._key, None)
            if not self.core.is_dead:
                await self.core.abort([self._key], self._stream.sequence_ids)


class CoreClient:
    """One engine core: `start` it, `add` requests to it, read their streams; `dead` is set when it ends."""

    def __init__(self, process: CoreProcess, input_address: str, output_address: str, name: str = "engine core"
                 ) -> None:
        self.process, self.name = process, name
        self._ctx = zmq.asyncio.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._events = self._ctx.socket(zmq.PULL)
        self.input_address = _bind(self._commands, input_address)
        self.output_address = _bind(self._events, output_address)
        # Keyed by the front end's own ids: a caller's id may repeat, and a finished request's last deltas
        # may still be on their way when a new request reuses it.
        self.streams: dict[str, _Stream] = {}
        self._waiters: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self.ready: Ready | None = None
        self.dead_reason: str | None = None
        self.dead = asyncio.Event()

    async def start(self, config: EngineConfig, log_level: str, timeout: float) -> Ready:
        """Starts the process and returns its `Ready` once it has loaded the model (EngineStartError if not)."""
        self.process.start(config, self.input_address, self.output_address, log_level)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if await self._events.poll(timeout=200):
                event = decode_event(await self._events.recv())
                if isinstance(event, Ready):
                    break
                self.close()
                why = event.message if isinstance(event, Dead) else f"it sent {type(event).__name__} first"
                raise EngineStartError(f"{self.name} failed to start: {why}")
            if not self.process.is_alive():
                self.close()
                raise EngineStartError(f"{self.name} ended during start-up: {self.process.exit_reason()}")
            if loop.time() > deadline:
                self.process.kill()
                self.close()
                raise EngineStartError(f"{self.name} not ready after {timeout:.0f} s")
        self.ready = event
        self._tasks = [asyncio.create_task(self._receive_events(), name=f"slotserve-events ({self.name})"),
                       asyncio.create_task(self._watch_process(), name=f"slotserve-watchdog ({self.name})")]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)
        return event

    # ---- requests -----------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def num_sequences_in_flight(self) -> int:
        return sum(len(s.sequence_ids) for s in self.streams.values())

    async def add(self, request_id: str, request: ProcessedRequest) -> RequestStream:
        """Sends a processed request (its `request_id` the front end's key); its deltas come on the returned
        stream, under the caller's `request_id`."""
        key = request.request_id
        sequence_ids = [s.request_id for s in request.sequences]
        stream = _Stream(request_id, request.prompt, request.prompt_token_ids, sequence_ids)
        self.streams[key] = stream
        try:
            await self.send(AddRequest(request))
        except BaseException:
            self.streams.pop(key, None)
            raise
        return RequestStream(self, key, stream)

    async def abort(self, keys: list[str], sequence_ids: list[str]) -> None:
        with contextlib.suppress(EngineDeadError):
            await self.send(AbortRequests(keys, sequence_ids))

    async def abort_all(self, reason: str) -> None:
        """Ends every request in flight with RequestAbortedError(reason), and frees them in the engine."""
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.fail(RequestAbortedError(reason))
        if streams and not self.is_dead:
            await self.abort(list(streams), [seq for s in streams.values() for seq in s.sequence_ids])

    async def send(self, command: CoreCommand, timeout: float = 10.0) -> None:
        """A PUSH to a process that is gone would wait forever: check, and bound the wait."""
        if self.is_dead or not self.process.is_alive():
            raise EngineDeadError(self.dead_reason or f"{self.name} is not running")
        try:
            await asyncio.wait_for(self._commands.send(encode(command)), timeout)
        except TimeoutError:
            raise EngineDeadError(f"{self.name} did not take a message within {timeout:.0f} s") from None

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
        self._waiters[token] = waiter
        try:
            await self.send(question(token), timeout)
            return await asyncio.wait_for(waiter, timeout)
        finally:
            self._waiters.pop(token, None)

    # ---- background tasks ---------------------------------------------------------------------

    async def _receive_events(self) -> None:
        while True:
            data = await self._events.recv()
            faults.check(FaultPoint.FRONTEND_EVENTS)
            event = decode_event(data)
            if isinstance(event, Outputs):
                for out in [*event.outputs, *event.embeddings]:
                    stream = self.streams.get(out.request_id)
                    if stream is not None:
                        stream.put(out)
            elif isinstance(event, Stats | Debug):
                waiter = self._waiters.get(event.token)
                if waiter is not None and not waiter.done():
                    waiter.set_result(event.stats if isinstance(event, Stats) else event.snapshot)
            elif isinstance(event, RequestFailed):
                stream = self.streams.get(event.request_id)
                if stream is not None:
                    stream.fail(ValueError(event.message))
            elif isinstance(event, Dead):
                self.fail_all(f"{self.name} died: {event.message}")
                return

    async def _watch_process(self) -> None:
        while self.process.is_alive():
            await asyncio.sleep(0.5)
        await asyncio.sleep(0.5)  # let a "dead" event the process sent on its way out arrive with its reason
        self.exited()

    def exited(self) -> None:
        """The process is gone: its requests fail with how it ended."""
        self.fail_all(f"{self.name} {self.process.exit_reason()}")

    def _task_ended(self, task: asyncio.Task) -> None:
        """A background task that raises would leave every request waiting forever: it ends the engine."""
        if task.cancelled() or task.exception() is None:
            return
        e = task.exception()
        logger.error("front-end task %s died", task.get_name(), exc_info=e)
        self.fail_all(f"front-end task {task.get_name()} died: {type(e).__name__}: {e}")
        self.process.kill()

    def fail_all(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error("%s; failing %d in-flight requests", reason, len(self.streams))
        for stream in self.streams.values():
            stream.fail(EngineDeadError(reason))
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineDeadError(reason))
        self.dead.set()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine-core process (politely, then by force) and closes the sockets."""
        for task in self._tasks:
            task.cancel()
        if self.process.is_alive():
            with contextlib.suppress(EngineDeadError):
                await self.send(Shutdown(), timeout)
            deadline = asyncio.get_running_loop().time() + timeout
            while self.process.is_alive() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            self.process.kill()
        self.close()

    def close(self) -> None:
        self._commands.close(linger=0)
        self._events.close(linger=0)
        self._ctx.term()
        for address in (self.input_address, self.output_address):
            path = address.removeprefix("ipc://")
            if address.startswith("ipc://") and os.path.exists(path):
                os.unlink(path)


def _bind(socket: zmq.Socket, address: str) -> str:
    """Binds `address`; a tcp one without a port ("tcp://HOST") takes a free port. Returns the bound address."""
    if address.startswith("tcp://") and address.count(":") == 1:
        host = address.removeprefix("tcp://")
        port = socket.bind_to_random_port("tcp://*")
        return f"tcp://{host}:{port}"
    socket.bind(address)
    return address


def _run_engine_core(*args) -> None:
    """The engine-core process's entry: the core is imported there, never in the front end."""
    from slotserve.engine.core_process import run_engine_core

    run_engine_core(*args)

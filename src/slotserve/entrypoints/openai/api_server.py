"""`slotserve serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of the engine core.

Every error comes back as an OpenAI error body: 400 for bad input, 401 without the API key, 404 for an
unknown model or route, 405 for a wrong method, 413 for a body over the size limit, 503 when the queue
is full or the engine is dead or shutting down. When the engine dies, every request in flight ends with
an error, `/health` answers 503, and after `engine_death_exit_delay` seconds the server exits with code
1, for a supervisor to restart it (as vLLM does).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles

from slotserve.config import EngineConfig
from slotserve.engine import diagnostics
from slotserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestAbortedError
from slotserve.entrypoints.openai import kv_cache_api, messages
from slotserve.entrypoints.openai.errors import ServerError, as_server_error, bad_request, unavailable
from slotserve.entrypoints.openai.limits import RequestLimits
from slotserve.entrypoints.openai.messages import MessagesAPI, MessagesRequest
from slotserve.entrypoints.openai.metrics import ServerMetrics
from slotserve.entrypoints.openai.protocol import (
    Body,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    parse_body,
    require_model,
)
from slotserve.entrypoints.openai.reasoning import ReasoningParserKind
from slotserve.entrypoints.openai.responses import ResponsesAPI, ResponsesRequest
from slotserve.entrypoints.openai.serving import ClientDisconnectedError, OpenAIServing, new_request_id
from slotserve.entrypoints.openai.tool_calls import messages_for_template
from slotserve.multimodal.chat import flatten_messages

logger = logging.getLogger("slotserve")

# Routes open without the API key: what load balancers and scrapers poll, and the chat page, which must load
# before it can ask for the key (it holds no data; its requests carry the key).
_OPEN_PATHS = frozenset({"/health", "/metrics", "/"})
_STATIC_DIR = Path(__file__).parent / "static"
_STATIC_PREFIX = "/static/"
# Bodies above this are parsed off the event loop.
_LARGE_BODY = 1 << 16


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queued_requests: int | None = None  # sequences in flight (n per prompt) beyond which new requests get 503
    limits: RequestLimits = field(default_factory=RequestLimits)
    log_interval: float = 10.0  # seconds between periodic stats lines; 0 turns them off
    engine_death_exit_delay: float = 5.0  # seconds of 503s after the engine died, before the server exits 1
    reasoning_parser: ReasoningParserKind | None = None  # --reasoning-parser: reasoning_content split out
    debug_endpoints: bool = False  # GET /debug/engine (--debug-endpoints; on by default on a loopback address)


@dataclass
class ServerState:
    shutting_down: bool = False


class _Gate:
    """Before any route: names the request (the client's X-Request-Id is echoed and logged, never used as
    a key), checks the API key, and refuses a body over the size limit before it is read (413)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = headers.get("x-request-id") or new_request_id()
        scope.setdefault("state", {})["client_request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        path = scope["path"]
        if self.api_key and path not in _OPEN_PATHS and not path.startswith(_STATIC_PREFIX):
            # OpenAI's clients send the key as a bearer token, Anthropic's as x-api-key.
            bearer = hmac.compare_digest(headers.get("authorization", "").encode(), f"Bearer {self.api_key}".encode())
            if not bearer and not hmac.compare_digest(headers.get("x-api-key", "").encode(), self.api_key.encode()):
                error = ServerError(401, "AuthenticationError", "missing or invalid API key")
                await _error(error, path)(scope, receive, send_with_id)
                return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _error(self._too_large(), path)(scope, receive, send_with_id)
            return
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, counted_receive, send_with_id)

    def _too_large(self) -> ServerError:
        return ServerError(413, "RequestTooLargeError",
                           f"the request body is over {self.max_body_bytes} bytes (--max-request-bytes)")


def build_app(engine: AsyncLLM, settings: ServerSettings, state: ServerState | None = None,
              exit_server: Callable[[int], None] | None = None) -> FastAPI:
    """`exit_server(code)` is called when the engine has died and the server should stop."""
    metrics = ServerMetrics(settings.model_name)
    serving = OpenAIServing(engine, settings.model_name, metrics, settings.limits, settings.max_queued_requests,
                            settings.reasoning_parser)
    responses_api, messages_api = ResponsesAPI(serving), MessagesAPI(serving)
    state = state or ServerState()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tasks = [asyncio.create_task(_log_stats(engine, metrics, settings.log_interval))]
        if exit_server is not None:
            tasks.append(asyncio.create_task(_exit_after_death(engine, settings.engine_death_exit_delay, exit_server)))
        try:
            yield
        finally:
            state.shutting_down = True
            for task in tasks:
                task.cancel()
            await engine.shutdown()

    app = FastAPI(title="slotserve", lifespan=lifespan)
    app.add_middleware(_Gate, api_key=settings.api_key, max_body_bytes=settings.limits.max_body_bytes)

    @app.exception_handler(ServerError)
    async def server_error(raw: Request, e: ServerError):
        return _error(e, raw.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(raw: Request, e: HTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(e.status_code, "BadRequestError")
        return _error(ServerError(e.status_code, kind, str(e.detail)), raw.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(raw: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error(bad_request(f"{where}: {first.get('msg', 'invalid request')}", where or None), raw.url.path)

    @app.exception_handler(ClientDisconnectedError)
    async def client_gone(_: Request, e: ClientDisconnectedError):
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"

    @app.exception_handler(Exception)
    async def internal_error(raw: Request, e: Exception):
        logger.exception("request %s failed", raw.state.client_request_id)
        return _error(as_server_error(e), raw.url.path)

    def admit(body: BaseModel) -> None:
        if state.shutting_down:
            raise unavailable("the server is shutting down")
        if engine.is_dead:
            raise unavailable(f"the engine is not running: {engine.dead_reason}")
        require_model(body, settings.model_name)

    async def read(raw: Request, model: type[Body]) -> Body:
        data = await raw.body()
        if len(data) > _LARGE_BODY:
            return await asyncio.to_thread(parse_body, data, model)
        return parse_body(data, model)

    async def run(handler, model: type[Body], raw: Request):
        body = await read(raw, model)
        admit(body)
        response_id = new_request_id()
        logger.debug("request %s is %s", raw.state.client_request_id, response_id)
        try:
            return await handler(body, raw, response_id)
        except (ServerError, ClientDisconnectedError):
            raise
        except (ValueError, EngineDeadError, RequestAbortedError) as e:
            raise as_server_error(e) from None

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await run(serving.completions, CompletionRequest, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await run(serving.chat, ChatCompletionRequest, raw)

    @app.post("/v1/responses")
    async def responses(raw: Request):
        return await run(responses_api.create, ResponsesRequest, raw)

    @app.post(messages.PATH)
    async def anthropic_messages(raw: Request):
        return await run(messages_api.create, MessagesRequest, raw)

    @app.post("/v1/embeddings")
    async def embeddings(raw: Request):
        return await run(serving.embeddings, EmbeddingRequest, raw)

    # What the model reads: the chat page offers image upload only where images are taken.
    prompting = engine.input_processor.image_prompting
    modalities = ["text", "image"] if prompting is not None and prompting.limit_per_prompt > 0 else ["text"]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": int(time.time()), "owned_by": "slotserve",
            "max_model_len": engine.max_model_len, "input_modalities": modalities}]}

    # The built-in chat page (static/): plain files, no build step, talking to /v1/chat/completions.
    @app.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(_STATIC_DIR / "index.html")

    app.mount(_STATIC_PREFIX.rstrip("/"), StaticFiles(directory=_STATIC_DIR), name="static")

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        body = await read(raw, TokenizeRequest)
        admit(body)

        def encode() -> list[int]:
            if body.messages is not None:
                # Each image part counts as its one placeholder here: its size is known only once decoded.
                text = engine.tokenizer.apply_chat_template(
                    flatten_messages(messages_for_template(body.messages))[0],
                    add_generation_prompt=body.add_generation_prompt,
                    **(body.chat_template_kwargs or {}))
            elif body.prompt is not None:
                text = body.prompt
            else:
                raise bad_request("prompt: give a prompt or messages", "prompt")
            return engine.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)

        try:
            tokens = await asyncio.to_thread(encode)
        except ValueError as e:
            raise as_server_error(e) from None
        except TypeError as e:  # a template given a kwarg it cannot take
            raise bad_request(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        body = await read(raw, DetokenizeRequest)
        admit(body)
        bad = [t for t in body.tokens if not 0 <= t < engine.input_processor.vocab_size]
        if bad:
            raise bad_request(f"tokens: ids {bad[:5]} are outside the vocabulary", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    def render_chat(messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> str:
        try:
            return engine.tokenizer.apply_chat_template(flatten_messages(messages_for_template(messages))[0],
                                                        add_generation_prompt=add_generation_prompt, **kwargs)
        except TypeError as e:  # a template given a kwarg it cannot take
            raise bad_request(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None

    kv_cache_api.register(app, engine, serving.slots, read, admit, render_chat)

    front_end_threads = diagnostics.ThreadSampler()  # CPU shares since the previous sample
    if settings.debug_endpoints:

        @app.get("/debug/engine")
        async def debug_engine():
            """Every process's threads with their stacks, the engine's queues, scheduler and recent steps: under
            "engine" for one engine core, under "replicas" (in order) for several."""
            front_end_threads.sample()
            snapshots = await engine.debug(timeout=5.0)
            front_end = {"pid": os.getpid(), "threads": diagnostics.threads(front_end_threads)}
            if len(snapshots) == 1:
                return {"engine": snapshots[0], "front_end": front_end}
            return {"replicas": snapshots, "front_end": front_end}

    @app.get("/health")
    async def health():
        if state.shutting_down or engine.is_dead:
            return Response(status_code=503)
        try:
            await engine.stats(timeout=5.0)
        except (EngineDeadError, TimeoutError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        # The snapshots first: the IPC loop answers them even while the core loop, which answers stats, is stuck.
        front_end_threads.sample()
        metrics.update_diagnostics(await engine.debug(timeout=2.0), diagnostics.threads(front_end_threads))
        metrics.replicas_alive.set(engine.replicas_alive)
        with contextlib.suppress(EngineDeadError, TimeoutError):
            metrics.update_engine(await engine.stats(timeout=2.0))
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _error(e: ServerError, path: str) -> JSONResponse:
    """The error body in the shape of the API the path belongs to: Anthropic's under /v1/messages, else OpenAI's."""
    body = messages.error_body(e) if path.startswith(messages.PATH) else e.body()
    return JSONResponse(body, status_code=e.status)


async def _exit_after_death(engine: AsyncLLM, delay: float, exit_server: Callable[[int], None]) -> None:
    await engine.dead.wait()
    logger.error("the engine is dead (%s); the server exits in %.0f s", engine.dead_reason, delay)
    await asyncio.sleep(delay)
    exit_server(1)


async def _log_stats(engine: AsyncLLM, metrics: ServerMetrics, interval: float) -> None:
    """One line every `interval` seconds, like vLLM's: throughput, queue, KV usage, prefix hits."""
    if interval <= 0:
        return
    last_prompt = last_gen = 0
    while True:
        await asyncio.sleep(interval)
        try:
            stats = await engine.stats(timeout=interval)
        except (EngineDeadError, TimeoutError):
            continue
        metrics.update_engine(stats)
        prompt, gen = metrics.total_prompt_tokens, metrics.total_generation_tokens
        spec = stats.speculation
        logger.info("prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
                    "KV cache usage %.1f%%, prefix cache hit rate %.1f%%%s",
                    (prompt - last_prompt) / interval, (gen - last_gen) / interval, stats.running, stats.waiting,
                    100 * stats.kv_cache_usage, 100 * stats.prefix_cache_hit_rate,
                    f", draft acceptance rate {100 * spec.acceptance_rate:.1f}%, mean accepted length "
                    f"{spec.mean_accepted_length:.2f}" if spec.proposed else "")
        last_prompt, last_gen = prompt, gen


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process dies of the signal;
    a server that drained cleanly exits 0 instead. Requests still running `grace` seconds after the
    signal are ended with an error (their streams get an error event), so none is cut off silently."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, state: ServerState, grace: float) -> None:
        super().__init__(config)
        self.engine, self.state, self.grace, self.exit_code = engine, state, grace, 0

    @contextlib.contextmanager
    def capture_signals(self):
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig, frame) -> None:
        if not self.state.shutting_down:
            self.state.shutting_down = True
            loop = asyncio.get_running_loop()
            loop.call_later(self.grace, lambda: loop.create_task(self.engine.abort_all("the server is shutting down")))
        super().handle_exit(sig, frame)

    def stop(self, code: int) -> None:
        self.exit_code, self.should_exit = code, True


async def serve(config: EngineConfig, settings: ServerSettings, host: str, port: int, log_level: str,
                shutdown_timeout: float) -> int:
    """Starts the engine core, then serves until SIGINT/SIGTERM (stop accepting, let in-flight requests
    finish for up to `shutdown_timeout` seconds, stop the engine: exit code 0) or until the engine dies
    (exit code 1)."""
    engine = await AsyncLLM.create(config, log_level=log_level.upper())
    state = ServerState()
    server: _Server | None = None
    app = build_app(engine, settings, state, exit_server=lambda code: server.stop(code))
    # uvicorn's own deadline comes after ours, so ended streams can still write their error event.
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                    timeout_graceful_shutdown=shutdown_timeout + 5), engine, state, shutdown_timeout)
    await server.serve()
    return server.exit_code

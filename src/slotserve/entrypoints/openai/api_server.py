"""`slotserve serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of the engine core.

Errors always come back as an OpenAI error body: 400 for bad input, 401 without the API key, 404
for an unknown model, 503 when the queue is full or the engine is dead or shutting down.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import time
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from slotserve.config import EngineConfig
from slotserve.engine.async_llm import AsyncLLM, EngineDeadError
from slotserve.entrypoints.openai.metrics import ServerMetrics
from slotserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    error_body,
)
from slotserve.entrypoints.openai.serving import OpenAIServing, new_request_id
from slotserve.tokenizer import TokenizerError

logger = logging.getLogger("slotserve")


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_queued_requests: int | None = None  # in-flight requests beyond which new ones get 503
    log_interval: float = 10.0  # seconds between periodic stats lines; 0 turns them off


class ServerError(Exception):
    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param


def build_app(engine: AsyncLLM, settings: ServerSettings) -> FastAPI:
    metrics = ServerMetrics(settings.model_name)
    serving = OpenAIServing(engine, settings.model_name, metrics)
    state = {"shutting_down": False}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        logger_task = asyncio.create_task(_log_stats(engine, metrics, settings.log_interval))
        try:
            yield
        finally:
            state["shutting_down"] = True
            logger_task.cancel()
            await engine.shutdown()

    app = FastAPI(title="slotserve", lifespan=lifespan)

    @app.middleware("http")
    async def request_id_and_auth(request: Request, call_next):
        request_id = request.headers.get("x-request-id") or new_request_id()
        request.state.request_id = request_id
        if settings.api_key and request.url.path.startswith("/v1"):
            supplied = request.headers.get("authorization", "")
            if not hmac.compare_digest(supplied.encode(), f"Bearer {settings.api_key}".encode()):
                response = _error(401, "AuthenticationError", "missing or invalid API key")
                response.headers["X-Request-Id"] = request_id
                return response
        response = await call_next(request)
        response.headers["X-Request-Id"] = request_id
        return response

    @app.exception_handler(ServerError)
    async def server_error(_: Request, e: ServerError):
        return _error(e.status, e.kind, e.message, e.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":
            detail = first.get("ctx", {}).get("error", "")
            return _error(400, "BadRequestError", f"the request body is not valid JSON ({detail})")
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid JSON")
        return _error(400, "BadRequestError", message, where or None)

    def admit(body_model: str | None) -> None:
        if state["shutting_down"]:
            raise ServerError(503, "ServiceUnavailableError", "the server is shutting down")
        if engine.is_dead:
            raise ServerError(503, "ServiceUnavailableError", f"the engine is not running: {engine.dead_reason}")
        if body_model is not None and body_model != settings.model_name:
            raise ServerError(404, "NotFoundError", f"model {body_model!r} does not exist; this server serves "
                                                    f"{settings.model_name!r}", "model")
        limit = settings.max_queued_requests
        if limit is not None and engine.num_in_flight >= limit:
            raise ServerError(503, "ServiceUnavailableError", f"too many requests in flight (limit {limit})")

    async def run(handler, body, raw: Request):
        admit(body.model)
        try:
            return await handler(body, raw, raw.state.request_id)
        except (ValueError, TokenizerError) as e:
            raise ServerError(400, "BadRequestError", str(e), str(e).split(":", 1)[0]) from None
        except EngineDeadError as e:
            raise ServerError(503, "ServiceUnavailableError", f"the engine is not running: {e}") from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await run(serving.completions, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await run(serving.chat, body, raw)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request):
        return await run(serving.embeddings, body, raw)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": int(time.time()), "owned_by": "slotserve",
            "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        admit(body.model)
        try:
            if body.messages is not None:
                text = engine.tokenizer.apply_chat_template(
                    body.messages, add_generation_prompt=body.add_generation_prompt,
                    **(body.chat_template_kwargs or {}))
            elif body.prompt is not None:
                text = body.prompt
            else:
                raise ServerError(400, "BadRequestError", "prompt: give a prompt or messages", "prompt")
        except TokenizerError as e:
            raise ServerError(400, "BadRequestError", str(e), "messages") from None
        tokens = engine.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        admit(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.input_processor.vocab_size]
        if bad:
            raise ServerError(400, "BadRequestError", f"tokens: ids {bad[:5]} are outside the vocabulary", "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/health")
    async def health():
        if state["shutting_down"] or engine.is_dead:
            return Response(status_code=503)
        try:
            await engine.stats(timeout=5.0)
        except (EngineDeadError, TimeoutError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        with contextlib.suppress(EngineDeadError, TimeoutError):
            metrics.update_engine(await engine.stats(timeout=2.0))
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _error(status: int, kind: str, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, status, param), status_code=status)


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
        logger.info("prompt throughput %.1f tok/s, generation throughput %.1f tok/s, running %d, waiting %d, "
                    "KV cache usage %.1f%%, prefix cache hit rate %.1f%%",
                    (prompt - last_prompt) / interval, (gen - last_gen) / interval, stats.running, stats.waiting,
                    100 * stats.kv_cache_usage, 100 * stats.prefix_cache_hit_rate)
        last_prompt, last_gen = prompt, gen


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process dies of the signal;
    a server that drained cleanly should exit 0 instead."""

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


async def serve(config: EngineConfig, settings: ServerSettings, host: str, port: int, log_level: str,
                shutdown_timeout: float) -> None:
    """Starts the engine core, then serves until SIGINT/SIGTERM: stop accepting, let in-flight
    requests finish for up to `shutdown_timeout` seconds, stop the engine."""
    engine = await AsyncLLM.create(config, log_level=log_level.upper())
    app = build_app(engine, settings)
    server = _GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                                            timeout_graceful_shutdown=shutdown_timeout))
    await server.serve()

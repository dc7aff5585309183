"""The messages between the front end and the engine-core process, and their msgpack encoding.

msgspec encodes and decodes these typed dataclasses directly: no pickle, so a message can carry
nothing but the declared fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from slotserve.engine.engine_core import EngineStats
from slotserve.engine.input_processor import ProcessedRequest
from slotserve.outputs import EmbeddingOutput, RequestOutput


@dataclass
class CoreCommand:
    """Front end -> engine core."""

    kind: str  # "add" | "abort" | "stats" | "debug" | "shutdown"
    request: ProcessedRequest | None = None
    request_ids: list[str] | None = None  # abort: the user request ids
    sequence_ids: list[str] | None = None  # abort: their sequences in the core
    token: int = 0  # stats: echoed in the reply


@dataclass
class CoreEvent:
    """Engine core -> front end."""

    kind: str  # "ready" | "outputs" | "stats" | "debug" | "error" | "dead"
    outputs: list[RequestOutput] | None = None
    embeddings: list[EmbeddingOutput] | None = None
    stats: EngineStats | None = None
    token: int = 0
    request_id: str | None = None  # error: the request it concerns
    message: str | None = None  # error / dead: why
    max_model_len: int = 0  # ready: the limits the front end validates against
    vocab_size: int = 0
    hidden_size: int = 0
    task: str = ""
    debug: dict[str, Any] | None = None  # debug: the engine process's snapshot (engine/diagnostics.py)


_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(CoreCommand)
_event_decoder = msgspec.msgpack.Decoder(CoreEvent)


def encode(message: CoreCommand | CoreEvent) -> bytes:
    return _encoder.encode(message)


def decode_command(data: bytes) -> CoreCommand:
    return _command_decoder.decode(data)


def decode_event(data: bytes) -> CoreEvent:
    return _event_decoder.decode(data)

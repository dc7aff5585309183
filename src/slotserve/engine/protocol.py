"""The engine core's boundary: the requests it takes, the outputs it gives, and the messages between the front
end and the engine-core process with their msgpack encoding.

Torch-free (a test imports it alone), so the front end needs nothing of the core to speak to it. Each message
is its own msgspec struct, tagged with its class name: a decoder knows every kind, and nothing but the declared
fields can cross (no pickle).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec

from slotserve.multimodal.image_input import ImageInput
from slotserve.outputs import EmbeddingOutput, PositionLogprobs, RequestOutput
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams


@dataclass
class KVSave:
    """Write the request's prompt blocks to the KV disk tier before it finishes; `name` keeps them (a manifest)."""

    name: str | None = None

    def __post_init__(self) -> None:
        if self.name is not None:
            check_save_name(self.name)


_SAVE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def check_save_name(name: str) -> str:
    """A save's name, which is a file name in the disk tier: letters, digits, '.', '_' and '-' (ValueError naming
    the field)."""
    if not isinstance(name, str) or not _SAVE_NAME.fullmatch(name):
        raise ValueError(f"name: {name!r} must be 1-128 letters, digits, '.', '_' or '-', not starting with '.'")
    return name


@dataclass
class EngineCoreRequest:
    """One sequence to sample. A user request with n > 1 becomes n of these, each with its own id."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context limit by the input processor
    arrival_time: float = field(default_factory=time.time)
    pooling: PoolingParams | None = None  # an embedding request: prefill only, one vector out
    images: list[ImageInput] = field(default_factory=list)  # in prompt order, their tokens in place
    kv_save: KVSave | None = None


@dataclass
class EngineCoreOutput:
    """What one step produced for one sequence."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # sent once, with the first token
    finish_reason: str | None = None  # "stop" (EOS or a stop token) | "length" | "abort"
    stop_reason: int | None = None  # the stop token id, when one ended it
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's vector
    num_saved_tokens: int = 0  # a save: the prompt tokens whose blocks are on disk now


@dataclass
class ProcessedRequest:
    """A user request, tokenized and validated by the front end: its sequences for the core, and what the
    output processor needs to turn their tokens into the user's outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[EngineCoreRequest]  # one per sample (n), with ids "<request_id>#<index>"


@dataclass
class SpeculationStats:
    """Speculative decoding since the engine started: tokens proposed, those kept, and the sequence-steps that
    verified some."""

    proposed: int = 0
    accepted: int = 0
    verified: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying sequence-step gave on average: those it kept and its own (vLLM's mean acceptance
        length); 0 before any."""
        return 1 + self.accepted / self.verified if self.verified else 0.0


@dataclass
class KVDiskStats:
    files: int
    bytes_used: int
    max_bytes: int
    bytes_read: int
    bytes_written: int
    corrupt_files: int
    write_errors: int
    dropped_writes: int
    evicted_files: int


@dataclass
class EngineStats:
    running: int
    waiting: int
    num_blocks: int
    num_free_blocks: int  # cached prefixes' blocks included: they are taken back when needed
    max_model_len: int
    prefix_cache_queried_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int  # of them, those found (in either tier)
    num_preemptions: int
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    prefix_cache_disk_hit_tokens: int = 0  # of the hits, those read back from the KV disk tier (--kv-offload-dir)
    kv_disk: KVDiskStats | None = None  # None without a disk tier

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    @classmethod
    def combine(cls, stats: list[EngineStats]) -> EngineStats:
        """Several replicas' stats as one engine's: counts summed, the context limit the smallest."""
        def total(name: str, of: list = stats) -> int:
            return sum(getattr(s, name) for s in of)

        disks = [s.kv_disk for s in stats if s.kv_disk is not None]
        return cls(total("running"), total("waiting"), total("num_blocks"), total("num_free_blocks"),
                   min(s.max_model_len for s in stats), total("prefix_cache_queried_tokens"),
                   total("prefix_cache_hit_tokens"), total("num_preemptions"),
                   SpeculationStats(*(total(f.name, [s.speculation for s in stats]) for f in fields(SpeculationStats))),
                   total("prefix_cache_disk_hit_tokens"),
                   KVDiskStats(*(total(f.name, disks) for f in fields(KVDiskStats))) if disks else None)


# ---- front end -> engine core ---------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True):
    request: ProcessedRequest


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]  # the user requests, for the output processor
    sequence_ids: list[str]  # their sequences in the core


class GetStats(msgspec.Struct, tag=True):
    token: int  # echoed in the reply


class GetDebug(msgspec.Struct, tag=True):
    token: int


class Shutdown(msgspec.Struct, tag=True):
    pass


CoreCommand = AddRequest | AbortRequests | GetStats | GetDebug | Shutdown


# ---- engine core -> front end ---------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True):
    """The model is loaded; the limits the front end validates against."""

    max_model_len: int
    vocab_size: int
    hidden_size: int
    task: str
    kv_offload_dir: str | None = None  # this model's directory of the KV disk tier, where named saves are listed


class Outputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    embeddings: list[EmbeddingOutput]


class Stats(msgspec.Struct, tag=True):
    token: int
    stats: EngineStats


class Debug(msgspec.Struct, tag=True):
    token: int
    snapshot: dict[str, Any]  # the engine process's threads, queues, scheduler and steps (engine/diagnostics.py)


class RequestFailed(msgspec.Struct, tag=True):
    """The core refused a request the front end let through (ValueError's message)."""

    request_id: str
    message: str


class Dead(msgspec.Struct, tag=True):
    """The engine core ended (failed to start, or a thread died): why."""

    message: str


CoreEvent = Ready | Outputs | Stats | Debug | RequestFailed | Dead

_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(CoreCommand)
_event_decoder = msgspec.msgpack.Decoder(CoreEvent)


def encode(message: CoreCommand | CoreEvent) -> bytes:
    return _encoder.encode(message)


def decode_command(data: bytes) -> CoreCommand:
    return _command_decoder.decode(data)


def decode_event(data: bytes) -> CoreEvent:
    return _event_decoder.decode(data)

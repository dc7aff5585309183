"""What crosses from the front end into the engine core, what comes back, and the core's per-request
slot: everything the engine knows about one sequence, and nothing shared with others."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from slotserve.layers.sampler import SamplingState
from slotserve.multimodal.inputs import ImageInput, RequestImages
from slotserve.outputs import PositionLogprobs
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams


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


@dataclass
class EngineCoreOutput:
    """What one step produced for one sequence."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # sent once, with the first token
    finish_reason: str | None = None  # "stop" (EOS or a stop token) | "length"
    stop_reason: int | None = None  # the stop token id, when one ended it
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's vector


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """The slot of one sequence inside the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in this request's blocks
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    num_registered_blocks: int = 0  # leading blocks already in the prefix cache
    num_cached_tokens: int = 0  # tokens taken from the prefix cache instead of computed
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    pooling: PoolingParams | None = None
    images: RequestImages | None = None

    def token_ids(self, start: int, end: int) -> list[int]:
        """(prompt + output tokens)[start:end], without building the whole list: a decode step reads one token
        of a context that may be thousands long, the prefix cache one block's."""
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        if start >= prompt:
            return self.output_token_ids[start - prompt:end - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt]

    @property
    def ready(self) -> bool:
        """Whether it can be scheduled: its grammar, if it has one (structured outputs), is compiled."""
        return self.sampling.grammar is None or self.sampling.grammar.ready()

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = RequestStatus.FINISHED, reason

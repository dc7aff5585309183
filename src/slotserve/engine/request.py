"""A request's slot: everything the engine knows about one sequence, and nothing shared with others."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from slotserve.engine.detokenizer import IncrementalDetokenizer
from slotserve.layers.sampler import SamplingState
from slotserve.outputs import CompletionOutput, PositionLogprobs
from slotserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One sampled sequence. A user request with n > 1 becomes n of these (`index` 0..n-1)."""

    request_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    detokenizer: IncrementalDetokenizer
    max_tokens: int  # resolved against the context limit at admission
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in this request's blocks
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of its full blocks
    num_registered_blocks: int = 0  # leading blocks already in the prefix cache
    num_cached_tokens: int = 0  # tokens taken from the prefix cache instead of computed
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status, self.finish_reason, self.stop_reason = RequestStatus.FINISHED, reason, stop_reason

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.detokenizer.output_text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )

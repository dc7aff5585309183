"""A sequence's slot in the engine core: everything the engine knows about one sequence (its tokens, blocks,
sampling state, images), and nothing shared with others, so sequences interleave in any order."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from slotserve.engine.protocol import KVSave
from slotserve.layers.sampler import SamplingState
from slotserve.multimodal.inputs import RequestImages
from slotserve.outputs import PositionLogprobs
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One sequence inside the engine core (a user request with n > 1 has n)."""

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
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    pooling: PoolingParams | None = None
    images: RequestImages | None = None
    kv_save: KVSave | None = None  # write its prompt's blocks to the disk tier before it finishes
    # Speculative decoding: the tokens proposed for this step, how many of its tokens the draft model's cache
    # holds, and running sums of its proposals kept and tried (engine/speculative.py's DraftSlots.note).
    draft_token_ids: list[int] = field(default_factory=list)
    num_draft_computed: int = 0
    draft_kept: float = 0.0
    draft_tried: float = 0.0

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
        return self.status is SequenceStatus.FINISHED

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = SequenceStatus.FINISHED, reason

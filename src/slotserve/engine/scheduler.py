"""Which sequences compute which tokens this step, and when a sequence is done.

FCFS: a waiting queue and a running list, bounded by `max_num_seqs` and a per-step token budget
(`max_num_batched_tokens`). Running sequences go first (one decode token each, or the next chunk of a
long prompt), so they keep streaming while a new prompt is prefilled in chunks. Blocks are taken on
demand; when they run out, the newest running sequence is preempted: its blocks are freed and it
waits at the head of the queue to be recomputed later (its full blocks often survive in the prefix
cache, which makes the recompute cheap).

With speculative decoding a decoding sequence computes its last token and room for proposed ones
(`DraftSlots`); the engine fills what its proposer finds and gives back the rest of the room.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from slotserve.engine.sequence import Sequence, SequenceStatus
from slotserve.engine.speculative import DraftSlots
from slotserve.kv_cache.manager import KVCacheManager


@dataclass
class SchedulerOutput:
    # (sequence, new tokens to compute): with speculative decoding, a decoding sequence's count holds the room for
    # its proposed tokens.
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(frozen=True)
class Stop:
    """Why a sequence ended after its latest token: `reason` "stop" or "length", and the stop token id."""

    reason: str
    token: int | None = None


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: frozenset[int] = frozenset(), max_model_len: int | None = None,
                 draft_slots: DraftSlots | None = None) -> None:
        self.kv = kv
        self.draft_slots = draft_slots
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.slots = (0, 0)  # the latest step's decoding sequences and the proposals' room each had

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        slots = self._slots()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            room = min(self._room(seq), slots, budget - 1) if slots and num_new == 1 else 0
            if room and self.kv.allocate(seq, 1 + room):  # else without room, preempting if need be
                out.scheduled.append((seq, 1 + room))
                budget -= 1 + room
                i += 1
                continue
            while not self.kv.allocate(seq, num_new):
                victim = self.running.pop()  # newest; never one already scheduled this step
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, num_new))
                budget -= num_new
                i += 1
        # Admitting while preempting would only make the next preemption come sooner.
        compiling = []  # sequences whose grammar is not compiled yet: those behind them go first
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.ready:
                compiling.append(self.waiting.popleft())
                continue
            # Waiting sequences have nothing computed; prompt logprobs need every prompt position computed.
            cached = self.kv.cached_prefix(seq) if seq.prompt_logprobs is None else []
            remaining = seq.num_tokens - seq.num_computed_tokens - len(cached) * self.kv.block_size
            num_new = min(remaining, budget)
            if not self.kv.allocate(seq, num_new, cached):
                break  # FCFS: later sequences wait behind the head instead of overtaking it
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        return out

    def _slots(self) -> int:
        """The proposed tokens each decoding sequence may verify this step (speculative decoding); kept in
        `slots`, with the decoding sequences' count, for the engine to time the step by."""
        self.slots = (0, 0)
        if self.draft_slots is None:
            return 0
        decoding = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens == 1]
        self.slots = (len(decoding), self.draft_slots.choose(decoding, len(self.running)))
        return self.slots[1]

    def _room(self, seq: Sequence) -> int:
        """How many proposed tokens could still become this sequence's: before max_tokens and the context's end
        (the last of a step's tokens is always its own), none for one with images or for an embedding."""
        if seq.images is not None or seq.pooling is not None:
            return 0
        room = seq.max_tokens - len(seq.output_token_ids) - 1
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - seq.num_tokens - 1)
        return max(room, 0)

    def append_token(self, seq: Sequence, token: int) -> Stop | None:
        """Adds a sampled token to the sequence; where it ends the sequence (EOS, a stop token, max_tokens or the
        context limit), finishes it and says why."""
        seq.output_token_ids.append(token)
        seq.sampling.append(token)
        stop = self._stop(seq, token)
        if stop is not None:
            self.finish(seq, stop.reason)
        return stop

    def _stop(self, seq: Sequence, token: int) -> Stop | None:
        params = seq.params
        enough = len(seq.output_token_ids) >= params.min_tokens
        if enough and not params.ignore_eos and token in self.eos_token_ids:
            return Stop("stop")
        if enough and token in params.stop_token_ids:
            return Stop("stop", token)
        if len(seq.output_token_ids) >= seq.max_tokens or (self.max_model_len is not None
                                                           and seq.num_tokens >= self.max_model_len):
            return Stop("length")
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = seq.num_draft_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < len(seq.prompt_token_ids):
            seq.prompt_logprobs = []  # recomputed from the start with the prompt
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends a sequence in any state and returns its blocks to the pool."""
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        self.kv.free(seq)
        seq.finish(reason)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

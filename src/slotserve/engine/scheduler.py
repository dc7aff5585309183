"""Which requests compute which tokens this step.

FCFS: a waiting queue and a running list, bounded by `max_num_seqs` and a per-step token budget
(`max_num_batched_tokens`). Running requests go first (one decode token each, or the next chunk of a
long prompt), so they keep streaming while a new prompt is prefilled in chunks. Blocks are taken on
demand; when they run out, the newest running request is preempted: its blocks are freed and it
waits at the head of the queue to be recomputed later (its full blocks often survive in the prefix
cache, which makes the recompute cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from slotserve.engine.request import Request, RequestStatus
from slotserve.kv_cache.manager import KVCacheManager


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens to compute)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate(request, num_new):
                victim = self.running.pop()  # newest; never one already scheduled this step
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append((request, num_new))
                budget -= num_new
                i += 1
        # Admitting while preempting would only make the next preemption come sooner.
        compiling = []  # requests whose grammar is not compiled yet: those behind them go first
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not request.ready:
                compiling.append(self.waiting.popleft())
                continue
            cached = self.kv.cached_prefix(request)  # waiting requests have nothing computed
            remaining = request.num_tokens - request.num_computed_tokens - len(cached) * self.kv.block_size
            num_new = min(remaining, budget)
            if not self.kv.allocate(request, num_new, cached):
                break  # FCFS: later requests wait behind the head instead of overtaking it
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append((request, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))
        return out

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        if request.prompt_logprobs is not None and len(request.prompt_logprobs) < len(request.prompt_token_ids):
            request.prompt_logprobs = []  # recomputed from the start with the prompt
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def finish(self, request: Request, reason: str) -> None:
        """Ends a request in any state and returns its blocks to the pool."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        self.kv.free(request)
        request.finish(reason)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

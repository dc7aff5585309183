"""First-come-first-served admission into a bounded running set.

A request is admitted only when the blocks for its whole context (prompt + max_tokens) are free,
so a running request never runs out of cache. Each step prefills the newly admitted requests
whole and decodes one token for every other running request, all in one flat batch.
"""

from __future__ import annotations

from collections import deque

from slotserve.engine.request import Request, RequestStatus
from slotserve.kv_cache.block_pool import BlockPool


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_num_seqs: int) -> None:
        self.pool, self.block_size, self.max_num_seqs = pool, block_size, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[Request]:
        """The requests that run this step: all running ones plus those admitted now."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            needed = self.blocks_for(len(request.prompt_token_ids) + request.max_tokens)
            if needed > self.pool.num_free:
                break  # FCFS: later requests wait behind the head instead of overtaking it
            self.waiting.popleft()
            request.block_table = self.pool.allocate(needed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        return list(self.running)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Ends a request in any state and returns its blocks to the pool."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.pool.free(request.block_table)
            request.block_table = []
        request.finish(reason, stop_reason)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

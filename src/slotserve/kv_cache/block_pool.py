"""The pool of fixed-size KV cache blocks: every block is either free or owned by one request."""

from __future__ import annotations

import heapq


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        # A heap hands out the lowest free ids first, so a request's blocks tend to be consecutive
        # and attention reads them in place instead of gathering.
        self._free: list[int] = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"KV cache: {count} blocks requested, {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            heapq.heappush(self._free, block)

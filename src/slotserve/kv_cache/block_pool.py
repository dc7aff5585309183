"""The pool of fixed-size KV cache blocks: reference-counted, with full blocks reusable by content.

Every block is in exactly one of two states: owned (ref_count > 0, by one or more requests sharing a
prefix) or free (ref_count == 0, in the free queue). A free block may still hold a cached prefix: it
keeps its hash until it is handed out again, so a later request with the same tokens can take it
back. The free queue is least-recently-used first, so eviction takes the block unused the longest.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and registered in the prefix cache
    token_ids: tuple | None = None  # its tokens (and image keys), to verify a hash hit


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[Block], None] | None = None) -> None:
        """on_evict: called with a cached block about to be handed out again, while it still holds its prefix."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_evict = on_evict
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, Block] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks findable by the prefix cache (in use or free until reused)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Hands out `count` free blocks (evicting whatever prefix they cached) with ref_count 1."""
        if count > len(self._free):
            raise MemoryError(f"KV cache: {count} blocks requested, {len(self._free)} free")
        ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
                del self._cached[block.hash]
                block.hash = block.token_ids = None
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference to each block. The last blocks of a sequence are queued first, so they
        are evicted before the shared beginning of the prefix."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"KV cache: block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: int, token_ids: tuple) -> int | None:
        """The block caching exactly these tokens after this prefix, if any."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids:  # a hash collision is a miss
            return None
        return block.block_id

    def touch(self, block_ids: list[int]) -> None:
        """Takes a reference to cached blocks found by `lookup` (taking them off the free queue)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def cache(self, block_id: int, block_hash: int, token_ids: tuple) -> None:
        """Registers a full, computed block under the hash of its prefix."""
        block = self.blocks[block_id]
        if block.hash is not None or block_hash in self._cached:
            return  # already registered, or the same content lives in another block
        block.hash, block.token_ids = block_hash, token_ids
        self._cached[block_hash] = block

    def num_evictable(self, block_ids: list[int]) -> int:
        """How many of these blocks sit in the free queue (a `touch` takes them out of it)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def check_whole(self) -> None:
        """Every block is free or cached-and-unreferenced: nothing leaked, nothing double-freed."""
        owned = [b.block_id for b in self.blocks if b.ref_count != 0]
        if owned or len(self._free) != self.num_blocks:
            raise AssertionError(f"KV cache: blocks still referenced: {owned[:10]}; "
                                 f"{len(self._free)} of {self.num_blocks} in the free queue")

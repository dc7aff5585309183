"""Per-sequence KV cache bookkeeping: block tables, the prefix cache, hit-rate counters.

A full block is identified by a hash chained over the previous block's hash and its own token ids (and,
for image tokens, their image's content hash), so equal hashes mean equal whole prefixes; hits are
verified against the stored tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from slotserve.kv_cache.block_pool import BlockPool

_ROOT_HASH = 0x51_07_5E_12


class BlockKeys(Protocol):
    def block_key(self, start: int, end: int) -> tuple: ...


class CachedSeq(Protocol):
    """What the cache keeps of a sequence (the engine's `Sequence`): its blocks, and the tokens they hold."""

    block_table: list[int]
    block_hashes: list[int]  # chained hashes of its full blocks
    num_registered_blocks: int  # leading blocks already in the prefix cache
    num_computed_tokens: int
    num_cached_tokens: int
    images: BlockKeys | None  # what besides token ids tells its blocks apart

    @property
    def num_tokens(self) -> int: ...

    def token_ids(self, start: int, end: int) -> list[int]: ...


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = PrefixCacheStats()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, seq: CachedSeq) -> list[int]:
        """The longest run of cached blocks matching the sequence's first tokens. At least one token is
        left to compute, because the last position's logits are needed to sample."""
        if not self.enable_prefix_caching:
            return []
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.block_size)
        found = []
        for i, block_hash in enumerate(hashes):
            block_id = self.pool.lookup(block_hash, self._block_tokens(seq, i))
            if block_id is None:
                break
            found.append(block_id)
        self.stats.queried_tokens += seq.num_tokens
        self.stats.hit_tokens += len(found) * self.block_size
        return found

    def allocate(self, seq: CachedSeq, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Adds `cached` prefix blocks and enough fresh blocks for `num_new_tokens` more tokens to the
        sequence's table; False (and no change) when the pool cannot supply them."""
        total = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        needed = self.blocks_for(total) - len(seq.block_table) - len(cached)
        if needed > self.pool.num_free - self.pool.num_evictable(cached):
            return False
        self.pool.touch(list(cached))
        seq.block_table += cached
        seq.num_computed_tokens += len(cached) * self.block_size
        seq.num_cached_tokens += len(cached) * self.block_size
        seq.num_registered_blocks += len(cached)
        if needed > 0:
            seq.block_table += self.pool.allocate(needed)
        return True

    def register_full_blocks(self, seq: CachedSeq) -> None:
        """Makes the sequence's newly computed full blocks findable by later sequences."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.pool.cache(seq.block_table[i], hashes[i], self._block_tokens(seq, i))
        seq.num_registered_blocks = full

    def free(self, seq: CachedSeq) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _block_tokens(self, seq: CachedSeq, i: int) -> tuple:
        """Block i's token ids, and its images' identities where it holds image tokens."""
        start, end = i * self.block_size, (i + 1) * self.block_size
        tokens = tuple(seq.token_ids(start, end))
        return tokens + seq.images.block_key(start, end) if seq.images is not None else tokens

    def _hashes(self, seq: CachedSeq, count: int) -> list[int]:
        """The chained hashes of the sequence's first `count` full blocks, extended incrementally."""
        hashes = seq.block_hashes
        while len(hashes) < count:
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash((parent, self._block_tokens(seq, len(hashes)))))
        return hashes[:count]

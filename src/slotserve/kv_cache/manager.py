"""Per-request KV cache bookkeeping: block tables, the prefix cache, hit-rate counters.

A full block is identified by a hash chained over the previous block's hash and its own token ids (and,
for image tokens, their image's content hash), so equal hashes mean equal whole prefixes; hits are
verified against the stored tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.engine.request import Request
from slotserve.kv_cache.block_pool import BlockPool

_ROOT_HASH = 0x51_07_5E_12


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

    def cached_prefix(self, request: Request) -> list[int]:
        """The longest run of cached blocks matching the request's first tokens. At least one token is
        left to compute, because the last position's logits are needed to sample."""
        if not self.enable_prefix_caching or request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position computed
        hashes = self._hashes(request, (request.num_tokens - 1) // self.block_size)
        found = []
        for i, block_hash in enumerate(hashes):
            block_id = self.pool.lookup(block_hash, self._block_tokens(request, i))
            if block_id is None:
                break
            found.append(block_id)
        self.stats.queried_tokens += request.num_tokens
        self.stats.hit_tokens += len(found) * self.block_size
        return found

    def allocate(self, request: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Adds `cached` prefix blocks and enough fresh blocks for `num_new_tokens` more tokens to the
        request's table; False (and no change) when the pool cannot supply them."""
        total = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        needed = self.blocks_for(total) - len(request.block_table) - len(cached)
        if needed > self.pool.num_free - self.pool.num_evictable(cached):
            return False
        self.pool.touch(list(cached))
        request.block_table += cached
        request.num_computed_tokens += len(cached) * self.block_size
        request.num_cached_tokens += len(cached) * self.block_size
        request.num_registered_blocks += len(cached)
        if needed > 0:
            request.block_table += self.pool.allocate(needed)
        return True

    def register_full_blocks(self, request: Request) -> None:
        """Makes the request's newly computed full blocks findable by later requests."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        if full <= request.num_registered_blocks:
            return
        hashes = self._hashes(request, full)
        for i in range(request.num_registered_blocks, full):
            self.pool.cache(request.block_table[i], hashes[i], self._block_tokens(request, i))
        request.num_registered_blocks = full

    def free(self, request: Request) -> None:
        self.pool.free(request.block_table)
        request.block_table = []
        request.num_registered_blocks = 0

    def _block_tokens(self, request: Request, i: int) -> tuple:
        """Block i's token ids, and its images' identities where it holds image tokens."""
        start, end = i * self.block_size, (i + 1) * self.block_size
        tokens = tuple(request.token_ids(start, end))
        return tokens + request.images.block_key(start, end) if request.images is not None else tokens

    def _hashes(self, request: Request, count: int) -> list[int]:
        """The chained hashes of the request's first `count` full blocks, extended incrementally."""
        hashes = request.block_hashes
        while len(hashes) < count:
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash((parent, self._block_tokens(request, len(hashes)))))
        return hashes[:count]

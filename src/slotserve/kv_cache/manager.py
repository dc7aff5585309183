"""Per-sequence KV cache bookkeeping: block tables, the prefix cache, hit-rate counters.

A full block is identified by a hash chained over the previous block's hash and its own token ids (and,
for image tokens, their image's content hash), so equal hashes mean equal whole prefixes; hits are
verified against the stored tokens. The hash is a 128-bit blake2b, the same in every process, so it also
names the block's file in the disk tier (disk_tier.py): a prefix found there is read back into a memory
block, which then serves it like any memory hit.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Protocol

from slotserve.kv_cache.block_pool import Block, BlockPool
from slotserve.kv_cache.disk_tier import BlockWrite, DiskTier

_ROOT_HASH = 0x51_07_5E_12


class BlockData(Protocol):
    """The KV cache's memory, one block at a time (engine/kv_offload.py's KVBlockIO)."""

    def copy_out(self, block_id: int) -> bytes: ...

    def view(self, block_id: int) -> object: ...

    def to_bytes(self, view: object) -> bytes: ...

    def copy_in(self, block_id: int, payload: bytes) -> None: ...


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
    hit_tokens: int = 0  # from either tier
    disk_hit_tokens: int = 0  # of those, read back from the disk tier

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 disk: DiskTier | None = None, data: BlockData | None = None) -> None:
        if (disk is None) != (data is None):
            raise ValueError("disk: a disk tier needs the cache's block data, and only with one")
        self.pool = BlockPool(num_blocks, on_evict=self._evicted if disk is not None else None)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.disk, self.data = disk, data
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
        loaded = []
        if self.disk is not None and len(found) < len(hashes):
            self.pool.touch(found)  # held while loading, so a block taken for a disk hit cannot evict them
            loaded = self._load_from_disk(seq, hashes, len(found))
            self.pool.free(found + loaded)  # back to the free queue as cached blocks, for `allocate` to take
        self.stats.queried_tokens += seq.num_tokens
        self.stats.hit_tokens += (len(found) + len(loaded)) * self.block_size
        self.stats.disk_hit_tokens += len(loaded) * self.block_size
        return found + loaded

    def _load_from_disk(self, seq: CachedSeq, hashes: list[int], start: int) -> list[int]:
        """Reads the blocks after the memory hits that the disk tier holds into free blocks, registered in the
        prefix cache, until the first miss; they are returned referenced. Synchronous on the step thread: a
        block's file reads in well under a millisecond (docs/kv_offload.md)."""
        loaded: list[int] = []
        for i in range(start, len(hashes)):
            if self.pool.num_free == 0 or not self.disk.contains(hashes[i]):
                break
            tokens = self._block_tokens(seq, i)
            payload = self.disk.read(hashes[i], tokens[:self.block_size])
            if payload is None:
                break
            block_id = self.pool.allocate(1)[0]
            self.data.copy_in(block_id, payload)
            self.pool.cache(block_id, hashes[i], tokens)
            loaded.append(block_id)
        return loaded

    def _evicted(self, block: Block) -> None:
        """A cached block is about to be reused: its keys and values go to the disk tier first, unless it holds them."""
        if not self.disk.contains(block.hash):
            self.disk.offer(BlockWrite(block.hash, block.token_ids[:self.block_size],
                                       _ready(self.data.copy_out(block.block_id))))

    def save_job_blocks(self, seq: CachedSeq) -> tuple[list[int], list[BlockWrite]]:
        """The sequence's full, registered blocks as writes that read the cache directly, each referenced once
        more so none is reused before the writer is done (`release` them then)."""
        ids, writes = [], []
        for i, block_hash in enumerate(self._hashes(seq, seq.num_computed_tokens // self.block_size)):
            tokens = self._block_tokens(seq, i)
            block_id = self.pool.lookup(block_hash, tokens)
            if block_id is None:
                break
            ids.append(block_id)
            writes.append(BlockWrite(block_hash, tokens[:self.block_size], self._reader(block_id)))
        self.pool.touch(ids)
        return ids, writes

    def _reader(self, block_id: int):
        view = self.data.view(block_id)
        return lambda: self.data.to_bytes(view)

    def release(self, block_ids: list[int]) -> None:
        self.pool.free(block_ids)

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
            hashes.append(block_hash(parent, self._block_tokens(seq, len(hashes)), self.block_size))
        return hashes[:count]


def block_hash(parent: int, key: tuple, block_size: int) -> int:
    """The 128-bit hash of a block after the prefix hashed `parent`: its token ids, then its images' keys."""
    h = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16)
    h.update(struct.pack(f"<{block_size}q", *key[:block_size]))
    if len(key) > block_size:
        h.update(repr(key[block_size:]).encode())
    return int.from_bytes(h.digest(), "little")


def _ready(payload: bytes):
    return lambda: payload

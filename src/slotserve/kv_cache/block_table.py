"""A sequence's block table: the KV cache blocks that hold its positions, in order. Each layer's cache is
[num_blocks * block_size, kv_heads, head_dim], and position p of a sequence keeps its key and value at cache
index table[p // block_size] * block_size + p % block_size. The bound checks and that arithmetic, for the
model runner and the fused decode step."""

from __future__ import annotations

import array
import itertools


class BlockTableError(ValueError):
    """A block table that does not reach a position it is asked to hold, or names a block the cache lacks."""


def _check(table: list[int], start: int, end: int, block_size: int) -> None:
    if start < 0 or end > len(table) * block_size:
        raise BlockTableError(f"positions {start}..{end - 1}: not all within a block table of {len(table)} "
                              f"blocks of {block_size}")


def cache_index(table: list[int], position: int, block_size: int) -> int:
    """Where in the cache the key and value of `position` go (BlockTableError: outside the table)."""
    _check(table, position, position + 1, block_size)
    return table[position // block_size] * block_size + position % block_size


def cache_indices(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """`cache_index` of positions start..end-1."""
    _check(table, start, end, block_size)
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def padded_tables(tables: list[list[int]], width: int, num_blocks: int) -> array.array:
    """The first `width` block ids of each table, a shorter one padded with block 0, as one C int array
    [len(tables) * width] (built straight from the lists: a tensor of nested lists costs more than a batch-1
    step's other Python). BlockTableError where one of them is not a block of a cache of `num_blocks`."""
    flat = array.array("i", itertools.chain.from_iterable(t[:width] + [0] * (width - len(t)) for t in tables))
    if flat and (min(flat) < 0 or max(flat) >= num_blocks):
        raise BlockTableError(f"a block id is out of range for a KV cache of {num_blocks} blocks")
    return flat

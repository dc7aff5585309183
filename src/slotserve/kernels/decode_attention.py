"""Decode attention read straight from the paged KV cache (decode_attention.c), called from Python."""

from __future__ import annotations

import array
import ctypes
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from slotserve.kernels import native

SOURCE = Path(__file__).with_name("decode_attention.c")
_ARGS = (ctypes.c_void_p,) * 6 + (ctypes.c_long, ctypes.c_void_p) + (ctypes.c_long,) * 5 + (
    ctypes.c_float, ctypes.c_int)


def available() -> bool:
    return native.function(SOURCE, "slotserve_decode_attention", _ARGS) is not None


@dataclass(frozen=True)
class PagedTables:
    """Which cache entries each decode row reads: sequence b's query row rows[b] attends to its first
    lens[b] positions, held in blocks block_tables[b]. Checked once when built (a step's every layer
    reads the same tables), since the kernel trusts them: a call then only compares the two bounds."""

    rows: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, width] int32, padded with any valid block
    lens: torch.Tensor  # [B] int32
    blocks_needed: int  # 1 + the largest block id: the cache must hold this many blocks
    rows_needed: int  # 1 + the largest query row: q must have this many rows

    @classmethod
    def build(cls, rows: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, block_size: int) -> PagedTables:
        seqs = rows.shape[0]
        if (rows.dtype != torch.long or block_tables.dtype != torch.int32 or lens.dtype != torch.int32
                or rows.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != seqs
                or lens.shape != (seqs,)):
            raise ValueError("decode_attention: rows int64 [seqs], block_tables int32 [seqs, width], lens int32 [seqs]")
        rows_at, blocks_at, lens_at = ((int(t.min()), int(t.max())) if t.numel() else None
                                       for t in (rows, block_tables, lens))
        return cls._checked(rows.contiguous(), block_tables.contiguous(), lens.contiguous(), block_size,
                            rows_at, blocks_at, lens_at)

    @classmethod
    def from_lists(cls, rows: list[int], block_tables: list[list[int]], lens: list[int], block_size: int,
                   device: torch.device) -> PagedTables:
        """`build` from Python lists (block_tables padded to one width): rows and lens checked on the lists (at
        batch 1 tensor reductions over them cost more than the rest of a step's Python), the tables by one."""
        # The tables go through a C int array, 2.5x faster than torch.tensor on nested lists (a 32k-token
        # context is 2000 ids a step), and their bounds through aminmax, which beats min and max on all but
        # the smallest tables.
        width = len(block_tables[0]) if block_tables else 0
        flat = array.array("i", itertools.chain.from_iterable(block_tables))
        if len(flat) != len(block_tables) * width:
            raise ValueError("decode_attention: block_tables must be padded to one width")
        tables = (torch.frombuffer(flat, dtype=torch.int32) if flat else torch.empty(0, dtype=torch.int32))
        tables = tables.view(len(block_tables), width).to(device)
        blocks_at = tuple(int(v) for v in torch.aminmax(tables)) if flat else None
        rows_at, lens_at = ((min(xs), max(xs)) if xs else None for xs in (rows, lens))
        return cls._checked(torch.tensor(rows, dtype=torch.long, device=device), tables,
                            torch.tensor(lens, dtype=torch.int32, device=device), block_size,
                            rows_at, blocks_at, lens_at)

    @classmethod
    def _checked(cls, rows: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                 rows_at: tuple[int, int] | None, blocks_at: tuple[int, int] | None,
                 lens_at: tuple[int, int] | None) -> PagedTables:
        """The tables, given each one's (min, max) (None: empty), once they are in range."""
        if rows.shape[0] and (lens_at[0] < 1 or lens_at[1] > block_tables.shape[1] * block_size
                              or blocks_at is None or blocks_at[0] < 0 or rows_at[0] < 0):
            raise ValueError("decode_attention: lens, block_tables or rows out of range for the cache or the batch")
        return cls(rows, block_tables, lens, blocks_at[1] + 1 if blocks_at else 0, rows_at[1] + 1 if rows_at else 0)

    def check(self, cache_blocks: int, rows: int) -> None:
        """Raises ValueError unless these tables fit a cache of `cache_blocks` blocks and a batch of `rows`."""
        if self.blocks_needed > cache_blocks or self.rows_needed > rows:
            raise ValueError("decode_attention: lens, block_tables or rows out of range for the cache or the batch")


def decode_attention(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: PagedTables, block_size: int, scale: float) -> None:
    """For each sequence b, out[rows[b]] = softmax(q[rows[b]] K^T * scale) V over its first lens[b] cache
    positions. q, out: [tokens, heads, head_dim]; caches: [entries, kv_heads, head_dim]; float32 CPU tensors,
    contiguous."""
    attend = native.require(native.function(SOURCE, "slotserve_decode_attention", _ARGS), SOURCE)
    heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[1]
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"decode_attention: {name} must be a contiguous float32 CPU tensor")
    if heads % kv_heads or out.shape != q.shape or k_cache.shape != v_cache.shape or k_cache.shape[2] != head_dim:
        raise ValueError(f"decode_attention: shapes q {tuple(q.shape)}, out {tuple(out.shape)}, "
                         f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit together")
    tables.check(k_cache.shape[0] // block_size, q.shape[0])
    if attend(q.data_ptr(), out.data_ptr(), tables.rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
              tables.block_tables.data_ptr(), tables.block_tables.shape[1], tables.lens.data_ptr(),
              tables.rows.shape[0], heads, kv_heads, head_dim, block_size, scale, torch.get_num_threads()):
        raise MemoryError("decode_attention: no memory for the score buffers")

"""Attention over a paged KV cache, for one flat batch of tokens from many sequences.

Every layer's cache is a pair of tensors [num_blocks * block_size, kv_heads, head_dim], position p of a
sequence at index `block_table[p // block_size] * block_size + p % block_size` (kv_cache/block_table.py).
The model runner says, per step, where each new token's K/V goes (`cache_indices`) and which blocks hold each
sequence's history (`block_tables`).

How the history is read (`python -m slotserve.bench.dev attention` measures the choices on this machine):
- on the CPU in float32 (decode mode "paged", where the kernel builds), every decode row is read by our
  own kernel (kernels/decode_attention.c) straight from its blocks: no copy, one call for all of them;
- otherwise a sequence whose blocks are consecutive is one slice of the cache, read in place, no copy;
- decode rows (one new token) of the other sequences, and those whose short context is cheaper to copy
  than to give a call of its own, are batched: one gather of all their contexts, padded, and one SDPA
  call for all of them, instead of a gather and a call per sequence;
- prefill chunks attend one sequence at a time (their queries make the call worth its overhead).
Apart from that kernel this backend is plain `torch` (SDPA), so it runs on CUDA too; a fused CUDA
paged kernel would fit in behind the same `AttentionMetadata`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.kernels import decode_attention
from slotserve.kernels.decode_attention import PagedTables
from slotserve.layers.linear import Shard

DECODE_MODES = ("paged", "batched", "per_seq")
# Every sequence is attended with its keys padded (and masked) to a multiple of this. torch's CPU
# attention kernel gives a query row the same bits for any key count from the next multiple of 16 on
# (of 8 on AVX2; measured on torch 2.13), so a sequence's output is the same read in place, gathered,
# or padded into a batch with longer ones: what keeps results batch-invariant where rounding would
# magnify a last-bit difference (int8).
KEY_ALIGN = 16
# On the CPU a chunk's query rows are attended in pieces of this many, each over only the keys its last
# row sees: torch's kernel masks but does not skip, so one call computes the whole square of a causal
# triangle. Pieces of 64 ran a 512-token prompt's attention 1.5x as fast as one call, and beat pieces of 128.
QUERY_PIECE = 64


class GatherWorkspace:
    """Scratch buffers that gathered K/V land in, reused by every layer and every step.

    A fresh multi-MB tensor per gather page-faults all of its memory each time (glibc maps large
    allocations anew); gathering into memory that is already mapped is several times faster here."""

    def __init__(self) -> None:
        self._k = self._v = torch.empty(0)

    def take(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [rows, *like.shape[1:]] buffers; valid until the next call."""
        if self._k.shape[0] < rows or self._k.shape[1:] != like.shape[1:] or self._k.dtype != like.dtype:
            shape = (max(rows, 2 * self._k.shape[0]), *like.shape[1:])
            self._k = torch.empty(shape, dtype=like.dtype, device=like.device)
            self._v = torch.empty_like(self._k)
        return self._k[:rows], self._v[:rows]


@dataclass
class DecodeBatch:
    """Decode rows read through one padded gather: row i attends to indices[i, :seq_len_i]."""

    rows: torch.Tensor  # [B] query rows in the flat batch
    indices: torch.Tensor  # [B, max_len] cache indices, padded with index 0 (max_len: padded_len of the longest)
    mask: torch.Tensor  # [B, 1, 1, max_len] True where an index is real


@dataclass
class AttentionMetadata:
    """The layout of one step's flat batch: sequence i owns query rows query_start[i]:query_start[i+1]."""

    query_start: list[int]  # len = num_seqs + 1
    seq_lens: list[int]  # tokens in context after this step (history + new), per sequence
    cache_indices: torch.Tensor  # [num_tokens] where in the cache each new token's K/V goes
    context: list[slice | torch.Tensor | None]  # per sequence its context's cache indices; None: in `decode`
    decode: DecodeBatch | PagedTables | None = None  # PagedTables: the native kernel's
    workspace: GatherWorkspace | None = None
    block_size: int = 0
    masks: dict[int, torch.Tensor] = field(default_factory=dict)  # per sequence, built by its first layer

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(
        cls, query_lens: list[int], seq_lens: list[int], cache_indices: torch.Tensor,
        block_tables: list[list[int]], block_size: int, decode_mode: str = "batched",
        workspace: GatherWorkspace | None = None, gather_limit: int = 0,
    ) -> AttentionMetadata:
        """gather_limit: decode rows with at most this much context join the batched gather even when
        their blocks are consecutive (`gather_max_tokens`)."""
        if decode_mode not in DECODE_MODES:
            raise ValueError(f"decode_mode: must be one of {DECODE_MODES}, got {decode_mode!r}")
        device = cache_indices.device
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        context: list[slice | torch.Tensor | None] = []
        batched: list[int] = []
        paged = decode_mode == "paged"
        several_decodes = decode_mode == "batched" and query_lens.count(1) > 1
        for i, (table, length) in enumerate(zip(block_tables, seq_lens, strict=True)):
            # With company, a decode row whose context is cheap to copy joins the batched gather even when
            # it could be read in place: one SDPA call per sequence costs more than the copy.
            join_batch = paged or (several_decodes and query_lens[i] == 1 and length <= gather_limit)
            start = None if join_batch else _consecutive_start(table, length, block_size)  # a walk of its blocks
            if start is not None:
                context.append(slice(start, start + padded_len(length)))
            elif decode_mode != "per_seq" and query_lens[i] == 1:
                context.append(None)
                batched.append(i)
            else:
                context.append(_cache_indices(table, block_size, padded_len(length), device))
        batch = ([query_start[i] for i in batched], [block_tables[i] for i in batched], [seq_lens[i] for i in batched])
        decode = None if not batched else (_paged_batch if paged else _decode_batch)(*batch, block_size, device)
        return cls(query_start, list(seq_lens), cache_indices, context, decode, workspace or GatherWorkspace(),
                   block_size)


def gather_max_tokens(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Context (tokens) up to which copying a decode row's K/V into the batched gather beats reading it
    in place with an SDPA call of its own: 512 KiB per layer, between the default model's decode rows at 256
    tokens of context (256 KiB each), which run faster gathered, and Qwen3-0.6B's at ~750 tokens (6 MiB
    each), which run 1.7x faster in place."""
    per_token = 2 * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    return (512 << 10) // per_token


def padded_len(length: int) -> int:
    """The key count a sequence of `length` tokens is attended with: the next multiple of KEY_ALIGN."""
    return -(-length // KEY_ALIGN) * KEY_ALIGN


def causal_mask(queries: int, seq_len: int, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive mask [queries, keys] of a sequence's last `queries` rows of `seq_len`: 0 where a row
    sees a key, -inf past it (its future, the padding). Always explicit, never is_causal: the two take
    different kernel paths, and a prompt must give the same bits however it is batched. Additive rather
    than boolean: SDPA turns a boolean mask into this one on every call, here built once per step."""
    positions = torch.arange(seq_len - queries, seq_len, device=device)[:, None]
    hidden = torch.arange(keys, device=device)[None, :] > positions
    return torch.zeros(queries, keys, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def _consecutive_start(blocks: list[int], length: int, block_size: int) -> int | None:
    """The first cache index of a sequence whose blocks, as far as its padded length reaches, are consecutive."""
    needed = -(-padded_len(length) // block_size)
    if needed <= len(blocks) and all(blocks[j + 1] == blocks[j] + 1 for j in range(needed - 1)):
        return blocks[0] * block_size
    return None


def _cache_indices(blocks: list[int], block_size: int, width: int, device: torch.device) -> torch.Tensor:
    """The cache indices of a sequence's first `width` positions; past its blocks, index 0 (masked out)."""
    used = blocks[: -(-min(width, len(blocks) * block_size) // block_size)]
    indices = (torch.tensor(used, device=device)[:, None] * block_size + torch.arange(block_size, device=device))
    indices = indices.flatten()[:width]
    return torch.nn.functional.pad(indices, (0, width - len(indices)))


def _decode_batch(rows: list[int], tables: list[list[int]], lengths: list[int], block_size: int,
                  device: torch.device) -> DecodeBatch:
    width = padded_len(max(lengths))
    indices = torch.stack([_cache_indices(table, block_size, width, device) for table in tables])
    lens = torch.tensor(lengths, device=device)
    mask = (torch.arange(width, device=device)[None, :] < lens[:, None])[:, None, None, :]
    return DecodeBatch(torch.tensor(rows, device=device), indices, mask)


def _paged_batch(rows: list[int], tables: list[list[int]], lengths: list[int], block_size: int,
                 device: torch.device) -> PagedTables:
    width = max(-(-n // block_size) for n in lengths)
    padded = [table[:width] + [0] * (width - len(table[:width])) for table in tables]
    return PagedTables.from_lists(rows, padded, lengths, block_size, device)


def kv_head_shard(num_kv_heads: int, rank: int, ranks: int) -> Shard:
    """The KV heads (in heads) rank `rank` of `ranks` holds under tensor parallel: an even part where they
    split, else the one head its query heads read, each on `ranks / num_kv_heads` ranks."""
    if num_kv_heads >= ranks:
        if num_kv_heads % ranks:
            raise ValueError(f"tensor_parallel_size: {ranks} ranks cannot split {num_kv_heads} KV heads")
        return Shard.of(0, num_kv_heads, rank, ranks)
    if ranks % num_kv_heads:
        raise ValueError(f"tensor_parallel_size: {ranks} ranks cannot share {num_kv_heads} KV heads evenly")
    head = rank // (ranks // num_kv_heads)
    return Shard(0, head, head + 1, num_kv_heads)


def paged_decode_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode mode "paged" runs here: a CPU float32 cache and a built kernel."""
    return device.type == "cpu" and dtype == torch.float32 and decode_attention.available()


class Attention(nn.Module):
    """Writes the step's K/V into the cache, then attends each sequence's queries to its context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.gqa = num_heads != num_kv_heads
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.k_cache.index_copy_(0, meta.cache_indices, k)
        self.v_cache.index_copy_(0, meta.cache_indices, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for i, indices in enumerate(meta.context):
            if indices is None:
                continue
            start, end = meta.query_start[i], meta.query_start[i + 1]
            keys, values = self._read(indices, meta.workspace)
            if i not in meta.masks:
                meta.masks[i] = causal_mask(end - start, meta.seq_lens[i], keys.shape[0], q.dtype, q.device)
            piece = QUERY_PIECE if q.device.type == "cpu" else end - start
            for first in range(0, end - start, piece):
                last = min(first + piece, end - start)  # rows first..last-1 of the chunk
                width = padded_len(meta.seq_lens[i] - (end - start) + last)  # the keys its last row sees
                out[start + first:start + last] = self._attend(q[start + first:start + last], keys[:width],
                                                               values[:width], meta.masks[i][first:last, :width])
        if isinstance(meta.decode, PagedTables):
            decode_attention.decode_attention(q.contiguous(), out, self.k_cache, self.v_cache, meta.decode,
                                              meta.block_size, self.scale)
        elif meta.decode is not None:
            out[meta.decode.rows] = self._attend_decode(q, meta.decode, meta.workspace)
        return out

    def _read(self, indices: slice | torch.Tensor, workspace: GatherWorkspace) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(indices, slice):
            return self.k_cache[indices], self.v_cache[indices]
        keys, values = workspace.take(len(indices), self.k_cache)
        torch.index_select(self.k_cache, 0, indices, out=keys)
        torch.index_select(self.v_cache, 0, indices, out=values)
        return keys, values

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One sequence's query rows over its padded keys, with `causal_mask`'s rows for them."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, scale=self.scale, enable_gqa=self.gqa,
        )
        return out.squeeze(0).transpose(0, 1)

    def _attend_decode(self, q: torch.Tensor, batch: DecodeBatch, workspace: GatherWorkspace) -> torch.Tensor:
        shape = (*batch.indices.shape, self.num_kv_heads, self.head_dim)
        keys, values = self._read(batch.indices.flatten(), workspace)
        keys = keys.view(shape).transpose(1, 2)  # [B, kv_heads, max_len, head_dim]
        values = values.view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q[batch.rows].unsqueeze(2), keys, values, attn_mask=batch.mask,
                                             scale=self.scale, enable_gqa=self.gqa)
        return out.squeeze(2)

"""Attention over a paged KV cache, for one flat batch of tokens from many sequences.

Every layer's cache is a pair of tensors [num_slots, kv_heads, head_dim] where a slot is
`block * block_size + offset`. The model runner says, per step, where each new token's K/V goes
(`slot_mapping`) and which blocks hold each sequence's history (`block_tables`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class AttentionMetadata:
    """The layout of one step's flat batch: sequence i owns query rows query_start[i]:query_start[i+1]."""

    query_start: list[int]  # len = num_seqs + 1
    seq_lens: list[int]  # tokens in context after this step (history + new), per sequence
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    context: list[slice | torch.Tensor]  # per sequence, the cache slots of its whole context

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(
        cls, query_lens: list[int], seq_lens: list[int], slot_mapping: torch.Tensor,
        block_tables: list[list[int]], block_size: int,
    ) -> AttentionMetadata:
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        device = slot_mapping.device
        context = [_context_slots(t, n, block_size, device) for t, n in zip(block_tables, seq_lens, strict=True)]
        return cls(query_start, list(seq_lens), slot_mapping, context)


def _context_slots(blocks: list[int], length: int, block_size: int, device: torch.device) -> slice | torch.Tensor:
    # Consecutive blocks are one slice of the cache, read in place; others need a gather.
    needed = (length + block_size - 1) // block_size
    if all(blocks[j + 1] == blocks[j] + 1 for j in range(needed - 1)):
        start = blocks[0] * block_size
        return slice(start, start + length)
    block_ids = torch.tensor(blocks[:needed], device=device)
    slots = block_ids[:, None] * block_size + torch.arange(block_size, device=device)
    return slots.flatten()[:length]


class Attention(nn.Module):
    """Writes the step's K/V into the cache, then attends each sequence's queries to its context."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        self.k_cache.index_copy_(0, meta.slot_mapping, k)
        self.v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for i in range(meta.num_seqs):
            start, end = meta.query_start[i], meta.query_start[i + 1]
            keys, values = self._context(meta.context[i])
            out[start:end] = self._attend(q[start:end], keys, values)
        return out

    def _context(self, slots: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(slots, slice):
            return self.k_cache[slots], self.v_cache[slots]
        return self.k_cache.index_select(0, slots), self.v_cache.index_select(0, slots)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_q, num_k = q.shape[0], k.shape[0]
        mask, causal = None, num_q > 1 and num_q == num_k
        if num_q > 1 and not causal:
            # Query row r sits at context position num_k - num_q + r and sees keys up to it.
            rows = torch.arange(num_q, device=q.device)[:, None] + (num_k - num_q)
            mask = torch.arange(num_k, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.squeeze(0).transpose(0, 1)


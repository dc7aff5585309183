"""The token embedding and the output head, split by vocabulary rows under tensor parallel.

Each rank holds `ceil(vocab / ranks)` rows (the last rank's tail is zero padding): the embedding looks up
the ids in its rows, zeros the others and sums over the ranks; the head computes its rows' logits, which
the driver gathers and cuts back to the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slotserve.distributed.group import SINGLE, RankGroup
from slotserve.layers.linear import Linear, Shard
from slotserve.quantization.packed_linear import PackedWeight


def vocab_shard(vocab_size: int, group: RankGroup) -> tuple[int, Shard | None]:
    """Rows per rank, and this rank's rows of the checkpoint's vocabulary (None: all of them)."""
    rows = -(-vocab_size // group.size)
    start = min(group.rank * rows, vocab_size)
    return rows, Shard(0, start, min(start + rows, vocab_size), vocab_size) if group.size > 1 else None


class VocabEmbedding(nn.Module):
    """A token embedding without random initialisation (nn.Embedding's costs seconds at vocab 152k). Loaded
    packed (a GGUF's), `weight` is None and the rows are unpacked as they are looked up."""

    packed: PackedWeight | None = None

    def __init__(self, num_embeddings: int, dim: int, group: RankGroup = SINGLE) -> None:
        super().__init__()
        rows, self.weight_shard = vocab_shard(num_embeddings, group)
        self.group = group
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def hold_packed(self, packed: PackedWeight) -> None:
        """Makes a checkpoint's packing this embedding's weight: no float32 copy is kept."""
        if packed.k != self.weight.shape[1] or packed.n > self.weight.shape[0]:
            raise ValueError(f"packed embedding {(packed.n, packed.k)} does not fit {tuple(self.weight.shape)}")
        self.weight, self.packed = None, packed

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.embedding(ids, self.weight)
        if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < self.packed.n:
            raise IndexError(f"token ids outside the embedding's {self.packed.n} rows")
        return self.packed.rows(ids.reshape(-1)).reshape(*ids.shape, self.packed.k)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight_shard is None:
            return self._lookup(ids)
        local = ids - self.weight_shard.start
        outside = (local < 0) | (local >= self.weight_shard.size)
        x = self._lookup(local.masked_fill(outside, 0)).masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(x)


def tie(head: Linear, embedding: VocabEmbedding) -> None:
    """Shares the embedding's weight (or packing) with the output head."""
    head.weight, head.packed = embedding.weight, embedding.packed


def lm_head(hidden_size: int, vocab_size: int, group: RankGroup = SINGLE) -> Linear:
    """The output head: this rank's vocabulary rows."""
    rows, shard = vocab_shard(vocab_size, group)
    head = Linear(hidden_size, rows, bias=False)
    head.weight_shard = shard
    return head


def gather_logits(local: torch.Tensor, group: RankGroup, vocab_size: int) -> torch.Tensor | None:
    """The head's output on every rank -> float32 [rows, vocab] on the driver; None on the other ranks."""
    local = local.float()
    if group.size == 1:
        return local
    gathered = group.gather(local, dim=1)
    return None if gathered is None else gathered[:, :vocab_size]

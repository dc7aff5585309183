"""Expert parallel's token exchange: each rank's (token, expert) pairs to the ranks that hold those experts
(dispatch), and the experts' outputs back to the tokens' ranks as weighted sums (combine).

Each rank owns `num_experts / ranks` consecutive experts and a part of the step's tokens. Both steps start
asynchronously and return a `Pending` to wait on, so a caller can compute something else meanwhile (the
micro-batch overlap does; in a micro-batch they run on its lane of the group). Two exchanges, chosen by
`ExpertCommKind`:
- `AllToAll`: the split counts are exchanged first (one small all-to-all), then each pair's row travels to
  its expert's rank alone, and back (`all_to_all_single`): traffic is what the routing needs.
- `AllGather`: every rank's tokens reach every rank (all-gather); each computes the pairs of its own experts
  and reduce-scatters the weighted outputs back: no counts to exchange, more traffic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slotserve.config import ExpertCommKind
from slotserve.distributed.group import Pending, RankGroup


@dataclass
class Dispatched:
    """The pairs this rank's experts compute: row i of `x` goes through local expert `expert[i]`."""

    x: torch.Tensor  # [pairs, hidden]
    expert: torch.Tensor  # [pairs], 0 .. experts per rank - 1
    context: Any  # what `start_combine` needs to send the outputs home


class ExpertExchange(ABC):
    def __init__(self, group: RankGroup, num_experts: int) -> None:
        if num_experts % group.size:
            raise ValueError(f"num_experts: {num_experts} experts do not split over {group.size} ranks")
        self.group, self.num_experts = group, num_experts
        self.per_rank = num_experts // group.size

    @property
    def local_experts(self) -> range:
        """The global indices of this rank's experts."""
        return range(self.group.rank * self.per_rank, (self.group.rank + 1) * self.per_rank)

    @abstractmethod
    def start_dispatch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> Pending[Dispatched]:
        """x: this rank's tokens [tokens, hidden]; experts, weights: their top-k routing [tokens, k]."""

    @abstractmethod
    def start_combine(self, y: torch.Tensor, dispatched: Dispatched) -> Pending[torch.Tensor]:
        """y: the experts' outputs for `dispatched.x`'s rows; resolves to this rank's tokens' weighted sums."""


class AllToAll(ExpertExchange):
    def start_dispatch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> Pending[Dispatched]:
        top_k, g = experts.shape[1], self.group.lane()
        pairs = experts.flatten()
        order = pairs.argsort(stable=True)  # by expert, so by destination rank too
        send_counts = torch.bincount(pairs // self.per_rank, minlength=self.group.size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=g.cpu_group or g.device_group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        rows = x[order // top_k]
        ids = pairs[order] % self.per_rank
        recv_rows = x.new_empty((sum(recv), x.shape[1]))
        recv_ids = ids.new_empty(sum(recv))
        context = (order, send, recv, weights)
        return g.launch(lambda: [
            dist.all_to_all_single(recv_rows, rows, recv, send, group=g.device_group, async_op=True),
            dist.all_to_all_single(recv_ids, ids, recv, send, group=g.device_group, async_op=True),
        ], lambda: Dispatched(recv_rows, recv_ids, context), "dispatch")

    def start_combine(self, y: torch.Tensor, dispatched: Dispatched) -> Pending[torch.Tensor]:
        order, send, recv, weights = dispatched.context
        back, g, rows = y.new_empty((sum(send), y.shape[1])), self.group.lane(), y.contiguous()

        def finish() -> torch.Tensor:
            # Back to (token, rank) order, then each token's weighted sum of its experts' outputs.
            out = back[order.argsort()].view(*weights.shape, y.shape[1])
            return (out * weights.to(y.dtype).unsqueeze(-1)).sum(dim=1)

        return g.launch(lambda: [dist.all_to_all_single(back, rows, send, recv, group=g.device_group, async_op=True)],
                        finish, "combine")


class AllGather(ExpertExchange):
    def start_dispatch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> Pending[Dispatched]:
        # Ranks hold different token counts; the gathers take equal ones, so each pads to the step's largest.
        g = self.group.lane()
        counts = torch.tensor([len(x)])
        all_counts = [torch.empty_like(counts) for _ in range(self.group.size)]
        dist.all_gather(all_counts, counts, group=g.cpu_group or g.device_group)
        sizes = [int(c) for c in all_counts]
        width = max(sizes)
        pad = width - len(x)
        parts = [torch.nn.functional.pad(x, (0, 0, 0, pad)),
                 torch.nn.functional.pad(experts, (0, 0, 0, pad), value=-1),
                 torch.nn.functional.pad(weights, (0, 0, 0, pad))]
        gathered = [[torch.empty_like(p) for _ in range(self.group.size)] for p in parts]

        def finish() -> Dispatched:
            all_x, all_experts, all_weights = (torch.cat(g) for g in gathered)
            mine = (all_experts >= self.local_experts.start) & (all_experts < self.local_experts.stop)
            token, k = mine.nonzero(as_tuple=True)
            weight = all_weights[token, k]
            return Dispatched(all_x[token], all_experts[token, k] - self.local_experts.start,
                              (token, weight, width, len(x)))

        return g.launch(lambda: [dist.all_gather(out, p, group=g.device_group, async_op=True)
                                 for out, p in zip(gathered, parts, strict=True)], finish, "dispatch")

    def start_combine(self, y: torch.Tensor, dispatched: Dispatched) -> Pending[torch.Tensor]:
        token, weight, width, mine = dispatched.context
        summed = y.new_zeros((width * self.group.size, y.shape[1]))
        summed.index_add_(0, token, y * weight.to(y.dtype).unsqueeze(-1))
        out, g = y.new_empty((width, y.shape[1])), self.group.lane()
        return g.launch(lambda: [dist.reduce_scatter_single(out, summed, group=g.device_group, async_op=True)],
                        lambda: out[:mine], "combine")


def expert_exchange(kind: ExpertCommKind, group: RankGroup, num_experts: int) -> ExpertExchange:
    return {ExpertCommKind.ALL_TO_ALL: AllToAll, ExpertCommKind.ALL_GATHER: AllGather}[kind](group, num_experts)

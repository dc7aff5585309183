"""Which data-parallel replica takes a request: the one that has its prompt's prefix cached, unless that one
is much busier than the least loaded; else the least loaded.

Each replica has a prefix cache of its own, so a prompt that shares a long prefix with an earlier one (a
system prompt, the turns before in a chat) runs fastest where the earlier one ran. The router remembers, for
each block of the prompts it sent, the replica it sent them to; it cannot see evictions, so a remembered
block is a likely hit, not a sure one, and a miss costs only the prefill it would have cost anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RouteChoice:
    replica: int
    cached_blocks: int  # leading blocks of the prompt the replica was last sent


class Router:
    """`choose` a replica for a prompt from the replicas' loads (sequences in flight; None for one that is
    gone). Prefix affinity wins while its replica has at most `max_imbalance` more sequences than the least
    loaded: a replica busier than that would cost more in waiting than the cached prefill saves."""

    def __init__(self, num_replicas: int, block_size: int, max_imbalance: int = 4, capacity: int = 1 << 16) -> None:
        if num_replicas < 1 or block_size < 1 or max_imbalance < 0 or capacity < 1:
            raise ValueError("router: needs at least one replica, a positive block size and capacity")
        self.num_replicas, self.block_size = num_replicas, block_size
        self.max_imbalance, self.capacity = max_imbalance, capacity
        self._owner: OrderedDict[int, int] = OrderedDict()  # a prefix's chained block hash -> its replica
        self._next = 0  # where ties between the least loaded start, so they take turns

    def choose(self, token_ids: Sequence[int], loads: Sequence[int | None]) -> RouteChoice:
        if len(loads) != self.num_replicas:
            raise ValueError(f"router: {len(loads)} loads for {self.num_replicas} replicas")
        alive = [i for i, load in enumerate(loads) if load is not None]
        if not alive:
            raise ValueError("router: no replica is alive")
        hashes = self._block_hashes(token_ids)
        cached, owner = self._longest_cached(hashes, loads)
        least = min(loads[i] for i in alive)
        if cached and loads[owner] <= least + self.max_imbalance:
            choice = RouteChoice(owner, cached)
        else:
            order = alive[self._next % len(alive):] + alive[:self._next % len(alive)]
            replica = next(i for i in order if loads[i] == least)
            self._next += 1
            choice = RouteChoice(replica, 0)
        for h in hashes:
            self._owner[h] = choice.replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
        return choice

    def forget(self, replica: int) -> None:
        """A replica that is gone holds nothing."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]

    def _block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """One hash per full block, each over the whole prefix up to its block's end."""
        hashes, h = [], 0
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            h = hash((h, tuple(token_ids[start:start + self.block_size])))
            hashes.append(h)
        return hashes

    def _longest_cached(self, hashes: list[int], loads: Sequence[int | None]) -> tuple[int, int]:
        """How many leading blocks the deepest-known live replica was sent, and which replica that is."""
        cached, owner = 0, -1
        for depth, h in enumerate(hashes, 1):
            replica = self._owner.get(h)
            if replica is None or loads[replica] is None:
                break
            cached, owner = depth, replica
        return cached, owner

"""The ranks that share one model: who this rank is among them, and the collectives the model calls.

A `RankGroup` of size 1 (`SINGLE`) is the single-process engine: every collective is the identity, so the
model code calls them unconditionally. Larger groups run on torch.distributed: gloo on the CPU (with a
shared-memory all-reduce for ranks on one host, distributed/shm_all_reduce.py), NCCL on CUDA, plus a gloo
group for small metadata either way. Every collective carries the group's timeout.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist

from slotserve.config import ExpertCommKind


class AllReduce(Protocol):
    def all_reduce(self, t: torch.Tensor) -> None: ...


@dataclass
class CollectiveClock:
    """Time this rank spent in the group's collectives (waiting for the others included), for benchmarks."""

    seconds: float = 0.0
    calls: int = 0

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._start
        self.calls += 1


@dataclass(frozen=True, eq=False)
class RankGroup:
    """`size` ranks, this one `rank`: the tensor-parallel (and expert-parallel) group of one model."""

    rank: int = 0
    size: int = 1
    device_group: dist.ProcessGroup | None = None  # the model's tensors: gloo on CPU, NCCL on CUDA
    cpu_group: dist.ProcessGroup | None = None  # small host-side metadata (split counts, votes)
    fast_all_reduce: AllReduce | None = None  # shared memory, for CPU ranks on one host
    timeout: datetime.timedelta = field(default_factory=lambda: datetime.timedelta(minutes=2))
    clock: CollectiveClock = field(default_factory=CollectiveClock)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank: {self.rank} is not in a group of {self.size}")
        if self.size > 1 and self.device_group is None:
            raise ValueError("device_group: a group of several ranks needs a process group")

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one in the engine core's process, which alone receives the logits."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in place; returns `x`."""
        if self.size == 1:
            return x
        with self.clock:
            if self.fast_all_reduce is not None and x.device.type == "cpu" and x.dtype == torch.float32:
                buffer = x if x.is_contiguous() else x.contiguous()
                self.fast_all_reduce.all_reduce(buffer)
                if buffer is not x:
                    x.copy_(buffer)
            else:
                dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's `x` (same shape on each), concatenated along `dim` in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self.clock:
            dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor | None:
        """Every rank's `x` concatenated along `dim` on the driver; None on the other ranks."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_driver else None
        with self.clock:
            dist.gather(x.contiguous(), parts, dst=dist.get_global_rank(self.device_group, 0), group=self.device_group)
        return torch.cat(parts, dim=dim) if parts is not None else None


SINGLE = RankGroup()


@dataclass(frozen=True)
class ModelParallel:
    """How one model is split: its tensor-parallel group, and whether its experts are split across it
    (expert parallel, moving tokens by `expert_comm`) instead of each expert being split by tensor parallel."""

    group: RankGroup = SINGLE
    expert_parallel: bool = False
    expert_comm: ExpertCommKind = ExpertCommKind.ALL_TO_ALL


UNSPLIT = ModelParallel()  # a model on one rank

"""Joining the ranks of one model: torch.distributed's process groups, and the shared-memory all-reduce where
every rank is on this host."""

from __future__ import annotations

import datetime
import logging
import socket

import torch
import torch.distributed as dist

from slotserve.distributed.group import RankGroup
from slotserve.distributed.shm_all_reduce import ShmAllReduce

logger = logging.getLogger("slotserve")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_rank_group(rank: int, world_size: int, init_method: str, device: torch.device,
                    timeout_s: float) -> RankGroup:
    """Joins (blocking until all `world_size` ranks have) the group of one model; every collective of it times
    out after `timeout_s`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    hosts: list[str | None] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=cpu_group)
    fast = None
    if device.type == "cpu" and len(set(hosts)) == 1 and ShmAllReduce.available():
        fast = ShmAllReduce(rank, world_size, cpu_group, timeout_s=timeout_s)
    logger.info("rank %d of %d joined (%s%s)", rank, world_size, backend,
                ", shared-memory all-reduce" if fast is not None else "")
    return RankGroup(rank, world_size, dist.group.WORLD, cpu_group, fast, timeout)


def leave_rank_group(group: RankGroup) -> None:
    """Undoes `init_rank_group` (a later engine in this process may join another)."""
    if group.fast_all_reduce is not None:
        group.fast_all_reduce.close()
    if dist.is_initialized():
        dist.destroy_process_group()

"""Joining the ranks of one model: torch.distributed's process groups, and the shared-memory all-reduce where
every rank is on this host."""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from slotserve import envs
from slotserve.config import EngineConfig
from slotserve.distributed.group import CollectiveClock, RankGroup
from slotserve.distributed.shm_all_reduce import ShmAllReduce

logger = logging.getLogger("slotserve")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# How long the ranks may take to meet: processes or Ray actors starting and importing torch, on a loaded machine.
STARTUP_S = 300.0


def init_rank_group(rank: int, world_size: int, init_method: str, device: torch.device, timeout_s: float,
                    check: Callable[[], None] | None = None, lanes: int = 0) -> RankGroup:
    """Joins (blocking until all `world_size` ranks have, within STARTUP_S) the group of one model; every
    collective of it times out after `timeout_s`. `check`, called while waiting, raises when a rank that is
    expected can no longer come (its process is gone). `lanes`: groups of their own for that many
    micro-batches (micro-batch overlap)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    _join(lambda: dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                          timeout=datetime.timedelta(seconds=max(timeout_s, STARTUP_S))), check)
    hosts: list[str | None] = [None] * world_size
    dist.all_gather_object(hosts, socket.gethostname())
    one_host = len(set(hosts)) == 1
    clock = CollectiveClock()
    latency_s = envs.collective_latency_s()
    extra = tuple(_group(rank, world_size, device, timeout_s, one_host, clock, latency_s, stream=True)
                  for _ in range(lanes))
    group = _group(rank, world_size, device, timeout_s, one_host, clock, latency_s, lanes=extra)
    logger.info("rank %d of %d joined (%s%s%s)", rank, world_size, backend,
                ", shared-memory all-reduce" if group.fast_all_reduce is not None else "",
                f", {lanes} micro-batch lanes" if lanes else "")
    return group


def _group(rank: int, world_size: int, device: torch.device, timeout_s: float, one_host: bool,
           clock: CollectiveClock, latency_s: float, lanes: tuple[RankGroup, ...] = (),
           stream: bool = False) -> RankGroup:
    """New process groups of every rank (collective: each rank creates them in the same order)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    device_group = dist.new_group(backend=backend, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else device_group
    fast = None
    if device.type == "cpu" and one_host and ShmAllReduce.available():
        fast = ShmAllReduce(rank, world_size, cpu_group, timeout_s=timeout_s)
    cuda_stream = torch.cuda.Stream(device) if stream and device.type == "cuda" else None
    return RankGroup(rank, world_size, device_group, cpu_group, fast, timeout, clock, lanes, cuda_stream, latency_s)


def lanes(config: EngineConfig) -> int:
    """The micro-batch lanes a rank group of this engine needs."""
    return config.ubatches if config.ubatches > 1 else 0


def _join(rendezvous: Callable[[], None], check: Callable[[], None] | None) -> None:
    """Runs the rendezvous; with `check`, in a thread, calling `check` meanwhile (the rendezvous cannot be
    interrupted: a rank that died before joining would otherwise hold this one for STARTUP_S)."""
    if check is None:
        rendezvous()
        return
    errors: list[BaseException] = []

    def run() -> None:
        try:
            rendezvous()
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, name="rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        check()
        thread.join(timeout=0.2)
    if errors:
        raise errors[0]


def leave_rank_group(group: RankGroup) -> None:
    """Undoes `init_rank_group` (a later engine in this process may join another)."""
    for g in (group, *group.lanes):
        if g.fast_all_reduce is not None:
            g.fast_all_reduce.close()
    if dist.is_initialized():
        dist.destroy_process_group()

"""One rank of the model, and the same for every rank: the engine core's own (rank 0) and each other one
(engine/worker_process.py runs those).

A worker takes its share of the host's cores, seeds torch, joins the ranks' process group, loads its part of
the weights, and, once told how many KV blocks every rank holds, moves its weights into huge pages where they
fit beside that cache and builds its runner (the forward pass over its heads and rows, and its part of the
cache).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from slotserve import host_memory
from slotserve.config import EngineConfig, parse_device, parse_dtype
from slotserve.distributed.group import UNSPLIT, ModelParallel, RankGroup
from slotserve.distributed.process_groups import init_rank_group, lanes, leave_rank_group
from slotserve.engine.model_runner import ModelRunner, UbatchPolicy
from slotserve.models.interface import VisionLanguageModel
from slotserve.models.loader import available_memory, load_model
from slotserve.models.packing import move_packings
from slotserve.parallel.cpu import CpuSettings, apply_cpu_settings, restrict_process
from slotserve.parallel.threadpool import default_threads
from slotserve.quantization.int8 import quantize_int8

logger = logging.getLogger("slotserve")


@dataclass(frozen=True)
class Rank:
    """Where a worker sits among the model's ranks."""

    rank: int = 0
    world_size: int = 1
    init_method: str = ""  # torch.distributed's rendezvous, e.g. tcp://127.0.0.1:29500 (world_size > 1)
    pin_cores: bool = True  # take this rank's share of the host's cores; False: `threads` alone (a Ray actor)


def rank_cpu_settings(config: EngineConfig, rank: int) -> tuple[int | None, tuple[int, ...] | None]:
    """Threads and cores of rank `rank` of a model on this host. One rank: the settings as given. Several: the
    cores split evenly between the ranks (the given `cpu_affinity`, else all this process may use), each rank
    pinned to its share where every rank gets at least one core; else the ranks share them, `threads` each
    (default 1)."""
    ranks = config.tensor_parallel_size
    if ranks == 1:
        return config.threads, config.cpu_affinity
    cores = list(config.cpu_affinity or sorted(os.sched_getaffinity(0)))
    per_rank = len(cores) // ranks
    if per_rank >= 1:
        mine = tuple(cores[rank * per_rank:(rank + 1) * per_rank])
        return config.threads or len(mine), mine
    return config.threads or max(1, default_threads() // ranks), None


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of rank `rank`: on CUDA, GPU `rank` (modulo those there are)."""
    device = parse_device(config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    return device


class _Holdings:
    """What a worker holds beyond its tensors: its place in the process group and its pinning of this process.
    Released once: by `Worker.close`, or when the worker is collected (so a second engine in this process can
    join a group of its own)."""

    def __init__(self, cpu: CpuSettings, host_cores: tuple[int, ...]) -> None:
        self.cpu, self.host_cores = cpu, host_cores
        self.group: RankGroup | None = None
        self.released = False

    def release(self, leave_group: bool = True) -> None:
        if self.released:
            return
        self.released = True
        if self.cpu.cpu_affinity and self.host_cores:
            restrict_process(self.host_cores)
        if leave_group and self.group is not None:
            leave_rank_group(self.group)


class Worker:
    def __init__(self, config: EngineConfig, model_path: str | Path, rank: Rank = Rank(),
                 check: Callable[[], None] | None = None) -> None:
        """Loads this rank's part of the model. `check`, called while waiting for the other ranks to join,
        raises where one can no longer come."""
        self.config, self.rank = config, rank
        self.device = rank_device(config, rank.rank)
        self.dtype = parse_dtype(config.dtype, self.device)
        host_cores = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
        self.parallel = UNSPLIT
        self.runner: ModelRunner | None = None
        self.weights_in_huge_pages = False
        self.vision_dtype: torch.dtype | None = None  # a vision-language model's tower's
        # Before loading: conversion uses the pool.
        threads, cores = rank_cpu_settings(config, rank.rank) if rank.pin_cores else (config.threads, None)
        self.cpu: CpuSettings = apply_cpu_settings(threads, cores)
        self._holdings = _Holdings(self.cpu, host_cores)
        weakref.finalize(self, self._holdings.release)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(config.seed)
        try:
            if rank.world_size > 1:
                group = init_rank_group(rank.rank, rank.world_size, rank.init_method, self.device,
                                        config.distributed_timeout, check=check, lanes=lanes(config))
                self._holdings.group = group
                self.parallel = ModelParallel(group, config.enable_expert_parallel, config.expert_comm)
            self.model, self.model_config = load_model(model_path, self.dtype, self.device, config.max_model_len,
                                                       self.parallel, q8_0=config.quantization == "q8_0")
            if config.quantization == "int8":
                quantize_int8(self.model)  # swaps the float linears for int8 ones, releasing their weights
            if isinstance(self.model, VisionLanguageModel):  # before the weights move into huge pages
                self.vision_dtype = self.model.choose_vision_dtype(config.prefill_precision)
        except Exception:
            self.close()
            raise

    def cache_bytes_per_block(self) -> int:
        """Of this rank's cache, which holds its KV heads alone."""
        return ModelRunner.cache_bytes_per_token(self.model_config, self.dtype,
                                                 self.config.tensor_parallel_size) * self.config.block_size

    def allocate_cache(self, num_blocks: int) -> ModelRunner:
        """Builds the runner over a cache of `num_blocks` blocks. On CPU the weights first move into huge pages
        where they fit beside it (host_memory.py)."""
        if self.device.type == "cpu":
            room = available_memory(self.device).available - num_blocks * self.cache_bytes_per_block()
            moved = host_memory.move_weights(self.model, room)
            moved += move_packings(self.model, available_memory(self.device).available
                                   - num_blocks * self.cache_bytes_per_block())
            self.weights_in_huge_pages = moved > 0
        host_memory.trim_heap()  # what loading freed
        self.runner = ModelRunner(self.model, self.model_config, num_blocks, self.config.block_size,
                                  ubatching=UbatchPolicy.of(self.config), prefill=self.config.prefill_precision)
        return self.runner

    def close(self, leave_group: bool = True) -> None:
        """Leaves the ranks' process group (not with `leave_group` False: for an engine that is dying, a thread
        may still be in a collective) and gives this process back the cores it could use before. Idempotent."""
        if self.runner is not None:
            self.runner.close()
        self._holdings.release(leave_group)

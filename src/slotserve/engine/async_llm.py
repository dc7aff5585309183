"""The front-end engine: an asyncio client of one engine-core process or of several replicas of it, with one
output stream per request.

It tokenizes and validates in the caller's process, sends each request to an engine core over ZMQ, and
routes the deltas that come back to the right request's queue (engine/core_client.py). With
`data_parallel_size` N, N engine cores each hold the whole model and a KV cache of their own, the cores of
this machine split between them (or, on Ray, placed on the cluster's machines), and the router picks one per
request (engine/router.py). A replica that ends fails its own requests only; the engine is dead when none is
left. A request whose consumer goes away (client disconnect, task cancelled) is aborted in its engine core,
which frees its blocks within a step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
from collections.abc import AsyncIterator, Sequence

from slotserve.config import EngineConfig, ExecutorBackend, ModelConfig
from slotserve.engine.core_client import (
    CoreClient,
    CoreProcess,
    EngineDeadError,
    EngineStartError,
    LocalCore,
    RequestAbortedError,
    RequestStream,
    ipc_addresses,
)
from slotserve.engine.input_processor import InputProcessor
from slotserve.engine.protocol import EngineStats, KVSave
from slotserve.engine.router import Router
from slotserve.model_store import resolve_model
from slotserve.multimodal.prompts import ImageLike, ImagePrompting
from slotserve.outputs import RequestOutput
from slotserve.pooling_params import PoolingParams
from slotserve.sampling_params import SamplingParams
from slotserve.tokenizer import Tokenizer

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStartError", "RequestAbortedError", "RequestStream"]

logger = logging.getLogger("slotserve")


class AsyncLLM:
    def __init__(self, config: EngineConfig, model_path, tokenizer: Tokenizer, log_level: str = "INFO") -> None:
        self.config, self.tokenizer = config, tokenizer
        self.model_path, self.model_config = model_path, ModelConfig.from_dir(model_path)
        self._log_level = log_level
        self.replicas: list[CoreClient] = []
        self.router = Router(config.data_parallel_size, config.block_size)
        self._keys = itertools.count()
        self._placement = None  # the Ray placement of the replicas, where they run on Ray
        self._watch: asyncio.Task | None = None
        self.input_processor: InputProcessor | None = None
        self.dead = asyncio.Event()  # set once no replica is left
        self.kv_offload_dir: str | None = None  # this model's directory of the KV disk tier, once started

    @classmethod
    async def create(cls, config: EngineConfig, log_level: str = "INFO", start_timeout: float = 900) -> AsyncLLM:
        """Starts the engine-core process(es) and returns once each has loaded the model."""
        path = resolve_model(config.model)  # assemble/convert here, once, before the cores need it
        engine = cls(config, path, Tokenizer.from_dir(path), log_level)
        await engine._start(start_timeout)
        return engine

    async def _start(self, timeout: float) -> None:
        count = self.config.data_parallel_size
        configs = replica_configs(self.config)
        processes: list[CoreProcess]
        if count > 1 and self.config.distributed_executor_backend is ExecutorBackend.RAY:
            from slotserve.engine.ray_replicas import RayPlacement  # Ray is imported only where it is used

            self._placement = await asyncio.to_thread(RayPlacement, self.config, count)
            processes = [self._placement.core(i) for i in range(count)]
            addresses = [(f"tcp://{self._placement.host}",) * 2 for _ in range(count)]
        else:
            processes = [LocalCore() for _ in range(count)]
            addresses = [ipc_addresses() for _ in range(count)]
        names = ["engine core"] if count == 1 else [f"engine core (replica {i})" for i in range(count)]
        self.replicas = [CoreClient(p, *a, name=n) for p, a, n in zip(processes, addresses, names, strict=True)]
        started = await asyncio.gather(*(r.start(c, self._log_level, timeout) for r, c in zip(self.replicas, configs,
                                                                                              strict=True)),
                                       return_exceptions=True)
        failed = [e for e in started if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(r.shutdown() for r, e in zip(self.replicas, started, strict=True)
                                   if not isinstance(e, BaseException)))
            self._release_placement()
            raise failed[0]
        ready = started[0]
        self.max_model_len, self.task = min(r.max_model_len for r in started), ready.task
        self.kv_offload_dir = ready.kv_offload_dir
        prompting = ImagePrompting.for_model(self.model_path, self.model_config, self.config.limit_mm_per_prompt,
                                             self.config.image_min_pixels, self.config.image_max_pixels)
        self.input_processor = InputProcessor(self.tokenizer, ready.vocab_size, self.max_model_len, ready.task,
                                              ready.hidden_size, prompting)
        self._watch = asyncio.create_task(self._watch_replicas(), name="slotserve-replicas")

    # ---- requests -----------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return all(r.is_dead for r in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        if not self.is_dead:
            return None
        if len(self.replicas) == 1:
            return self.replicas[0].dead_reason
        return "every replica is gone: " + "; ".join(r.dead_reason for r in self.replicas)

    @property
    def replicas_alive(self) -> int:
        return sum(not r.is_dead for r in self.replicas)

    @property
    def num_sequences_in_flight(self) -> int:
        return sum(r.num_sequences_in_flight for r in self.replicas)

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
                          images: Sequence[ImageLike] = (), kv_save: KVSave | None = None) -> RequestStream:
        """Validates and queues a request (ValueError for bad input, EngineDeadError when no engine core is
        left); iterate the returned stream for its deltas. `request_id` is the caller's name for it: it is put
        on its outputs and may repeat. `images`: a vision-language model's, in placeholder order. `kv_save`: write
        its prompt's blocks to the KV disk tier."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        key = str(next(self._keys))
        # Tokenizing a long prompt, or decoding and resizing images, takes seconds: not on the event loop.
        processed = await asyncio.to_thread(self.input_processor.process, key, prompt, params, images, kv_save)
        while True:
            loads = [None if r.is_dead else r.num_sequences_in_flight for r in self.replicas]
            if all(load is None for load in loads):
                raise EngineDeadError(self.dead_reason)
            replica = self.replicas[self.router.choose(processed.prompt_token_ids, loads).replica]
            try:
                return await replica.add(request_id, processed)
            except EngineDeadError:
                if replica.process.is_alive() or len(self.replicas) == 1:
                    raise
                replica.exited()  # its watch is a moment behind

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yields the request's deltas as they come. Leaving the loop early aborts the request."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def abort_all(self, reason: str) -> None:
        """Ends every request in flight with RequestAbortedError(reason), and frees them in the engine."""
        await asyncio.gather(*(r.abort_all(reason) for r in self.replicas))

    async def stats(self, timeout: float = 5.0) -> EngineStats:
        """The live replicas' stats, summed (EngineDeadError where none is left)."""
        live = [r for r in self.replicas if not r.is_dead]
        if not live:
            raise EngineDeadError(self.dead_reason)
        answers = await asyncio.gather(*(r.stats(timeout) for r in live), return_exceptions=True)
        stats = [a for a in answers if isinstance(a, EngineStats)]
        if not stats:
            raise answers[0]
        return EngineStats.combine(stats)

    async def debug(self, timeout: float = 5.0) -> list[dict]:
        """Each replica's snapshot (engine/core_process.py), in order: threads and stacks, queues, scheduler,
        recent steps, watchdog. One that is gone or does not answer in time is {"error": why}."""
        async def one(replica: CoreClient) -> dict:
            try:
                return await replica.debug(timeout)
            except (EngineDeadError, TimeoutError) as e:
                return {"error": f"{type(e).__name__}: {e}"}

        return list(await asyncio.gather(*(one(r) for r in self.replicas)))

    # ---- background -------------------------------------------------------------------------------

    async def _watch_replicas(self) -> None:
        waits = {asyncio.create_task(r.dead.wait()): i for i, r in enumerate(self.replicas)}
        try:
            while waits:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    index = waits.pop(task)
                    self.router.forget(index)
                    if len(self.replicas) > 1:
                        logger.error("replica %d is gone (%s); %d of %d replicas serve", index,
                                     self.replicas[index].dead_reason, self.replicas_alive, len(self.replicas))
            self.dead.set()
        finally:
            for task in waits:
                task.cancel()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine-core processes (politely, then by force) and closes their sockets."""
        if self._watch is not None:
            self._watch.cancel()
        await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas))
        self._release_placement()

    def _release_placement(self) -> None:
        if self._placement is not None:
            self._placement.close()
            self._placement = None


def replica_configs(config: EngineConfig) -> list[EngineConfig]:
    """Each replica's settings. On this machine, the cores (the given `cpu_affinity`, else all this process may
    use) split evenly between the replicas, each pinned to its share where every one gets at least one core;
    else they share them, `threads` each (default the cores over the replicas, at least 1). On Ray, the
    settings as given (each replica takes `threads` CPUs of its node)."""
    count = config.data_parallel_size
    if count == 1:
        return [config]
    one = dataclasses.replace(config, data_parallel_size=1)
    if config.distributed_executor_backend is ExecutorBackend.RAY:
        return [one] * count
    cores = list(config.cpu_affinity or sorted(os.sched_getaffinity(0)))
    per_replica = len(cores) // count
    if per_replica >= 1:
        return [dataclasses.replace(one, cpu_affinity=tuple(cores[i * per_replica:(i + 1) * per_replica]))
                for i in range(count)]
    return [dataclasses.replace(one, cpu_affinity=None, threads=config.threads or max(1, len(cores) // count))
            ] * count

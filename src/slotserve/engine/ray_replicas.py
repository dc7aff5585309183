"""Data-parallel replicas as Ray actors, so the engine cores of one front end can run on several machines.

One placement group holds a bundle per replica (its threads times its ranks in CPUs), spread over the
cluster's nodes where it can be. Each replica's engine core runs in an actor of its own and reaches the front
end over TCP at this node's address as Ray knows it; a replica split by tensor parallel starts its other ranks
as processes on its own node. Ray's fate-sharing ends the actors when the front end's process is gone.
"""

from __future__ import annotations

import dataclasses
import logging

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slotserve import envs
from slotserve.config import EngineConfig, ExecutorBackend
from slotserve.engine import ray_cluster
from slotserve.engine.core_client import EngineStartError

logger = logging.getLogger("slotserve")


@ray.remote
class EngineCoreActor:
    """One replica's engine core: its whole life is one call."""

    def run(self, config: EngineConfig, input_address: str, output_address: str, log_level: str) -> None:
        from slotserve.engine.core_process import run_engine_core

        run_engine_core(config, input_address, output_address, log_level, watch_parent=False)


class RayPlacement:
    """The cluster's room for `count` replicas of `config`; `core(i)` is replica i's place in it."""

    def __init__(self, config: EngineConfig, count: int) -> None:
        self.threads = config.threads or 1
        self.cpus = self.threads * config.tensor_parallel_size
        self.owns_ray = ray_cluster.acquire()
        self.pg = placement_group([{"CPU": self.cpus} for _ in range(count)], strategy="SPREAD")
        if not self.pg.wait(timeout_seconds=config.distributed_timeout):
            total, free = ray.cluster_resources().get("CPU", 0), ray.available_resources().get("CPU", 0)
            self.close()
            raise EngineStartError(f"Ray could not place {count} replicas of {self.cpus} CPU each within "
                                   f"{config.distributed_timeout:.0f} s: the cluster has {total:g} CPUs, {free:g} free")
        self.host = ray.util.get_node_ip_address()

    def core(self, index: int) -> RayCore:
        return RayCore(self, index)

    def close(self) -> None:
        if ray.is_initialized():
            remove_placement_group(self.pg)
        if self.owns_ray:
            self.owns_ray = False
            ray_cluster.release()


class RayCore:
    """A `CoreProcess` (engine/core_client.py) that is a Ray actor in bundle `index` of the placement."""

    def __init__(self, placement: RayPlacement, index: int) -> None:
        self.placement, self.index = placement, index
        self.actor: ray.actor.ActorHandle | None = None
        self.run: ray.ObjectRef | None = None
        self._ended: str | None = None

    def start(self, config: EngineConfig, input_address: str, output_address: str, log_level: str) -> None:
        # The bundle's CPUs: cores named here are this machine's, not the actor's.
        config = dataclasses.replace(config, threads=self.placement.threads, cpu_affinity=None,
                                     distributed_executor_backend=ExecutorBackend.MP
                                     if config.tensor_parallel_size > 1 else None)
        strategy = PlacementGroupSchedulingStrategy(self.placement.pg, placement_group_bundle_index=self.index)
        self.actor = EngineCoreActor.options(
            num_cpus=self.placement.cpus, scheduling_strategy=strategy,
            runtime_env={"env_vars": {**envs.passed_to_ranks(), envs.LOG_LEVEL_ENV: log_level}}).remote()
        self.run = self.actor.run.remote(config, input_address, output_address, log_level)

    def is_alive(self) -> bool:
        if self._ended is not None or self.run is None:
            return False
        if not ray.is_initialized():
            self._ended = "its Ray was shut down"
            return False
        done, _ = ray.wait([self.run], timeout=0, fetch_local=False)
        if done:
            try:
                ray.get(self.run)
                self._ended = "it returned"
            except Exception as e:  # the actor died (RayActorError) or could not start
                text = str(e).strip()
                self._ended = f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
        return self._ended is None

    def exit_reason(self) -> str:
        return f"(ray actor) is gone: {self._ended or 'still running'}"

    def kill(self) -> None:
        if self.actor is not None and ray.is_initialized():
            ray.kill(self.actor, no_restart=True)

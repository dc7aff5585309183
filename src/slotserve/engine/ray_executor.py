"""Ranks 1 .. N-1 as Ray actors, so a model can be split over several machines of a Ray cluster.

The workers are those of worker.py, each in an actor of its own, in one placement group (a bundle of CPUs
per rank, packed onto as few nodes as hold them). They reach the driver at this node's address as Ray
knows it. Ray's fate-sharing ends the actors when the driver's process is gone, so they watch no parent.
The connection to Ray is engine/ray_cluster.py's.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slotserve import envs
from slotserve.config import EngineConfig
from slotserve.engine import ray_cluster
from slotserve.engine.executor import Executor, WorkerError
from slotserve.engine.worker_process import WorkerSpec, run_worker

logger = logging.getLogger("slotserve")


@ray.remote
class RankActor:
    """One worker rank: its whole life is one call."""

    def run(self, spec: WorkerSpec, threads: int) -> int:
        # The bundle's CPUs; the driver's cpu_affinity names cores of its own machine, not of this one.
        spec.config["threads"] = threads
        spec.config["cpu_affinity"] = None
        spec.pin_cores = False
        logging.basicConfig(level=envs.log_level(),
                            format=f"%(levelname)s %(asctime)s rank-{spec.rank}: %(message)s", datefmt="%H:%M:%S")
        return run_worker(spec)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, model_path: Path) -> None:
        self.threads = config.threads or 1
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.runs: dict[ray.ObjectRef, int] = {}  # each actor's run -> its rank
        self.pg = None
        self._gone: dict[int, str] = {}
        self._lock = threading.Lock()
        self._on_own_ray = ray_cluster.acquire()  # not on one the caller connected
        try:
            super().__init__(config, model_path)
        except BaseException:
            self._release_ray()  # where it failed before launching (launch's own failure shuts down)
            raise

    def host(self) -> str:
        return ray.util.get_node_ip_address()

    def launch(self, specs: list[WorkerSpec]) -> None:
        try:
            self._launch(specs)
        except BaseException:
            self.shutdown()
            raise

    def _launch(self, specs: list[WorkerSpec]) -> None:
        self.pg = placement_group([{"CPU": self.threads} for _ in specs], strategy="PACK")
        timeout = self.config.distributed_timeout
        if not self.pg.wait(timeout_seconds=timeout):
            total, free = ray.cluster_resources().get("CPU", 0), ray.available_resources().get("CPU", 0)
            raise WorkerError(f"Ray could not place {len(specs)} worker ranks of {self.threads} CPU each "
                              f"({len(specs) * self.threads} CPUs) within {timeout:.0f} s: the cluster has "
                              f"{total:g} CPUs, {free:g} free")
        env = {**envs.passed_to_ranks(), envs.LOG_LEVEL_ENV: logging.getLevelName(logger.getEffectiveLevel())}
        for i, spec in enumerate(specs):
            actor = RankActor.options(
                num_cpus=self.threads,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                runtime_env={"env_vars": env},
            ).remote()
            self.actors[spec.rank] = actor
            self.runs[actor.run.remote(spec, self.threads)] = spec.rank

    def exited(self) -> list[str]:
        with self._lock:
            pending = [ref for ref, rank in self.runs.items() if rank not in self._gone]
            if pending and not ray.is_initialized():  # shut down under us
                self._gone.update((self.runs[ref], f"worker rank {self.runs[ref]} (ray actor) is gone: Ray was "
                                   "shut down") for ref in pending)
            elif pending:
                done, _ = ray.wait(pending, num_returns=len(pending), timeout=0, fetch_local=True)
                for ref in done:
                    rank = self.runs[ref]
                    try:
                        self._gone[rank] = f"worker rank {rank} (ray actor) exited with code {ray.get(ref)}"
                    except Exception as e:  # the actor died (RayActorError) or could not start
                        self._gone[rank] = f"worker rank {rank} (ray actor) failed: {_first_line(e)}"
            return [self._gone[rank] for rank in sorted(self._gone)]

    def stop(self, grace_s: float) -> None:
        try:
            if self.runs and ray.is_initialized():
                ray.wait(list(self.runs), num_returns=len(self.runs), timeout=grace_s, fetch_local=False)
                self.exited()  # records how those that ended ended, while Ray can still say
                self.kill()  # those that exited are idle actors still holding their CPUs
            if self.pg is not None and ray.is_initialized():
                remove_placement_group(self.pg)
        finally:
            with self._lock:  # not while another thread asks `exited` of this Ray
                self._release_ray()

    def kill(self) -> None:
        if not ray.is_initialized():
            return
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)

    def _release_ray(self) -> None:
        if self._on_own_ray:
            self._on_own_ray = False
            ray_cluster.release()


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"

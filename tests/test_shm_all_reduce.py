"""ShmAllReduce between real processes: exact sums in rank order, timeouts instead of hangs, no file left."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from slotserve.distributed.shm_all_reduce import CollectiveTimeoutError, ShmAllReduce

pytestmark = pytest.mark.skipif(not ShmAllReduce.available(), reason="no C compiler for the kernel here")

CAPACITY = 64 << 10  # 16384 floats: the two largest sizes take several rounds
SIZES = (1, 896, 896 * 7 + 3, 32768, 40000)
ROUNDS = 12
TIMEOUT_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensor(step: int, size: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s input at `step`, which every rank can regenerate; magnitudes spread over 2^±20, so
    that adding in any other order than 0..N-1 changes some bits."""
    g = torch.Generator().manual_seed(step * 1_000_003 + size * 17 + rank)
    scale = torch.exp2(torch.randint(-20, 21, (size,), generator=g).float())
    return (torch.randn(size, generator=g) * scale).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def _sums(rank: int, world: int, shm: ShmAllReduce) -> dict:
    if os.path.exists(shm.path):
        raise AssertionError(f"{shm.path} is still in /dev/shm after construction")
    digest = hashlib.sha256()
    for step in range(ROUNDS):
        for size in SIZES:
            for dtype in (torch.float32, torch.bfloat16):
                t = _tensor(step, size, rank, dtype)
                shm.all_reduce(t)
                expected = _tensor(step, size, 0, dtype).float()
                for r in range(1, world):
                    expected += _tensor(step, size, r, dtype).float()
                if not torch.equal(_bits(t), _bits(expected.to(dtype))):
                    raise AssertionError(f"step {step}, {size} x {dtype}: not the sum in rank order")
                digest.update(_bits(t).numpy().tobytes())
    empty = torch.empty(0)
    shm.all_reduce(empty)  # takes no round: the next one still matches on every rank
    t = torch.full((3,), float(rank))
    shm.all_reduce(t)
    if t.tolist() != [world * (world - 1) / 2] * 3:
        raise AssertionError(f"after an empty tensor: {t.tolist()}")
    return {"path": shm.path, "digest": digest.hexdigest()}


def _idle_rank(rank: int, world: int, shm: ShmAllReduce) -> dict:
    """The last rank never calls all_reduce; the others must give up after TIMEOUT_S."""
    if rank == world - 1:
        dist.barrier()  # alive, elsewhere, until the others have timed out
        return {}
    try:
        shm.all_reduce(torch.ones(896))
    except CollectiveTimeoutError as e:
        result = {"error": str(e)}
    else:
        raise AssertionError("all_reduce returned without the last rank")
    dist.barrier()
    return result


def _rank_main(rank: int, world: int, port: int, results: multiprocessing.Queue) -> None:
    """Both scenarios in one process per rank: each spawn costs seconds of imports on 2 cores."""
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=20))
        result = {}
        for scenario in (_sums, _idle_rank):
            shm = ShmAllReduce(rank, world, dist.group.WORLD, capacity_bytes=CAPACITY, timeout_s=TIMEOUT_S)
            result[scenario.__name__] = scenario(rank, world, shm)
            shm.close()
        dist.destroy_process_group()
        results.put((rank, result, None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))


def _run(world: int, limit_s: float = 30.0) -> list[dict]:
    """Each rank's result, in rank order; every process is gone when this returns."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + limit_s
    try:
        while len(got) < world:
            # A rank's queue flushes its result before the process ends: once one is gone, a second is plenty.
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
            try:
                rank, result, error = results.get(timeout=1.0 if dead else 0.2)
            except queue.Empty:
                if dead or time.monotonic() > deadline:
                    pytest.fail(f"{world} ranks: only ranks {sorted(got)} answered"
                                f"{f'; rank {dead[0]} exited with {procs[dead[0]].exitcode}' if dead else ''}")
                continue
            if error is not None:
                pytest.fail(f"rank {rank} of {world}:\n{error}")
            got[rank] = result
    finally:
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda world: f"{world}-ranks")
def ranks(request) -> list[dict]:
    """Each rank's results of both scenarios, for `world` ranks."""
    return _run(request.param)


def test_exact_sums_in_rank_order_on_every_rank(ranks):
    sums = [r["_sums"] for r in ranks]
    assert len({s["digest"] for s in sums}) == 1  # every rank holds the same bits
    assert len({s["path"] for s in sums}) == 1  # every rank mapped rank 0's segment
    assert sums[0]["path"].startswith("/dev/shm/")
    assert not os.path.exists(sums[0]["path"])


def test_a_missing_rank_times_out_the_others(ranks):
    world = len(ranks)
    for rank, r in enumerate(ranks[:-1]):
        timed_out = r["_idle_rank"]
        assert timed_out["error"].startswith(f"rank {rank}: all-reduce round 1 timed out")
        assert f"ranks [{world - 1}] did not arrive" in timed_out["error"]


def test_one_rank_checks_its_tensors():
    shm = ShmAllReduce(0, 1, None)
    assert not os.path.exists(shm.path)
    t = torch.randn(5)
    expected = t.clone()
    shm.all_reduce(t)
    assert torch.equal(t, expected)
    with pytest.raises(TypeError, match="float64"):
        shm.all_reduce(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        shm.all_reduce(torch.zeros(3, 4).t())
    shm.close()
    with pytest.raises(RuntimeError, match="closed"):
        shm.all_reduce(t)

"""The parfor thread pool: chunking, executor ids, nesting, errors, joins, shutdown and fork."""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import warnings
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slotserve.parallel import threadpool as tp
from slotserve.parallel.threadpool import ThreadPool, chunk_bounds, worker_id


@pytest.fixture
def pool4():
    pool = ThreadPool(4)
    yield pool
    pool.shutdown()


def finishes(fn, seconds: float) -> bool:
    """Runs fn in a daemon thread; False if it is still running after `seconds` (a hang fails the
    test instead of freezing the run)."""
    errors: list[BaseException] = []

    def target():
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if errors:
        raise errors[0]
    return not t.is_alive()


def count_per_executor(pool: ThreadPool, n: int) -> dict[int, int]:
    counts = Counter()

    def body(ctx, i):
        ctx[worker_id()] += 1  # Counter += is not atomic, but one key belongs to one executor

    pool.parfor(0, n, body, counts)
    return dict(counts)


def test_counter_experiment_split():
    # The seed's figures, on the pure split: the parfor below uses exactly these bounds.
    assert [hi - lo for lo, hi in chunk_bounds(8_000_000, 4)] == [2_000_000] * 4
    assert [hi - lo for lo, hi in chunk_bounds(10_000_000, 3)] == [3_333_334, 3_333_333, 3_333_333]


def test_counter_experiment_runs_on_every_executor(pool4):
    # The same experiment scaled down 1000x so the Python body stays cheap.
    assert count_per_executor(pool4, 8_000) == {0: 2_000, 1: 2_000, 2: 2_000, 3: 2_000}
    three = ThreadPool(3)
    try:
        assert count_per_executor(three, 10_000) == {0: 3_334, 1: 3_333, 2: 3_333}
    finally:
        three.shutdown()


@given(n=st.integers(0, 10_000), nthreads=st.integers(1, 64))
def test_chunk_bounds_properties(n, nthreads):
    bounds = chunk_bounds(n, nthreads)
    assert len(bounds) == nthreads and bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))  # contiguous, in order
    sizes = [hi - lo for lo, hi in bounds]
    extra = n % nthreads
    assert sizes == [n // nthreads + 1] * extra + [n // nthreads] * (nthreads - extra)


def test_chunk_bounds_rejects_no_threads():
    with pytest.raises(ValueError, match="nthreads"):
        chunk_bounds(10, 0)


def test_each_executor_gets_its_chunk_and_the_caller_takes_the_last(pool4):
    seen: dict[int, tuple[int, str, set[int]]] = {}
    lock = threading.Lock()

    def body(ctx, i):
        t = threading.current_thread()
        with lock:
            ident, name, items = seen.setdefault(worker_id(), (t.ident, t.name, set()))
            assert (ident, name) == (t.ident, t.name)  # one executor index, one thread
            items.add(i)

    pool4.parfor(10, 21, body)  # 11 items: chunks of 3, 3, 3, 2
    assert {index: sorted(items) for index, (_, _, items) in seen.items()} == {
        0: [10, 11, 12], 1: [13, 14, 15], 2: [16, 17, 18], 3: [19, 20]}
    assert seen[3][0] == threading.get_ident()
    assert [seen[k][1] for k in range(3)] == ["slotserve-tp-0", "slotserve-tp-1", "slotserve-tp-2"]
    assert worker_id() == -1  # outside any region


def test_empty_and_reversed_ranges_do_nothing(pool4):
    calls = []
    pool4.parfor(5, 5, lambda ctx, i: calls.append(i))
    pool4.parfor(5, 2, lambda ctx, i: calls.append(i))
    assert calls == []


def test_fewer_items_than_threads(pool4):
    executors = {}
    pool4.parfor(0, 2, lambda ctx, i: executors.__setitem__(i, worker_id()))
    assert executors == {0: 0, 1: 1}  # the first chunks get the items; the caller's last chunk is empty


def test_single_thread_pool_runs_in_the_caller():
    pool = ThreadPool(1)
    got = []
    pool.parfor(0, 3, lambda ctx, i: got.append((i, worker_id(), threading.get_ident())))
    assert got == [(i, 0, threading.get_ident()) for i in range(3)]
    assert pool.workers == 0 and pool._workers == []
    pool.shutdown()


def test_nested_parfor_runs_serially_in_the_calling_thread(pool4):
    inner: list[tuple[int, int, int, int]] = []
    lock = threading.Lock()

    def inner_body(outer, j):
        with lock:
            inner.append((outer[0], j, worker_id(), threading.get_ident()))

    def outer_body(ctx, i):
        me = (i, worker_id(), threading.get_ident())
        pool4.parfor(0, 3, inner_body, me)
        assert all(w == me[1] and t == me[2] for o, _, w, t in inner if o == i)

    assert finishes(lambda: pool4.parfor(0, 4, outer_body), 30), "a nested parfor hung"
    assert sorted((o, j) for o, j, _, _ in inner) == [(o, j) for o in range(4) for j in range(3)]
    assert {w for _, _, w, _ in inner} == {0, 1, 2, 3}


# Chunks of 8 items on 4 executors: [0, 2) on worker 0 ... [6, 8) in the caller.
@pytest.mark.parametrize(("bad", "skipped"), [(0, {0, 1}), (7, {7})])
def test_exception_is_reraised_after_the_join_and_the_pool_stays_usable(pool4, bad, skipped):
    done = []

    def body(ctx, i):
        if i == bad:
            raise KeyError(f"item {i}")
        time.sleep(0.001)
        done.append(i)

    with pytest.raises(KeyError, match=f"item {bad}"):
        pool4.parfor(0, 8, body)
    # The failing executor dropped the rest of its chunk; the others ran theirs to the end before the raise.
    assert sorted(done) == [i for i in range(8) if i not in skipped]
    assert finishes(lambda: done.append(count_per_executor(pool4, 8)), 30)
    assert done[-1] == {0: 2, 1: 2, 2: 2, 3: 2}


def test_ten_thousand_back_to_back_tiny_regions():
    pool = ThreadPool(4)  # more threads than this machine's cores: a lost wake-up would show
    total = [0]
    lock = threading.Lock()

    def body(ctx, i):
        with lock:
            total[0] += 1

    def regions():
        for r in range(10_000):
            pool.parfor(0, r % 5, body)  # 0..4 items: empty chunks, single items, both executors

    try:
        assert finishes(regions, 60), "back-to-back regions hung"
        assert total[0] == 2_000 * (0 + 1 + 2 + 3 + 4)
    finally:
        pool.shutdown()


def test_a_slow_worker_holds_the_join_until_it_is_done(pool4):
    finished = []

    def body(ctx, i):
        if worker_id() == 1:
            time.sleep(0.3)  # past the yield tier: the join is in its 1 ms sleeps by then
        finished.append(i)

    start = time.monotonic()
    pool4.parfor(0, 4, body)
    assert time.monotonic() - start >= 0.3
    assert sorted(finished) == [0, 1, 2, 3]


def test_a_lost_wake_up_is_recovered_by_the_resignal(monkeypatch):
    monkeypatch.setattr(tp, "_RESIGNAL_S", 0.2)
    pool = ThreadPool(2)
    try:
        count_per_executor(pool, 2)
        worker = pool._workers[0]
        deadline = time.monotonic() + 5
        while not worker.sleeping and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.sleeping
        worker.sleeping = False  # the publisher now believes it awake and does not wake it: a lost wake-up
        start = time.monotonic()
        assert finishes(lambda: count_per_executor(pool, 2), 10)
        assert time.monotonic() - start >= 0.2  # recovered by the re-signal, not by the publish
    finally:
        pool.shutdown()


def test_regions_from_two_threads_take_turns(pool4):
    results = {}

    def caller(name):
        results[name] = [count_per_executor(pool4, 40) for _ in range(50)]

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(r == [{0: 10, 1: 10, 2: 10, 3: 10}] * 50 for r in results.values()) and len(results) == 2


def test_shutdown_stops_workers_and_is_idempotent():
    pool = ThreadPool(3)
    count_per_executor(pool, 3)
    workers = [w.thread for w in pool._workers]
    assert all(t.is_alive() and t.daemon for t in workers)
    pool.shutdown()
    pool.shutdown()
    assert not any(t.is_alive() for t in workers)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.parfor(0, 3, lambda ctx, i: None)


def test_shutdown_inside_a_body_is_refused(pool4):
    def body(ctx, i):
        pool4.shutdown()

    with pytest.raises(RuntimeError, match="inside a parfor body"):
        pool4.parfor(0, 4, body)


def test_default_pool_is_lazy_and_restarts_after_shutdown(monkeypatch):
    monkeypatch.setattr(tp, "_default", None)
    monkeypatch.setenv("SLOTSERVE_THREADS", "3")
    first = tp.get_pool()
    assert first is tp.get_pool() and first.threads == 3
    assert not first._workers  # no threads until the first region
    tp.parfor(0, 3, lambda ctx, i: None)
    first.shutdown()
    second = tp.get_pool()
    assert second is not first and count_per_executor(second, 6) == {0: 2, 1: 2, 2: 2}
    third = tp.configure_pool(threads=2)
    assert tp.get_pool() is third and second.closed and third.threads == 2
    third.shutdown()


def test_thread_count_settings(monkeypatch):
    monkeypatch.delenv("SLOTSERVE_THREADS", raising=False)
    assert ThreadPool().threads == len(os.sched_getaffinity(0)) == tp.available_cores()
    monkeypatch.setenv("SLOTSERVE_THREADS", "5")
    assert ThreadPool().threads == 5 and ThreadPool(2).threads == 2  # the argument wins over the env
    for bad in ("0", "many"):
        monkeypatch.setenv("SLOTSERVE_THREADS", bad)
        with pytest.raises(ValueError, match="SLOTSERVE_THREADS"):
            ThreadPool()
    with pytest.raises(ValueError, match="threads"):
        ThreadPool(0)


def test_join_spin_setting(monkeypatch):
    monkeypatch.setenv("SLOTSERVE_TP_JOIN_SPIN", "1000")
    pool = ThreadPool(2)
    assert pool.join_spin == 1000 and ThreadPool(2, join_spin=7).join_spin == 7
    assert count_per_executor(pool, 4) == {0: 2, 1: 2}  # a spinning join still completes
    pool.shutdown()
    monkeypatch.setenv("SLOTSERVE_TP_JOIN_SPIN", "-1")
    with pytest.raises(ValueError, match="SLOTSERVE_TP_JOIN_SPIN"):
        ThreadPool(2)


def test_parse_cpu_list():
    assert tp.parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert tp.parse_cpu_list("1") == [1]
    for bad in ("", "a-b", "1,,2"):
        with pytest.raises(ValueError, match="CPU list"):
            tp.parse_cpu_list(bad)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux affinity calls")
def test_workers_are_pinned_to_the_listed_cores():
    cpus = sorted(os.sched_getaffinity(0))
    pool = ThreadPool(3, cpu_affinity=cpus[:1])
    masks = {}
    pool.parfor(0, 3, lambda ctx, i: masks.__setitem__(worker_id(), os.sched_getaffinity(0)))
    pool.shutdown()
    assert masks[0] == masks[1] == {cpus[0]}
    assert masks[2] == set(cpus)  # the caller keeps its own mask
    with pytest.raises(ValueError, match="cpu_affinity"):
        ThreadPool(2, cpu_affinity=[max(cpus) + 1000])
    with pytest.raises(ValueError, match="cpu_affinity"):
        ThreadPool(2, cpu_affinity=[])


def test_torch_threads_rule_and_every_executor_gets_it():
    torch = pytest.importorskip("torch")
    assert tp.torch_threads_for(2, cores=2) == 1
    assert tp.torch_threads_for(2, cores=8) == 4
    assert tp.torch_threads_for(4, cores=2) == 1
    before = torch.get_num_threads()
    pool = ThreadPool(3)
    try:
        count_per_executor(pool, 3)  # workers that took torch's count before it changes
        count = before + 1
        assert tp.configure_torch_threads(pool, count=count) == count
        seen = {}
        pool.parfor(0, 3, lambda ctx, i: seen.__setitem__(worker_id(), torch.get_num_threads()))
        assert seen == {0: count, 1: count, 2: count}
    finally:
        pool.shutdown()
        torch.set_num_threads(before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork test for Linux")
def test_a_forked_child_gets_a_fresh_pool():
    pool = ThreadPool(3)
    count_per_executor(pool, 3)  # the parent's workers are running
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork of a threaded process
        pid = os.fork()
    if pid == 0:  # the child: report through the exit code only, never return into pytest
        code = 1
        try:
            names = {t.name for t in threading.enumerate()}
            fresh = not any(n.startswith("slotserve-tp-") for n in names)
            ok = count_per_executor(pool, 6) == {0: 2, 1: 2, 2: 2}
            default_ok = sum(count_per_executor(tp.get_pool(), 10).values()) == 10
            code = 0 if fresh and ok and default_ok else 3
        finally:
            os._exit(code)
    try:
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung on its first region")
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(status) == 0
        assert count_per_executor(pool, 3) == {0: 1, 1: 1, 2: 1}  # the parent's pool is untouched
    finally:
        pool.shutdown()


def test_bench_threads_smoke():
    import argparse

    from slotserve.bench.dev.threads import add_arguments, run_threads

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--threads", "1,2", "--cpu-affinity", "0", "--regions", "20", "--matmul-size", "16",
                              "--items", "4", "--repeats", "2"])
    result = run_threads(args)
    assert [r["threads"] for r in result["dispatch"]] == [1, 2]
    assert all(r["pool_us"] > 0 and r["executor_us"] > 0 for r in result["dispatch"])
    assert [(r["threads"], r["pinned"]) for r in result["matmul"]["pool"]] == [(1, False), (2, False), (2, True)]
    assert [r["torch_threads"] for r in result["matmul"]["torch_intra_op"]] == [1, 2]

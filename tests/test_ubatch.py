"""Micro-batch overlap's parts in one process: the split of a step's tokens (engine/model_runner.py) and the
threads that take turns (parallel/ubatch.py): strict turns, no hang when one raises, stalls or holds the turn,
one error naming the micro-batch, threads started once and none left behind; and the gate that turns overlap
off where it measures slower."""

from __future__ import annotations

import threading
import time

import pytest

from slotserve.config import EngineConfig
from slotserve.engine.model_runner import ScheduledSeq, UbatchPolicy, Want, split_tokens
from slotserve.parallel import ubatch
from slotserve.parallel.ubatch import OverlapGate, UbatchAborted, UbatchError, UbatchPool


def _seq(n: int, start: int = 0, want: Want = Want.LAST) -> ScheduledSeq:
    return ScheduledSeq(list(range(100, 100 + n)), start, [7, 8, 9, 10, 11], want=want)


def _run(prepare, run, n: int, timeout_s: float, rank: int = 0) -> list:
    """One step on a pool of its own, closed after."""
    pool = UbatchPool(n, timeout_s, rank)
    try:
        return pool.run(prepare, run)
    finally:
        pool.close()


def _threads_left() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ubatch-")]


def _no_thread_left(within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while _threads_left():
        assert time.monotonic() < deadline, f"threads left behind: {_threads_left()}"
        time.sleep(0.01)


def test_a_straddling_sequence_is_cut_at_the_boundary_and_only_its_last_piece_wants_a_row():
    parts = split_tokens([_seq(11, start=3), _seq(9, want=Want.GREEDY)], 2)
    assert [[len(s.token_ids) for s in p] for p in parts] == [[10], [1, 9]]
    first, (tail, second) = parts[0][0], parts[1]
    assert (first.start_pos, first.want) == (3, Want.NONE)
    assert (tail.start_pos, tail.want, tail.token_ids) == (13, Want.LAST, [110])  # one token of the straddler
    assert second.want is Want.GREEDY and second.block_table == [7, 8, 9, 10, 11]


def test_three_parts_are_near_equal_and_every_piece_of_an_all_wants_its_rows():
    seqs = [_seq(12, want=Want.ALL), _seq(1, start=40), _seq(8, want=Want.HIDDEN)]
    parts = split_tokens(seqs, 3)
    assert [sum(len(s.token_ids) for s in p) for p in parts] == [7, 7, 7]
    pieces = [s for p in parts for s in p]
    assert [s.want for s in pieces] == [Want.ALL, Want.ALL, Want.LAST, Want.NONE, Want.HIDDEN]
    assert [t for s in pieces[:2] for t in s.token_ids] == seqs[0].token_ids
    assert [s.start_pos for s in pieces] == [0, 7, 40, 0, 1]  # the third: 1 token, then 7


@pytest.mark.parametrize(("lens", "expect"), [
    ([1] * 31, 1), ([1] * 32, 2),  # decode-only steps: the decode threshold
    ([100, 1], 1), ([511, 1], 2),  # others: the prefill threshold
])
def test_steps_below_their_threshold_are_not_split(lens, expect):
    policy = UbatchPolicy(2, decode_threshold=32, prefill_threshold=512)
    assert policy.count_for([_seq(n) for n in lens]) == expect
    assert UbatchPolicy(1).count_for([_seq(600)]) == 1
    assert UbatchPolicy(3, 1, 1).count_for([_seq(1), _seq(1)]) == 1  # fewer tokens than micro-batches


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(ubatches=2), "ubatches"),  # one rank: nothing to overlap
    (dict(ubatches=0, tensor_parallel_size=2), "ubatches"),
    (dict(ubatches=2, tensor_parallel_size=2, ubatch_decode_threshold=0), "ubatch_decode_threshold"),
    (dict(ubatches=2, tensor_parallel_size=2, ubatch_prefill_threshold="many"), "ubatch_prefill_threshold"),
])
def test_bad_micro_batch_options_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**overrides)


def test_the_turn_goes_around_the_ring_and_one_micro_batch_runs_at_a_time():
    log, running = [], [0]

    def run(i: int, yields: int) -> str:
        me = ubatch.current()
        for k in range(yields + 1):
            running[0] += 1
            assert running[0] == 1, "two micro-batches computed at once"
            log.append((i, k))
            time.sleep(0.001)
            running[0] -= 1
            if k < yields:
                me.yield_turn()
        return threading.current_thread().name

    # Micro-batch 1 has fewer communication points: it finishes first and the others go on without it.
    names = _run(lambda i: [3, 1, 3][i], run, 3, timeout_s=10)
    assert names == ["ubatch-0", "ubatch-1", "ubatch-2"]
    assert log == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2), (2, 2), (0, 3), (2, 3)]
    assert ubatch.current() is None
    _no_thread_left()


def test_a_micro_batch_that_raises_wakes_the_others_and_the_step_fails_once():
    stopped = {}

    def run(i: int, _: None) -> None:
        me = ubatch.current()
        for k in range(50):
            if i == 1 and k == 3:
                raise ZeroDivisionError("boom")
            try:
                me.yield_turn()
            except BaseException as e:
                stopped[i] = (k, type(e))
                raise

    with pytest.raises(UbatchError, match=r"rank 5: micro-batch 1 of 3 failed: ZeroDivisionError: boom") as info:
        _run(lambda i: None, run, 3, timeout_s=600, rank=5)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    # The others were woken at their next turn by the abort, not by their waits' timeout.
    assert stopped == {0: (3, UbatchAborted), 2: (2, UbatchAborted)}
    _no_thread_left()


def test_a_micro_batch_that_never_arrives_fails_the_step_within_the_timeout():
    def prepare(i: int) -> None:
        if i == 1:  # stalls until the step has failed, as a slow thread would
            assert ubatch.current().aborted.wait(30)

    with pytest.raises(UbatchError, match=r"micro-batch 1 of 2 failed: TimeoutError: micro-batches \[1\] did not "
                                          r"reach the start within 0.5 s"):
        _run(prepare, lambda i, _: i, 2, timeout_s=0.5)
    _no_thread_left()


def test_a_micro_batch_that_raises_before_the_start_does_not_hold_the_others_at_the_barrier():
    waits = []

    def prepare(i: int) -> None:
        if i == 0:
            raise KeyError("no batch")

    def run(i: int, _: None) -> int:
        waits.append(i)
        return i

    # The one that arrived is released by the abort, never runs, and the step fails with the first cause rather
    # than a timeout of the barrier.
    with pytest.raises(UbatchError, match=r"micro-batch 0 of 2 failed: KeyError"):
        _run(prepare, run, 2, timeout_s=600)
    assert waits == []
    _no_thread_left()


def test_a_micro_batch_that_keeps_the_turn_fails_its_peer_at_the_timeout():
    release = threading.Event()

    def run(i: int, _: None) -> None:
        if i == 0:
            release.wait(30)  # computes "forever": never hands the turn on
        ubatch.current().yield_turn()

    with pytest.raises(UbatchError, match=r"micro-batch 1 of 2 failed: TimeoutError: waited 0.5 s for its turn "
                                          r"while micro-batch 0 had it"):
        _run(lambda i: None, run, 2, timeout_s=0.5)
    release.set()  # the stuck one goes on, finds the step failed, and stops
    _no_thread_left()


def test_a_pool_runs_every_step_on_the_same_threads_and_close_leaves_none():
    pool = UbatchPool(2, timeout_s=10)
    steps = [pool.run(lambda i: i, lambda i, _: threading.get_ident()) for _ in range(5)]
    assert len({tuple(s) for s in steps}) == 1 and len(set(steps[0])) == 2
    assert sorted(_threads_left()) == ["ubatch-0", "ubatch-1"]
    pool.close()
    _no_thread_left()
    pool.close()  # idempotent


def test_after_a_failed_step_the_pool_starts_fresh_threads():
    pool = UbatchPool(2, timeout_s=10)
    before = pool.run(lambda i: i, lambda i, _: threading.current_thread())

    def run(i: int, _: None) -> None:
        raise ValueError("bad step")

    with pytest.raises(UbatchError, match="ValueError: bad step"):
        pool.run(lambda i: None, run)
    after = pool.run(lambda i: i, lambda i, _: (i, threading.current_thread()))
    assert [i for i, _ in after] == [0, 1]
    assert not any(t is old for _, t in after for old in before) and not any(t.is_alive() for t in before)
    pool.close()
    _no_thread_left()


def _feed(gate: OverlapGate, decode: bool, tokens: int, split_s: float, whole_s: float, steps: int) -> list[bool]:
    """`steps` steps as the gate asks for them, each taking these seconds; the ways it asked for."""
    ways = []
    for _ in range(steps):
        split = gate.wants(decode, tokens)
        ways.append(split)
        gate.record(decode, tokens, split, split_s if split else whole_s)
    return ways


def test_the_gate_tries_both_ways_after_a_warm_up_each_then_keeps_the_faster():
    gate = OverlapGate()
    ways = _feed(gate, True, 64, split_s=2.0, whole_s=1.0, steps=8)
    # Split first; the first step of each way is a warm-up and not counted; then as many samples of each.
    assert ways[:8] == [True, True, False, False, True, False, True, False]
    assert not any(_feed(gate, True, 64, split_s=2.0, whole_s=1.0, steps=40))
    assert gate.choices() == {"decode <= 64 tokens": False}
    faster = OverlapGate()
    _feed(faster, False, 1000, split_s=1.0, whole_s=2.0, steps=8)
    assert all(_feed(faster, False, 1000, split_s=1.0, whole_s=2.0, steps=40))
    assert faster.choices() == {"prefill <= 1024 tokens": True}


def test_the_gate_probes_the_other_way_now_and_then_and_follows_a_change():
    gate = OverlapGate()
    _feed(gate, True, 32, split_s=2.0, whole_s=1.0, steps=8)
    ways = _feed(gate, True, 32, split_s=2.0, whole_s=1.0, steps=2 * OverlapGate.PROBE_EVERY)
    assert [i for i, w in enumerate(ways) if w] == [OverlapGate.PROBE_EVERY - 1, 2 * OverlapGate.PROBE_EVERY - 1]
    # Split steps got faster (a slower link): the probes' samples turn the gate around.
    ways = _feed(gate, True, 32, split_s=0.5, whole_s=1.0, steps=OverlapGate.SAMPLES * OverlapGate.PROBE_EVERY - 1)
    assert ways[-1] and gate.choices() == {"decode <= 32 tokens": True}


def test_the_gate_keeps_kinds_apart():
    gate = OverlapGate()
    _feed(gate, True, 32, split_s=2.0, whole_s=1.0, steps=8)
    assert not gate.wants(True, 17)  # decode steps of 17..32 tokens are one kind
    assert gate.wants(True, 33) and gate.wants(False, 32)  # others are still to be tried, split first

"""Scheduler bookkeeping (torch-free): prefill rounds are gathered, never lose a sequence."""

from __future__ import annotations

import random

import pytest

from relaycli.config import EngineConfig
from relaycli.engine.block_manager import BlockManager
from relaycli.engine.scheduler import Scheduler
from relaycli.engine.sequence import SamplingOptions, Sequence


def _seq(i: int, own: int) -> Sequence:
    return Sequence(i, list(range(own)), SamplingOptions(max_tokens=64), 0, None)


def _finish_some(sched: Scheduler, n: int) -> None:
    for seq in list(sched.running)[:n]:
        sched.finish(seq)


def test_prefill_waits_for_min_prefill_seqs_free_slots():
    sched = Scheduler(EngineConfig(max_num_seqs=8, min_prefill_seqs=3), BlockManager(1000, 16))
    for i in range(20):
        sched.add(_seq(i, 5))
    seqs, is_prefill = sched.schedule()
    assert is_prefill and len(seqs) == 8  # nothing running: fill every slot
    assert not sched.schedule()[1]
    _finish_some(sched, 2)
    seqs, is_prefill = sched.schedule()
    assert not is_prefill and len(seqs) == 6  # 2 free < 3: keep decoding
    _finish_some(sched, 1)
    seqs, is_prefill = sched.schedule()
    assert is_prefill and [s.seq_id for s in seqs] == [8, 9, 10]
    assert not sched.schedule()[1]


def test_a_round_continues_past_the_token_budget_until_the_slots_are_full():
    sched = Scheduler(EngineConfig(max_num_seqs=8, min_prefill_seqs=4, max_num_batched_tokens=10),
                      BlockManager(1000, 16))
    for i in range(8):
        sched.add(_seq(i, 4))
    sizes = []
    while True:
        seqs, is_prefill = sched.schedule()
        if not is_prefill:
            break
        sizes.append(len(seqs))
    assert sizes == [2, 2, 2, 2] and len(sched.running) == 8


def test_few_waiting_sequences_start_a_round_at_once():
    sched = Scheduler(EngineConfig(max_num_seqs=8, min_prefill_seqs=4), BlockManager(1000, 16))
    for i in range(9):
        sched.add(_seq(i, 3))
    sched.schedule()
    _finish_some(sched, 1)  # one waiting, one slot free: no reason to wait
    seqs, is_prefill = sched.schedule()
    assert is_prefill and [s.seq_id for s in seqs] == [8]


def test_a_cache_bound_batch_also_waits_for_room_for_a_round():
    # 8 blocks of 16 slots; every sequence needs 2 blocks, so only 4 run although 8 may
    sched = Scheduler(EngineConfig(max_num_seqs=8, min_prefill_seqs=2), BlockManager(8, 16))
    for i in range(10):
        sched.add(_seq(i, 20))
    seqs, is_prefill = sched.schedule()
    assert is_prefill and len(seqs) == 4
    assert not sched.schedule()[1]  # the cache is full: decode
    _finish_some(sched, 1)  # 2 blocks free: room for one sequence, the round needs two
    seqs, is_prefill = sched.schedule()
    assert not is_prefill and len(seqs) == 3
    _finish_some(sched, 1)
    seqs, is_prefill = sched.schedule()
    assert is_prefill and [s.seq_id for s in seqs] == [4, 5]


def test_decode_steps_list_the_longest_own_context_first_and_keep_ties_in_order():
    sched = Scheduler(EngineConfig(max_num_seqs=6, min_prefill_seqs=1), BlockManager(1000, 16))
    lengths = [5, 40, 5, 17, 40, 1]
    for i, own in enumerate(lengths):
        sched.add(_seq(i, own))
    assert sched.schedule()[1]
    for step in range(3):
        seqs, is_prefill = sched.schedule()
        assert not is_prefill and [s.seq_id for s in seqs] == [1, 4, 3, 0, 2, 5]
        for seq in seqs:
            seq.output_ids.append(1)
            seq.num_cached_own = seq.num_own_tokens


def test_min_prefill_seqs_default_and_bounds():
    assert EngineConfig(max_num_seqs=256).min_prefill_seqs == 32
    assert EngineConfig(max_num_seqs=4).min_prefill_seqs == 1
    with pytest.raises(ValueError, match="min_prefill_seqs"):
        EngineConfig(max_num_seqs=4, min_prefill_seqs=5)


@pytest.mark.parametrize("seed", range(8))
def test_random_finishes_lose_no_sequence(seed):
    rng = random.Random(seed)
    num_seqs = rng.randint(1, 16)
    sched = Scheduler(EngineConfig(max_num_seqs=num_seqs, min_prefill_seqs=rng.randint(1, num_seqs)),
                      BlockManager(rng.randint(40, 200), 4))
    total = rng.randint(1, 60)
    for i in range(total):
        sched.add(_seq(i, rng.randint(1, 20)))
    done: list[int] = []
    for _ in range(10_000):
        if sched.num_unfinished == 0:
            break
        seqs, is_prefill = sched.schedule()
        assert seqs, "the scheduler must always find work while sequences are pending"
        assert len(sched.running) <= num_seqs
        for seq in seqs:
            seq.output_ids.append(1)
            seq.num_cached_own = seq.num_own_tokens
            if not is_prefill and rng.random() < 0.2:
                sched.finish(seq)
                done.append(seq.seq_id)
    assert sorted(done) == list(range(total))


def test_a_round_takes_sequences_by_shared_prefix():
    sched = Scheduler(EngineConfig(max_num_seqs=6, min_prefill_seqs=2), BlockManager(1000, 16))
    seqs = {}

    def add(i: int, slot: int | None) -> None:
        seqs[i] = Sequence(i, [1, 2, 3], SamplingOptions(max_tokens=64), 0 if slot is None else 5, slot)
        sched.add(seqs[i])
    for i, slot in enumerate([0, 0, 0, 1, None, 1]):
        add(i, slot)
    # nothing running: the prefixes most sequences share first, each in arrival order
    assert [s.seq_id for s in sched.schedule()[0]] == [0, 1, 2, 3, 5, 4]
    assert not sched.schedule()[1]  # a decode step ends the round
    for i, slot in enumerate([2, 1, 0, 2, 0, None], start=6):
        add(i, slot)
    seqs[5].output_ids.append(7)  # preempted (slot 1): it keeps its turn
    sched._preempt(seqs[5])
    sched.finish(seqs[3])  # running: slot 0 x3, no prefix x1
    scheduled, is_prefill = sched.schedule()
    # two free slots: the preempted one, then the prefix of the longest-waiting (6, slot 2)
    assert is_prefill and [s.seq_id for s in scheduled] == [5, 6]
    # then slot 0 (3 running), no prefix (1 running), then slot 1 (0 running)
    assert [s.seq_id for s in sched.waiting] == [9, 8, 10, 11, 7]


def test_every_round_takes_the_longest_waiting_sequence_so_a_rare_prefix_is_never_starved():
    """An engine-like loop: the queue refilled to 4 x the batch, each row 20 decode steps,
    one row in 50 of a rare prefix. Grouping by the prefixes the batch holds would keep a
    rare row waiting while common ones keep coming; each round takes the longest-waiting."""
    sched = Scheduler(EngineConfig(max_num_seqs=8, min_prefill_seqs=2), BlockManager(100000, 16))
    fed, age, started = 0, {}, {}
    while fed < 600 or sched.num_unfinished:
        while fed < 600 and sched.num_unfinished < 32:
            slot = 1 if fed % 50 == 7 else 0
            sched.add(Sequence(fed, [1, 2, 3], SamplingOptions(max_tokens=64), 5, slot))
            fed += 1
        seqs, is_prefill = sched.schedule()
        for seq in seqs:
            if is_prefill:
                started[seq.seq_id] = len(started)
                age[seq.seq_id] = 0
            else:
                seq.output_ids.append(1)
                age[seq.seq_id] += 1
                if age[seq.seq_id] >= 20:
                    sched.finish(seq)
    rare = [i for i in range(600) if i % 50 == 7]
    # each rare row starts within one batch of its place in arrival order
    assert all(started[i] <= i + 8 for i in rare), [(i, started[i]) for i in rare]

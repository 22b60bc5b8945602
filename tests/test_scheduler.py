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
    assert is_prefill and [s.seq_id for s in scheduled] == [5, 8]  # two free slots
    # then slot 0 (3 running), no prefix (1 running), then slots 1 and 2 (2 queued each,
    # slot 1 queued first)
    assert [s.seq_id for s in sched.waiting] == [10, 11, 7, 6, 9]

"""ModelRunner.prepare: a step's token ids, positions, cache slots and prefix groups equal
what each sequence says of its own tokens, for prefill and decode steps alike."""

import random
import types

import pytest
import torch

from relaycli.engine.model_runner import ModelRunner
from relaycli.engine.sequence import SamplingOptions, Sequence


def _runner(block_size: int) -> types.SimpleNamespace:
    """What prepare reads of a runner: the block size, the device and the prefixes' lengths."""
    return types.SimpleNamespace(block_size=block_size, device=torch.device("cpu"),
                                 prefixes=[types.SimpleNamespace(num_tokens=n) for n in (300, 5, 4000, 17)])


def _sequences(rng: random.Random, block_size: int, is_prefill: bool) -> list[Sequence]:
    seqs = []
    for i in range(rng.randint(1, 40)):
        slot = rng.choice([None, 0, 1, 2, 3])
        prefix = 0 if slot is None else [300, 5, 4000, 17][slot]
        seq = Sequence(i, [rng.randrange(1000) for _ in range(rng.randint(1, 90))], SamplingOptions(max_tokens=8),
                       num_prefix_tokens=prefix, prefix_slot=slot,
                       output_ids=[rng.randrange(1000) for _ in range(rng.randint(0, 30))],
                       first_position=rng.choice([None, rng.randrange(0, 4000)]))  # a module row's positions
        # a prefill may resume a preempted or partly cached sequence
        seq.num_cached_own = rng.randrange(seq.num_own_tokens) if is_prefill else seq.num_own_tokens - 1
        seq.block_table = rng.sample(range(10 ** 5), -(-seq.num_own_tokens // block_size))
        seqs.append(seq)
    return seqs


def test_prepare_gives_each_new_tokens_id_position_slot_and_group():
    rng = random.Random(5)
    for trial in range(60):
        block_size = rng.choice([1, 16, 64])
        is_prefill = trial % 2 == 0
        seqs = _sequences(rng, block_size, is_prefill)
        ids, positions, meta, last_rows = ModelRunner.prepare(_runner(block_size), seqs, is_prefill)
        want_ids, want_pos, want_slots, cu = [], [], [], [0]
        for s in seqs:
            new = range(s.num_cached_own, s.num_own_tokens)
            want_ids += [s.own_ids()[i] for i in new]
            want_pos += [s.position_base + i for i in new]
            want_slots += [s.slot(i, block_size) for i in new]
            cu.append(cu[-1] + len(new))
        assert ids.tolist() == want_ids
        assert positions.tolist() == want_pos and positions.dtype == torch.int64
        assert meta.slot_mapping.tolist() == want_slots and meta.slot_mapping.dtype == torch.int64
        assert meta.cu_seqlens_q.tolist() == cu and meta.cu_seqlens_q.dtype == torch.int32
        assert meta.max_seqlen_q == max(b - a for a, b in zip(cu, cu[1:]))
        assert last_rows.tolist() == [c - 1 for c in cu[1:]]
        width = max(len(s.block_table) for s in seqs)
        assert meta.block_tables.tolist() == [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        assert meta.context_lens.tolist() == [s.num_own_tokens for s in seqs]
        slots = sorted({s.prefix_slot for s in seqs} - {None})
        assert [g.prefix_slot for g in meta.prefix_groups] == slots
        for g in meta.prefix_groups:
            rows = [b for b, s in enumerate(seqs) if s.prefix_slot == g.prefix_slot]
            assert g.seq_indices.tolist() == rows
            assert g.query_indices.tolist() == [q for b in rows for q in range(cu[b], cu[b + 1])]
            assert g.num_prefix_tokens == [300, 5, 4000, 17][g.prefix_slot]


def test_prepare_refuses_a_sequence_whose_blocks_do_not_hold_its_tokens():
    """A missing block would otherwise read as block 0 of the padded table: another
    sequence's keys."""
    seqs = [Sequence(0, list(range(40)), SamplingOptions(max_tokens=8)),
            Sequence(1, list(range(10)), SamplingOptions(max_tokens=8))]
    seqs[0].block_table, seqs[1].block_table = [3, 4, 5], [7]  # 16-key blocks: row 0 needs 3, has 3
    ModelRunner.prepare(_runner(16), seqs, True)
    seqs[0].block_table = [3, 4]
    with pytest.raises(AssertionError, match="blocks must hold all its tokens"):
        ModelRunner.prepare(_runner(16), seqs, True)

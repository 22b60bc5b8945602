"""n completions of one row: forked after its prefill, sharing its prompt's KV blocks.

Block bookkeeping (torch-free): forks share the full blocks, copy a partial last one, and
every block comes back once all holders let go. On the default model: completion 0 of an
n-row is the row's n = 1 answer, completion i the n = 1 answer with seed derive_seed(seed, i),
with the prompt prefilled once, also when a small cache preempts forks mid-answer.
"""

from __future__ import annotations

import pytest

from relaycli.config import EngineConfig
from relaycli.engine.block_manager import BlockManager
from relaycli.engine.scheduler import Scheduler
from relaycli.engine.sequence import SamplingOptions, Sequence
from relaycli.io.requests import RequestDefaults, derive_seed, parse_request


def _seq(i: int, own: int, parent: Sequence | None = None) -> Sequence:
    return Sequence(i, list(range(own)), SamplingOptions(max_tokens=8), fork_of=parent)


@pytest.mark.parametrize("own, copies", [(20, 1), (32, 0)])
def test_forks_share_full_blocks_and_copy_a_partial_one(own, copies):
    bm = BlockManager(10, 16)
    sched = Scheduler(EngineConfig(max_num_seqs=4, min_prefill_seqs=1), bm)
    parent = _seq(0, own)
    parent.forks = [_seq(1, own, parent), _seq(2, own, parent)]
    sched.add(parent)
    seqs, is_prefill = sched.schedule()
    assert is_prefill and seqs[0] is parent and len(seqs) == 3 and not parent.forks
    full = own // 16
    for child in seqs[1:]:
        assert child.block_table[:full] == parent.block_table[:full]
        assert (child.copy_block is not None) == bool(copies)
        if copies:
            assert child.copy_block == (parent.block_table[-1], child.block_table[-1])
            assert child.block_table[-1] != parent.block_table[-1]
    assert bm.num_free_blocks == 10 - len(parent.block_table) - 2 * copies
    for seq in seqs:
        sched.finish(seq)
    assert bm.num_free_blocks == 10 and sorted(bm.free_blocks) == list(range(10)) and not any(bm.refs)


def test_a_row_waits_until_all_its_completions_fit_the_batch():
    sched = Scheduler(EngineConfig(max_num_seqs=4, min_prefill_seqs=1), BlockManager(100, 16))
    first, second = _seq(0, 5), _seq(1, 5)
    second.forks = [_seq(2, 5, second), _seq(3, 5, second), _seq(4, 5, second)]
    sched.add(first)
    sched.add(second)
    seqs, _ = sched.schedule()
    assert seqs == [first]  # 1 + 4 sequences would not fit 4 slots
    sched.finish(first)
    seqs, _ = sched.schedule()
    assert len(seqs) == 4 and seqs[0] is second


PROMPTS = ["Tell me a short story about a cat.", "Name three fruits.", "What is the weather like on Mars?"]


def _answers(model, raws, **config):
    from relaycli.engine.engine import Engine
    engine = Engine(model, [], EngineConfig(max_num_seqs=8, **config))
    rows = [parse_request(r, i, RequestDefaults(max_tokens=6, temperature=0.9)) for i, r in enumerate(raws)]
    return engine, {r.row_index: r for r in engine.generate(rows)}


def _tight_cache(model, block: int) -> dict:
    """A cache that takes the first two rows' prefills (with their forks' copies) and little
    more, so their completions preempt one another as they grow."""
    c = model.config
    own = [len(model.tokenizer.render([{"role": "user", "content": p}])) for p in PROMPTS[:2]]
    blocks = sum(-(-n // block) + 2 * (n % block != 0) for n in own) + 1
    per_block = 2 * c.num_hidden_layers * block * c.num_key_value_heads * c.head_dim * 4
    return {"kv_cache_gb": (blocks + 1.5) * per_block / 1024**3, "block_size": block}


@pytest.mark.slow
@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "preempting"])
def test_completions_equal_their_one_answer_rows(default_model, tight):
    seed = 11
    config = _tight_cache(default_model, 4) if tight else {}
    n_rows = [{"prompt": p, "n": 3, "seed": seed + k, "logprobs": True} for k, p in enumerate(PROMPTS)]
    engine, got = _answers(default_model, n_rows, **config)
    singles = [{"prompt": p, "seed": seed + k if i == 0 else derive_seed(seed + k, i), "logprobs": True}
               for k, p in enumerate(PROMPTS) for i in range(3)]
    single_engine, want = _answers(default_model, singles)
    for k in range(len(PROMPTS)):
        row = got[k]
        assert row.error is None and len(row.completions) == 3
        assert [c["index"] for c in row.completions] == [0, 1, 2]
        assert row.text == row.completions[0]["text"] and row.logprobs == row.completions[0]["logprobs"]
        assert row.completion_tokens == sum(c["completion_tokens"] for c in row.completions)
        for i, c in enumerate(row.completions):
            one = want[3 * k + i]
            assert (c["text"], c["finish_reason"]) == (one.text, one.finish_reason), (k, i)
            assert [e["logprob"] for e in c["logprobs"]] == pytest.approx([e["logprob"] for e in one.logprobs],
                                                                           abs=1e-4)
    assert engine.stats.forks == 6
    if not config:  # each prompt prefilled once, not three times
        assert engine.stats.prefill_tokens * 3 == single_engine.stats.prefill_tokens
    else:
        assert engine.stats.preemptions > 0


@pytest.mark.slow
def test_constrained_completions_and_too_many(default_model):
    raws = [{"prompt": "Is water wet?", "choices": ["yes", "no", "maybe"], "n": 4, "max_tokens": 4},
            {"prompt": "Hi", "n": 9}]
    _, got = _answers(default_model, raws)
    assert [c["text"] in ("yes", "no", "maybe") for c in got[0].completions] == [True] * 4
    assert got[1].finish_reason == "error" and "lower n or raise --max-batch" in got[1].error

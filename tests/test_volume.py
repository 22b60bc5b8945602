"""Memory that does not grow with a job's rows: the done-rows bitmap, the engine's bounded
stats, the KV blocks a long job touches, the writer and its final merge.

`relay bench volume` measures whole runs (docs/benchmarks.md); these check the parts.
"""

from __future__ import annotations

import random
import tracemalloc

import pytest

from relaycli.engine.block_manager import BlockManager
from relaycli.engine.sequence import SamplingOptions, Sequence
from relaycli.engine.stats import SUMMARY_VALUES, EngineStats, Summary, quantile
from relaycli.io.requests import ResultRow
from relaycli.io.rowset import RowSet
from relaycli.io.writer import ResultWriter

AS_DICT_KEYS = [
    "rows", "errors", "prefix_hits", "prefix_misses", "prompt_tokens", "cached_tokens", "completion_tokens",
    "prefill_steps", "decode_steps", "prefill_seconds", "decode_seconds", "preemptions", "graphs_available",
    "graphed_decode_steps", "eager_decode_steps", "eager_reasons", "prompt_fallbacks", "device_wait_seconds",
    "prefill_launch_seconds", "decode_launch_seconds", "prefill_tokens", "forks", "module_paths_built",
    "module_paths_dropped", "ttft_mean_seconds", "ttft_p50_seconds",
    "ttft_p90_seconds", "decode_step_mean_seconds", "decode_step_p50_seconds", "elapsed_seconds",
    "generated_tokens_per_second", "rows_per_second"]


def test_rowset_is_a_set_of_row_numbers_in_a_bit_each():
    rng = random.Random()
    rows, plain = RowSet(), set()
    for _ in range(5000):
        i = rng.randrange(20_000)
        rows.add(i)
        plain.add(i)
    assert rows == plain and len(rows) == len(plain) and list(rows) == sorted(plain)
    assert all((i in rows) == (i in plain) for i in range(-3, 20_010)) and "7" not in rows
    assert set(range(20_000)) - rows == set(range(20_000)) - plain
    copy = rows.copy()
    copy.add(20_000)
    assert 20_000 not in rows and 20_000 in copy
    with pytest.raises(ValueError):
        rows.add(-1)
    big = RowSet(range(0, 1_000_000, 3))
    assert len(big) == 333_334 and big.nbytes() <= 250_000  # a Python set of these: about 40 MB


def test_summary_is_exact_up_to_its_bound_then_a_sample_of_fixed_size():
    rng = random.Random()
    values = [rng.random() for _ in range(SUMMARY_VALUES)]
    s = Summary()
    for v in values:
        s.add(v)
    ordered = sorted(values)
    assert s.exact and all(s.quantile(q) == quantile(ordered, q) for q in (0, 0.5, 0.9, 1))
    more = [rng.random() for _ in range(20 * SUMMARY_VALUES)]
    for v in more:
        s.add(v)
    everything = sorted(values + more)
    assert not s.exact and s.count == len(everything) and len(s._values) == SUMMARY_VALUES
    assert s.mean() == pytest.approx(sum(everything) / len(everything))
    for q in (0.5, 0.9):  # uniform values: a quantile's value is its rank; the sample's is within 3%
        assert abs(s.quantile(q) - quantile(everything, q)) < 0.03
    assert Summary().quantile(0.5) is None and Summary().mean() is None


def test_engine_stats_stay_bounded_and_keep_as_dicts_keys():
    stats = EngineStats()
    for i in range(50_000):
        stats.add_ttft(i * 1e-6)
        stats.add_decode(2, 100, 1e-3)
        stats.add_prefill(2, 7, 2e-3)
    assert stats.ttft_seconds is None and stats.decode_step_log is None and stats.prefill_step_log is None
    assert stats.ttft.count == 50_000 and len(stats.ttft._values) == SUMMARY_VALUES
    d = stats.as_dict()
    assert list(d) == AS_DICT_KEYS
    assert d["prefill_tokens"] == 350_000 and d["decode_steps"] == d["prefill_steps"] == 50_000
    assert d["ttft_mean_seconds"] == pytest.approx(49_999 * 1e-6 / 2)
    assert d["decode_step_p50_seconds"] == pytest.approx(1e-3) == d["decode_step_mean_seconds"]
    logged = EngineStats(keep_logs=True)  # what relay bench asks for: every row and step
    logged.add_ttft(0.5)
    logged.add_decode(3, 30, 0.25)
    logged.add_prefill(1, 9, 0.125)
    assert (logged.ttft_seconds, logged.decode_step_log, logged.prefill_step_log) == ([0.5], [(3, 30, 0.25)],
                                                                                      [(1, 9, 0.125)])
    assert list(logged.as_dict()) == AS_DICT_KEYS


def test_a_job_that_has_ended_keeps_its_elapsed_time():
    # a --devices job ends when its answers are written; its workers' exit comes after
    stats = EngineStats()
    stats.rows, stats.completion_tokens = 10, 40
    stats.started, stats.ended = 100.0, 104.0
    d = stats.as_dict()
    assert d["elapsed_seconds"] == 4.0 and d["rows_per_second"] == 2.5 and d["generated_tokens_per_second"] == 10.0
    assert "ended" not in d and "started" not in d


def test_a_long_job_touches_only_the_kv_blocks_it_holds_at_once():
    """On the CPU a block's pages are mapped when first written: handing out the blocks
    freed last keeps a job of any length inside the blocks it ever holds at once."""
    manager = BlockManager(num_blocks=10_000, block_size=16)
    rng = random.Random()
    live, touched, most = [], set(), 0
    for n in range(20_000):
        seq = Sequence(n, [1] * rng.randint(1, 40), SamplingOptions(max_tokens=1), 0, None)
        manager.allocate(seq)
        touched.update(seq.block_table)
        live.append(seq)
        most = max(most, sum(len(s.block_table) for s in live))
        if len(live) > 8 or rng.random() < 0.3:
            manager.free(live.pop(rng.randrange(len(live))))
    assert len(touched) <= most < 50
    for seq in live:
        manager.free(seq)
    assert sorted(manager.free_blocks) == list(range(10_000))


def _traced_peak(rows: int, tmp_path) -> int:
    """Peak Python heap while a writer takes `rows` answers in parts and merges them."""
    out = tmp_path / f"out-{rows}.parquet"
    tracemalloc.start()
    try:
        with ResultWriter(out, flush_rows=256) as w:
            w.bind_job({"input_sha256": "x"}, rows, iter(()))
            for i in range(rows):
                w.write(ResultRow(row_index=i, id=str(i), text=" hi", finish_reason="length", prompt_tokens=9,
                                  cached_tokens=8, completion_tokens=1, error=None))
            w.finalize(rows)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_writer_and_its_merge_do_not_grow_with_the_rows(tmp_path):
    """Parts of 256 rows: 64,000 rows make 250 parts, 256,000 rows 1,000, merged in rounds
    of 64. A merge's readers hold parts.MERGE_ROWS rows between them and the output is
    written WRITE_ROWS at a time, whatever the job's size, and the done rows are a bit
    each: four times the rows, about the same peak heap."""
    small, large = _traced_peak(64_000, tmp_path), _traced_peak(256_000, tmp_path)
    assert large < 1.25 * small, (small, large)

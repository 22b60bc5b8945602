"""Token-id requests (benchmarks, dummy models): bad ones become error rows, never a crash."""

import random

import pytest

from relaycli.models.registry import load_model
from relaycli.compile import prefix_from_ids
from relaycli.config import EngineConfig
from relaycli.engine.engine import Engine, TokenRequest
from relaycli.engine.sequence import SamplingOptions


def test_empty_or_prefix_only_prompts_are_error_rows_and_the_job_goes_on():
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(100))
    ids = [random.randrange(lm.config.vocab_size) for _ in range(5)]
    prefix = prefix_from_ids(lm, ids)
    engine = Engine(lm, [prefix], EngineConfig(max_num_seqs=4), record_token_ids=True)
    reqs = [TokenRequest(0, "prefix-only", [], SamplingOptions(max_tokens=3), prefix_slot=0),
            TokenRequest(1, "ok", [1, 2], SamplingOptions(max_tokens=3, ignore_eos=True), prefix_slot=0),
            TokenRequest(2, "empty", [], SamplingOptions(max_tokens=3)),
            TokenRequest(3, "no-prefix", [3, 4], SamplingOptions(max_tokens=3, ignore_eos=True))]
    out = {r.row_index: r for r in engine.generate_tokens(reqs)}
    assert sorted(out) == [0, 1, 2, 3]
    assert out[0].finish_reason == "error" and "no token after its 5-token shared prefix" in out[0].error
    assert out[2].finish_reason == "error" and "the prompt is empty" in out[2].error
    assert out[1].completion_tokens == 3 and out[3].completion_tokens == 3
    assert out[1].cached_tokens == 5 and out[3].cached_tokens == 0
    assert len(engine.token_ids_by_row[1]) == 3 and engine.stats.errors == 2


def test_steps_read_back_a_step_late_end_exactly_where_eos_and_max_tokens_say():
    """The engine reads each step's tokens while the next step runs, so EOS is seen one
    step late. Under batching, preemption (a tiny cache) and several EOS ids, every
    sequence must still end exactly at its first EOS or at max_tokens."""
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(1000))
    rng = random.Random()
    vocab = lm.config.vocab_size
    ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
    prefix = prefix_from_ids(lm, ids)
    owns = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(12)]

    def run(config, max_tokens, ignore_eos, eos=None):
        engine = Engine(lm, [prefix], config, record_token_ids=True, keep_step_logs=True)
        if eos is not None:
            engine.eos_ids = frozenset(eos)
        reqs = [TokenRequest(i, str(i), own, SamplingOptions(max_tokens=m, ignore_eos=ignore_eos), prefix_slot=0)
                for i, (own, m) in enumerate(zip(owns, max_tokens))]
        out = {r.row_index: r for r in engine.generate_tokens(reqs)}
        return out, engine

    # each request alone, never stopping: the greedy continuation to cut by hand
    free = {}
    for i in range(len(owns)):
        engine = Engine(lm, [prefix], EngineConfig(max_num_seqs=1), record_token_ids=True)
        list(engine.generate_tokens([TokenRequest(i, str(i), owns[i], SamplingOptions(24, ignore_eos=True),
                                                  prefix_slot=0)]))
        free[i] = engine.token_ids_by_row[i]
    per_block = engine.runner.bytes_per_block()
    # Some draws (EOS ids that end most sequences within their first block) never fill the
    # tiny cache: about 1 in 13 did. Redraw the limits and EOS ids until this run preempts.
    for _ in range(20):
        limits = [rng.randint(1, 24) for _ in owns]
        eos = {free[i][rng.randrange(len(free[i]))] for i in rng.sample(range(len(owns)), 3)}
        out, engine = run(EngineConfig(max_num_seqs=6, kv_cache_gb=8 * per_block / 1024**3), limits, False, eos)
        if engine.scheduler.num_preemptions:
            break
    assert engine.scheduler.num_preemptions > 0
    for i, m in enumerate(limits):
        want = free[i][:m]
        cut = next((j for j, t in enumerate(want) if t in eos), None)
        if cut is not None:
            want = want[:cut + 1]
        assert engine.token_ids_by_row[i] == want, i
        assert out[i].finish_reason == ("stop" if cut is not None else "length")
        assert out[i].completion_tokens == len(want)
    assert sorted(out) == list(range(len(owns)))
    st = engine.stats
    assert len(st.ttft_seconds) == st.ttft.count == len(owns)  # one first token per row, recomputed ones not again
    assert st.decode_steps == len(st.decode_step_log) and st.prefill_steps == len(st.prefill_step_log)
    assert st.prefill_tokens >= sum(map(len, owns)) and engine._pending is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    _, waited = run(EngineConfig(max_num_seqs=6, kv_cache_gb=8 * per_block / 1024**3, overlap_steps=False),
                    limits, False, eos)
    assert waited.token_ids_by_row == engine.token_ids_by_row  # reading back at once changes nothing


def test_decode_step_log_counts_each_steps_batch_and_own_context():
    """Without preemption or EOS, the decode steps' batches add up to every request's
    output_len - 1 queries, and their context sums to what the roofline prices."""
    from relaycli.bench.roofline import decode_context_sum
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(1000))
    rng = random.Random()
    vocab = lm.config.vocab_size
    ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
    prefix = prefix_from_ids(lm, ids)
    shapes = [(rng.randint(1, 30), rng.randint(1, 12)) for _ in range(9)]
    reqs = [TokenRequest(i, str(i), [rng.randrange(vocab) for _ in range(n_in)],
                         SamplingOptions(max_tokens=n_out, ignore_eos=True), prefix_slot=0)
            for i, (n_in, n_out) in enumerate(shapes)]
    engine = Engine(lm, [prefix], EngineConfig(max_num_seqs=rng.randint(2, 5)), keep_step_logs=True)
    assert len(list(engine.generate_tokens(reqs))) == len(shapes)
    log = engine.stats.decode_step_log
    assert len(log) == engine.stats.decode_steps and all(b >= 1 and s >= 0 for b, _, s in log)
    assert sum(b for b, _, _ in log) == sum(n_out - 1 for _, n_out in shapes)
    assert sum(c for _, c, _ in log) == sum(decode_context_sum(n_in, n_out) for n_in, n_out in shapes)


def test_frozen_heap_spares_setup_objects_and_unfreezes_on_exit():
    """Inside, objects alive on entry are out of the collector's reach; garbage made
    before entry is collected on entry, and a cycle frozen inside is collectable again
    after exit (engines freed after a job may sit in cycles that hold their KV cache)."""
    import gc
    import weakref

    from relaycli.bench.e2e import GcPauses
    from relaycli.engine.engine import frozen_heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return a, weakref.ref(a)

    dead_before = cycle()[1]  # garbage on entry
    kept, kept_ref = cycle()  # alive on entry, dropped inside
    with frozen_heap(), GcPauses() as pauses:
        assert dead_before() is None and gc.get_freeze_count() > 0
        del kept
        gc.collect()
        assert kept_ref() is not None  # frozen: the collection did not look at it
        made_inside = cycle()[1]
        gc.collect()
        assert made_inside() is None  # what the job allocates is still collected
    assert gc.get_freeze_count() == 0
    assert pauses.count >= 2 and pauses.seconds > 0
    with frozen_heap():  # nested: the inner exit leaves the outer freeze alone
        with frozen_heap():
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert kept_ref() is None


class _TimedStep:
    """A read-back step as Engine._account sees one on CUDA: the device's end time of it."""

    is_timed = True
    graphed = True
    eager_reason = None

    def __init__(self, is_prefill: bool, end: float, batch: int = 2):
        self.is_prefill, self.end = is_prefill, end
        self.seqs = [None] * batch
        self.num_new_tokens = self.num_context_tokens = 10 * batch

    def seconds_after(self, earlier: "_TimedStep") -> float:
        return self.end - earlier.end


def test_timed_steps_are_charged_from_the_end_of_the_step_before_not_with_the_next_launch():
    """A decode step read back after the host launched a prefill (eagerly, while that decode
    ran) took 0.011 s on the device, not the 0.036 s its call took: device-timed steps are
    charged from the previous step's end to their own, so the times still add up to the
    job's. A call's first step (no earlier step of that call) keeps its host time."""
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(1000))
    engine = Engine(lm, [], EngineConfig(max_num_seqs=2), keep_step_logs=True)
    engine._last_read = _TimedStep(False, -5.0)  # left by an earlier call: no start for this one
    assert list(engine.generate_tokens(iter([]))) == []
    reads = [(_TimedStep(False, 0.011), 0.012), (_TimedStep(False, 0.022), 0.036),
             (_TimedStep(True, 0.230), 0.190), (_TimedStep(False, 0.241), 0.012)]
    for step, host_seconds in reads:
        engine._account(step, host_seconds)
    decode = [s for _, _, s in engine.stats.decode_step_log]
    assert decode == pytest.approx([0.012, 0.011, 0.011])
    assert [s for _, _, s in engine.stats.prefill_step_log] == pytest.approx([0.208])
    assert engine.stats.decode_seconds == pytest.approx(0.034) and engine.stats.prefill_seconds == pytest.approx(0.208)


def test_the_decode_after_a_prefill_launches_before_the_prefill_is_read_back():
    """The device must not wait for the host between a prefill and the decode after it:
    that decode takes the prefill's tokens from the device, and is launched before the
    prefill's tokens are read (the outputs stay those of the unit-by-unit engine, which
    the tests above check)."""
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(1000))
    rng = random.Random()
    vocab = lm.config.vocab_size
    reqs = [TokenRequest(i, str(i), [rng.randrange(vocab) for _ in range(rng.randint(2, 9))],
                         SamplingOptions(max_tokens=rng.randint(2, 6), ignore_eos=True)) for i in range(6)]
    engine = Engine(lm, [], EngineConfig(max_num_seqs=3))
    order = []
    launch, read_back = engine.runner.launch, engine._read_back

    def logged_launch(seqs, is_prefill, prev=None, before_sampling=None):
        order.append(("launch", is_prefill))
        return launch(seqs, is_prefill, prev, before_sampling)

    def logged_read_back(step):
        order.append(("read", step.is_prefill))
        return read_back(step)
    engine.runner.launch, engine._read_back = logged_launch, logged_read_back
    assert len(list(engine.generate_tokens(reqs))) == 6
    prefills = [i for i, event in enumerate(order) if event == ("launch", True)]
    assert prefills
    for i in prefills:
        read_at = order.index(("read", True), i)
        next_launch = next(j for j in range(i + 1, len(order)) if order[j][0] == "launch")
        assert next_launch < read_at, order  # the next step goes to the device first


def test_launch_seconds_are_the_host_time_of_each_kind_of_launch():
    """prefill_launch_seconds and decode_launch_seconds hold the time the engine's thread
    spent in ModelRunner.launch for prefill and decode steps: here each launch is slowed
    by a known amount, so each total is at least that much a launch."""
    import time

    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(1000))
    rng = random.Random()
    vocab = lm.config.vocab_size
    reqs = [TokenRequest(i, str(i), [rng.randrange(vocab) for _ in range(4)],
                         SamplingOptions(max_tokens=3, ignore_eos=True)) for i in range(4)]
    engine = Engine(lm, [], EngineConfig(max_num_seqs=2))
    launch = engine.runner.launch
    counted = {True: 0, False: 0}

    def slow_launch(seqs, is_prefill, prev=None, before_sampling=None):
        counted[is_prefill] += 1
        time.sleep(0.02 if is_prefill else 0.01)
        return launch(seqs, is_prefill, prev, before_sampling)

    engine.runner.launch = slow_launch
    assert len(list(engine.generate_tokens(reqs))) == 4
    st = engine.stats
    assert counted[True] == st.prefill_steps >= 2 and counted[False] == st.decode_steps >= 2
    assert st.prefill_launch_seconds >= 0.02 * counted[True]
    assert st.decode_launch_seconds >= 0.01 * counted[False]
    assert st.prefill_launch_seconds + st.decode_launch_seconds <= st.elapsed()
    d = st.as_dict()
    assert d["prefill_launch_seconds"] == st.prefill_launch_seconds and d["decode_launch_seconds"] == st.decode_launch_seconds

"""The engine's host side: the background stage that feeds it, and stop strings checked
as tokens arrive (against decoding the whole output every token)."""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest

from relaycli.engine.feed import Feed, Prefetch
from relaycli.engine.stops import StopWatch, first_stop


def test_prefetch_keeps_order_and_runs_on_its_own_thread():
    threads = set()

    def convert(x):
        threads.add(threading.current_thread().name)
        return x * 10

    feed = Prefetch(range(100), convert, depth=7)
    got = []
    while not feed.exhausted:
        got += feed.take(13, wait=True)
    feed.close()
    assert got == [x * 10 for x in range(100)]
    assert threads == {"relay-prefetch"}


def test_prefetch_does_not_wait_when_told_not_to_and_hands_on_a_stage_error_after_its_items():
    gate = threading.Event()

    def rows():
        yield 1
        yield 2
        gate.wait(5)
        raise OSError("the input file went away")

    feed = Prefetch(rows(), lambda x: x, depth=4)
    deadline = time.time() + 5
    got = []
    while len(got) < 2 and time.time() < deadline:
        got += feed.take(10, wait=False)  # never blocks: the third item is not ready
    assert got == [1, 2]
    assert feed.take(10, wait=False) == []
    gate.set()
    with pytest.raises(OSError, match="went away"):
        while True:
            feed.take(10, wait=True)
    feed.close()


def test_a_consumer_that_stops_early_stops_the_stage():
    produced = []

    def rows():
        for i in range(10**6):
            produced.append(i)
            yield i

    feed = Prefetch(rows(), lambda x: x, depth=3)
    assert feed.take(2, wait=True) == [0, 1]
    feed.close()
    n = len(produced)
    time.sleep(0.3)
    assert len(produced) == n < 10


def test_a_plain_feed_takes_from_its_iterator():
    feed = Feed(iter([1, 2, 3]))
    assert feed.take(2, wait=False) == [1, 2]
    assert feed.take(2, wait=False) == [3] and feed.exhausted


@pytest.mark.slow
def test_stop_watch_finds_the_stop_that_a_full_decode_finds(default_model):
    """Random outputs (words, multi-byte characters split across tokens, special tokens):
    the first token at which a stop string shows, and where, as decoding all tokens so far."""
    tok = default_model.tokenizer
    rng = random.Random(0)
    texts = ["Hello world. The end.\n\nNext", "naïve café — déjà vu 😀👍🏽 日本語のテキスト", "a<b>c</b>\n###\nx",
             "Answer: 42\nQuestion: why?", "    indented\n\tcode();\n"]
    vocab = tok.vocab_size
    checked = stopped = 0
    for trial in range(60):
        base = tok.encode(rng.choice(texts) + rng.choice(texts))
        ids = [t if rng.random() < 0.8 else rng.randrange(vocab) for t in base]
        full = tok.decode(ids)
        stops = [full[i:i + rng.randint(1, 4)] for i in (rng.randrange(max(1, len(full))) for _ in range(2))]
        stops = [s for s in stops if s] or ["\n"]
        if trial % 5 == 0:
            stops = ["no such text anywhere"]
        watch = StopWatch(stops, tok.decode)
        expect = next((n for n in range(1, len(ids) + 1) if first_stop(tok.decode(ids[:n]), stops) is not None), None)
        got = next((n for n in range(1, len(ids) + 1) if watch.push(ids, n) is not None), None)
        assert got == expect, (ids, stops)
        if got is not None:
            assert first_stop(watch.text, stops) == first_stop(tok.decode(ids[:got]), stops)
            stopped += 1
        checked += 1
    assert checked == 60 and stopped > 20


def test_compile_log_counts_compiles_and_cache_loads_and_chains_the_listener_before_it():
    knobs = pytest.importorskip("triton.knobs")
    from relaycli.kernels.compile_log import CompileLog
    seen = []
    before = knobs.compilation.listener
    knobs.compilation.listener = lambda **kw: seen.append(kw["cache_hit"])
    try:
        log = CompileLog().install()
        times = knobs.CompileTimes(ir_initialization=200_000, lowering_stages=[("ttir", 1_000_000)], store_results=0)
        for hit in (False, True, False):
            knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=times, cache_hit=hit)
        log.uninstall()
        assert (log.compiled, log.loaded) == (2, 1) and log.compile_seconds == pytest.approx(2.4)
        assert seen == [False, True, False]  # the listener installed before still hears every compile
        assert knobs.compilation.listener is not None and knobs.compilation.listener.__name__ == "<lambda>"
    finally:
        knobs.compilation.listener = before


def test_tritons_cache_key_is_made_beforehand_and_only_for_jobs_that_may_run_triton():
    cache = pytest.importorskip("triton.runtime.cache")
    from pathlib import Path

    from relaycli.config import EngineConfig
    from relaycli.job import JobOptions, uses_triton
    from relaycli.kernels.compile_log import prepare_cache_key
    cache.triton_key.cache_clear()
    prepare_cache_key()
    assert cache.triton_key.cache_info().currsize == 1  # the first launch finds it made
    job = JobOptions(Path("in.jsonl"), Path("out.parquet"), device="cpu")
    assert not uses_triton(job)
    assert not uses_triton(dataclasses.replace(job, device=None, engine=EngineConfig(attention_impl="torch")))


def test_a_caller_of_prepare_cache_key_waits_for_the_thread_making_it_instead_of_hashing_again(monkeypatch):
    import functools
    import threading
    import time

    cache = pytest.importorskip("triton.runtime.cache")
    from relaycli.kernels import compile_log
    made, hashing = [], threading.Event()

    @functools.lru_cache()
    def slow_key():  # Triton's key: a second of hashing, cached once made
        made.append(threading.current_thread().name)
        hashing.set()
        time.sleep(0.3)
        return "key"

    monkeypatch.setattr(cache, "triton_key", slow_key)
    early = threading.Thread(target=compile_log.prepare_cache_key, name="early")
    early.start()
    assert hashing.wait(10)
    compile_log.prepare_cache_key()  # the job, before its engine's first launch
    early.join()
    assert made == ["early"]
    assert not compile_log.start_cache_key("cpu")  # a CPU job runs no Triton kernel
    monkeypatch.setattr(compile_log.os.path, "exists", lambda path: False)
    assert not compile_log.start_cache_key(None)  # no NVIDIA driver here


def test_write_behind_writes_in_order_on_its_thread_and_raises_a_failed_write_on_the_callers():
    from relaycli.io.write_behind import WriteBehind
    written, threads = [], set()

    def write(x):
        threads.add(threading.current_thread().name)
        if x == "boom":
            raise OSError("No space left on device")
        written.append(x)

    behind = WriteBehind(write, depth=4)
    for i in range(50):
        behind.put(i)
    behind.close()
    assert written == list(range(50)) and threads == {"relay-write"}
    behind = WriteBehind(write)
    behind.put("boom")
    with pytest.raises(OSError, match="No space"):
        for i in range(1000):
            behind.put(i)
            time.sleep(0.001)
    behind.close()  # the failure was raised once; what follows it is not written
    assert written == list(range(50))

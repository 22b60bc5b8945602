"""Ray Data: relay's engine as a callable class for `Dataset.map_batches`.

    ds.map_batches(RelayPredictor, fn_constructor_kwargs={"prompts": ["sys.relaykv"], "max_batch": 64},
                   compute=ray.data.ActorPoolStrategy(size=2), num_gpus=1, batch_size=256,
                   batch_format="pyarrow")

Each actor loads the model and the artifacts once. A batch holds request columns (the
fields of a JSONL row: `prompt` or `messages`, `id`, sampling fields...) or one `request`
column of JSON text per row (what `relay run --ray` sends); the answer is a pyarrow table
of relay's output columns plus `row_index`. `__call__` is a coroutine: Ray Data runs
several batches of one actor at once, and they all feed one engine that runs on its own
thread, so its batch stays full across Ray's batches instead of draining at each end.

A row's seed, where it has none, comes from its `row_index` column (as in `relay run`),
else from a hash of its `id`, so answers repeat from run to run. In numpy or pandas
batches NaN means a missing value; `batch_format="pyarrow"` keeps nested fields exact.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import queue
import threading
from collections import Counter

import pyarrow as pa

from relaycli.config import EngineConfig
from relaycli.errors import ConfigError
from relaycli.io.parts import OUTPUT_COLUMNS, OUTPUT_SCHEMA
from relaycli.io.requests import RequestDefaults, ResultRow, parse_request

ANSWER_SCHEMA = pa.schema([pa.field("row_index", pa.int64(), nullable=False), *OUTPUT_SCHEMA])
_ENGINE = {"max_batch": "max_num_seqs", "kv_cache_gb": "kv_cache_gb", "prefix_cache_gb": "prefix_cache_gb",
           "attention_impl": "attention_impl"}
_DEFAULTS = ("max_tokens", "temperature", "top_p", "top_k", "ignore_eos")


def _engine_config(options: dict) -> EngineConfig:
    kwargs = {field: options[name] for name, field in _ENGINE.items() if name in options}
    return EngineConfig(relay=not options.get("no_relay", False), **kwargs)


def _request_defaults(options: dict) -> RequestDefaults:
    kwargs = {name: options[name] for name in _DEFAULTS if name in options}
    return RequestDefaults(seed_base=options.get("seed", 0), **kwargs)


OPTIONS = frozenset({*_ENGINE, *_DEFAULTS, "seed", "no_relay", "dtype", "device", "allow_cast"})


def _rows_of(batch) -> list[dict]:
    if isinstance(batch, pa.Table):
        return batch.to_pylist()
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # a pandas DataFrame
        batch = {name: batch[name] for name in batch.columns}
    columns = {name: list(values.tolist() if hasattr(values, "tolist") else values) for name, values in batch.items()}
    n = len(next(iter(columns.values()), []))
    missing = lambda v: v is None or (isinstance(v, float) and math.isnan(v))  # noqa: E731
    return [{name: values[i] for name, values in columns.items() if not missing(values[i])} for i in range(n)]


def _row_index(row: dict, raw) -> int | None:
    """The row's index: its `row_index`, else a stable number from its `id` (`custom_id`)."""
    if isinstance(row.get("row_index"), int):
        return row["row_index"]
    key = (raw.get("custom_id", raw.get("id")) if isinstance(raw, dict) else None)
    return None if key is None else int(hashlib.sha256(str(key).encode()).hexdigest()[:15], 16)


class _Batch:
    def __init__(self, loop: asyncio.AbstractEventLoop, size: int) -> None:
        self.loop, self.size = loop, size
        self.results: dict[int, ResultRow] = {}
        self.done = loop.create_future()

    def deliver(self, result: ResultRow) -> None:
        self.results[result.row_index] = result
        if len(self.results) == self.size:
            self.loop.call_soon_threadsafe(lambda: self.done.done() or self.done.set_result(None))


class RelayPredictor:
    def __init__(self, model: str | None = None, prompts: list[str] = (), **options) -> None:
        """model: as --model (None: the embedded default); prompts: .relaykv paths; options: relay
        run's options by their names (max_batch, dtype, device, max_tokens, temperature, seed,
        top_p, top_k, kv_cache_gb, prefix_cache_gb, no_relay, attention_impl, allow_cast,
        ignore_eos)."""
        unknown = sorted(set(options) - OPTIONS)
        if unknown:
            raise ConfigError(f"RelayPredictor: unknown option {unknown[0]!r}; use one of {', '.join(sorted(OPTIONS))}")
        from relaycli.compile import load_checked
        from relaycli.engine.engine import Engine
        from relaycli.models.registry import load_model

        self.defaults = _request_defaults(options)
        loaded = load_model(model, options.get("dtype"), options.get("device"))
        artifacts = [load_checked(p, loaded, options.get("allow_cast", False)) for p in prompts]
        self.engine = Engine(loaded, artifacts, _engine_config(options))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[int, _Batch] = {}  # row index -> the batch waiting for its answer
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        threading.Thread(target=self._serve, name="relay-engine", daemon=True).start()

    def _serve(self) -> None:
        """The engine's thread: every batch's rows, one stream, answered as they finish."""
        try:
            for result in self.engine.generate(iter(self._inbox.get, None)):
                with self._lock:
                    batch = self._waiting.pop(result.row_index)
                batch.deliver(result)
        except BaseException as exc:  # noqa: BLE001 - every waiting batch gets it
            with self._lock:
                self._failure = exc
                batches = set(self._waiting.values())
                self._waiting.clear()
            for batch in batches:
                batch.loop.call_soon_threadsafe(lambda b=batch: b.done.done() or b.done.set_exception(exc))

    def _parse(self, row: dict, position: int):
        raw = {k: v for k, v in row.items() if k not in ("row_index", "read_error")}
        if "request" in row:
            try:
                raw = json.loads(row["request"])
            except (TypeError, ValueError):
                raw = None  # parse_request names it
        index = _row_index(row, raw)
        if index is None:
            return ResultRow.failed(position, str(position), f"row {position} of the batch has no id or row_index; "
                                    "add one, so that its answer is the same in every run")
        if row.get("read_error") is not None:
            return ResultRow.failed(index, str(index), row["read_error"])
        return parse_request(raw, index, self.defaults)

    async def __call__(self, batch) -> pa.Table:
        rows = [self._parse(row, i) for i, row in enumerate(_rows_of(batch))]
        order = [row.row_index for row in rows]
        counts = Counter(order)
        loop = asyncio.get_running_loop()
        ready = {r.row_index: r for r in rows if isinstance(r, ResultRow)}
        asked = [r for r in rows if not isinstance(r, ResultRow)]
        waiting = _Batch(loop, len(asked))
        with self._lock:
            if self._failure is not None:
                raise RuntimeError(f"the relay engine of this actor failed: {self._failure}") from self._failure
            for r in asked:
                if r.row_index in self._waiting or counts[r.row_index] > 1:
                    ready[r.row_index] = ResultRow.failed(r.row_index, r.id, f"{r.label}: another row with "
                                                          "this row_index or id is being answered; give each row "
                                                          "its own", r.url)
                    waiting.size -= 1
                else:
                    self._waiting[r.row_index] = waiting
        for r in asked:
            if r.row_index not in ready:
                self._inbox.put(r)
        if waiting.size:
            await waiting.done
        results = {**waiting.results, **ready}
        return answer_table([results[i] for i in order])


def answer_table(results: list[ResultRow]) -> pa.Table:
    rows = [vars(r) for r in results]
    return pa.Table.from_pydict({"row_index": [r["row_index"] for r in rows],
                                 **{name: [r[name] for r in rows] for name in OUTPUT_COLUMNS}}, schema=ANSWER_SCHEMA)

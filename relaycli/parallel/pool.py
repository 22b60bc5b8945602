"""The parent's side of `--devices`: start the workers, deal rows, collect answers.

Each worker keeps at most `window` rows in flight, topped up in chunks of consecutive
rows (rows next to each other often share a prompt or a module path), so its engine
always has a full batch waiting. A worker that stops (killed, out of memory, an error)
has its unanswered rows given to the others; a row that was in flight on two workers
that stopped becomes an error row naming the cause, so one row that kills its worker
cannot take the job down. A worker that holds rows but neither answers one nor finishes
an engine step for `stall_seconds` is hung (a stuck device, a stopped process): it is
killed and counts as stopped. A loading worker silent for `stall_seconds` stops the job
before any row is dealt. When no worker is left the job stops with every finished
answer saved (`--resume` goes on).
"""

from __future__ import annotations

import json
import multiprocessing
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Callable, Iterator

from relaycli.errors import RelayError
from relaycli.io.requests import RequestRow, ResultRow
from relaycli.parallel import worker
from relaycli.parallel.codec import recv, request_message, result_row, send

_RESUME = "the answers finished so far are saved: run the same command with --resume to answer the rest"


class WorkerError(RelayError):
    """The workers could not start, or none is left: one sentence naming the device and cause."""


@dataclass
class Worker:
    index: int
    device: str
    process: multiprocessing.Process
    rows_conn: object  # parent -> worker
    results_conn: object  # worker -> parent
    state: str = "starting"  # starting | ready | done | stopped
    info: dict = field(default_factory=dict)  # its ready message
    failure: str | None = None  # what its failed message said
    cause: str | None = None  # why it stopped
    in_flight: dict[int, dict] = field(default_factory=dict)  # row index -> the request sent
    rows: int = 0
    errors: int = 0
    completion_tokens: int = 0
    stats: dict | None = None  # its engine's counters from its latest beat; its final statistics once done
    samples: dict | None = None  # once done: its engine's TTFT and decode-step values (EngineStats.samples)
    progress_at: float = 0.0  # monotonic time of its last answer or engine step while it held rows

    def report(self) -> dict:
        return {"device": self.device, "pid": self.process.pid, "rows": self.rows, "errors": self.errors,
                "completion_tokens": self.completion_tokens, "state": self.state, "cause": self.cause,
                "stats": self.stats}

    def stopped_because(self) -> str:
        self.process.join(timeout=10)
        code = self.process.exitcode
        if self.failure is not None:
            return self.failure
        if code is not None and code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}" if code is not None else "its pipe closed"


class WorkerPool:
    def __init__(self, devices: list[str], spec: dict, window: int, stall_seconds: float) -> None:
        """spec: what every worker loads (worker.main's spec, less the device)."""
        self.window, self.chunk = window, max(1, min(window // 8, 16))
        self.stall_seconds = stall_seconds
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch or CUDA state
        self.workers: list[Worker] = []
        for index, device in enumerate(devices):
            rows_out, rows_in = ctx.Pipe(duplex=False)
            results_out, results_in = ctx.Pipe(duplex=False)
            text = json.dumps({**spec, "device": device})
            process = ctx.Process(target=worker.main, args=(text, rows_out, results_in), daemon=True,
                                  name=f"relay-worker-{index}")
            process.start()
            rows_out.close()  # the worker holds these ends; a pipe's end closes when its process dies
            results_in.close()
            self.workers.append(Worker(index, device, process, rows_in, results_out))

    def wait_ready(self) -> list[dict]:
        """Every worker's ready message; WorkerError when one cannot load (its refusal as said)
        or sends nothing, not even `loading`, for stall_seconds (a stopped process)."""
        for w in self.workers:
            message = {"type": "loading"}
            while message["type"] == "loading":
                if not w.results_conn.poll(self.stall_seconds):
                    raise WorkerError(f"the worker on {w.device} sent nothing for {self.stall_seconds:g} s while "
                                      "loading the model (hung); check the device and run the job again")
                try:
                    message = recv(w.results_conn)
                except (EOFError, OSError):
                    raise WorkerError(f"the worker on {w.device} stopped while loading the model "
                                      f"({w.stopped_because()}); check the device's memory and the model") from None
            if message["type"] != "ready":
                text = message.get("message", message["type"])
                raise WorkerError(text if message.get("refusal") else f"the worker on {w.device} failed to load "
                                  f"the model ({text})")
            w.state, w.info = "ready", message
        return [w.info for w in self.workers]

    def answer(self, rows: Iterator[RequestRow | ResultRow], emit: Callable[[ResultRow, Worker | None], None]) -> None:
        """Deal every row to the workers; emit(result, worker) each answer (worker None for a
        row that never reached one: an input error, or a row two workers stopped on)."""
        retry: deque[dict] = deque()
        tries: dict[int, int] = {}  # rows that were in flight on a worker that stopped
        rows = iter(rows)
        exhausted = False
        while True:
            alive = [w for w in self.workers if w.state == "ready"]
            if not alive:
                causes = "; ".join(f"{w.device}: {w.cause}" for w in self.workers)
                raise WorkerError(f"every worker stopped ({causes}); {_RESUME}")
            batches: dict[int, list[dict]] = {}
            while retry or not exhausted:  # a chunk at a time to the worker holding the fewest rows
                w = min(alive, key=lambda w: len(w.in_flight))
                room = min(self.window - len(w.in_flight), self.chunk)
                if room < self.chunk and w.in_flight:
                    break
                batch = batches.setdefault(w.index, [])
                if not w.in_flight:
                    w.progress_at = time.monotonic()  # its wait for progress starts with its first row
                for _ in range(room):
                    if retry:
                        message = retry.popleft()
                    else:
                        row = next(rows, None)
                        if row is None:
                            exhausted = True
                            break
                        if isinstance(row, ResultRow):
                            emit(row, None)
                            continue
                        message = request_message(row)
                    batch.append(message)
                    w.in_flight[message["row_index"]] = message
            for index, batch in batches.items():
                if batch:
                    try:
                        send(self.workers[index].rows_conn, {"type": "rows", "rows": batch})
                    except OSError:
                        pass  # it stopped: its results pipe says so, and its rows go to the others
            if exhausted and not retry and not any(w.in_flight for w in alive):
                return
            for w in self._ready(alive):
                self._receive(w, retry, tries, emit)
            for w in alive:
                if w.state == "ready" and w.in_flight and time.monotonic() - w.progress_at > self.stall_seconds:
                    self._stop(w, f"it held {len(w.in_flight)} rows and made no progress for {self.stall_seconds:g} s "
                               "(hung: raise --worker-timeout if one engine step can take that long)")
                    self._lost(w, retry, tries, emit)

    def _ready(self, alive: list[Worker]) -> list[Worker]:
        by_conn = {w.results_conn: w for w in alive}
        return [by_conn[c] for c in wait(list(by_conn), timeout=5.0)]

    def _receive(self, w: Worker, retry: deque, tries: dict, emit) -> None:
        """The messages waiting from w (a bounded number, so dealing stays fresh)."""
        for _ in range(256):
            try:
                message = recv(w.results_conn)
            except (EOFError, OSError):
                self._lost(w, retry, tries, emit)
                return
            kind = message["type"]
            if kind == "result":
                result = result_row(message["row"])
                if w.in_flight.pop(result.row_index, None) is None:
                    raise RuntimeError(f"worker {w.device} answered row {result.row_index}, which it was not given")
                w.rows += 1
                w.errors += result.finish_reason == "error"
                w.completion_tokens += result.completion_tokens
                w.progress_at = time.monotonic()
                emit(result, w)
            elif kind == "beat":
                steps = message["stats"]["prefill_steps"] + message["stats"]["decode_steps"]
                if w.stats is None or steps != w.stats["prefill_steps"] + w.stats["decode_steps"]:
                    w.progress_at = time.monotonic()
                w.stats = message["stats"]
            elif kind == "failed":
                w.failure = message.get("message")
            elif kind == "done":
                w.state, w.stats, w.samples = "done", message.get("stats"), message.get("samples")
            if not w.results_conn.poll():
                return

    def _stop(self, w: Worker, why: str) -> None:
        """Kill a hung worker; why becomes its cause."""
        w.failure = why
        w.process.kill()

    def _lost(self, w: Worker, retry: deque, tries: dict, emit) -> None:
        """w stopped: its rows in flight go to the others, or become error rows on a second stop."""
        w.state, w.cause = "stopped", w.stopped_because()
        again = []
        for index in sorted(w.in_flight):
            message = w.in_flight[index]
            tries[index] = tries.get(index, 0) + 1
            if tries[index] > 1:
                emit(ResultRow.failed(index, message["id"], f"row {index}: two workers stopped while answering it "
                                      f"(the last, on {w.device}: {w.cause}); the row may be what stops them: "
                                      "check it, or answer it alone without --devices", message["url"]), None)
            else:
                again.append(message)
        w.in_flight.clear()
        retry.extendleft(reversed(again))

    def finish(self) -> None:
        """Tell the workers the job is done and collect their statistics."""
        alive = [w for w in self.workers if w.state == "ready"]
        for w in alive:
            try:
                send(w.rows_conn, {"type": "end"})
            except OSError:
                pass
        deadline = time.monotonic() + self.stall_seconds
        while alive := [w for w in alive if w.state == "ready"]:
            for w in self._ready(alive):
                self._receive(w, deque(), {}, lambda *_: None)
            if time.monotonic() > deadline:  # every row is answered: only its statistics are missing
                for w in alive:
                    if w.state == "ready":
                        self._stop(w, f"it did not finish within {self.stall_seconds:g} s of the job's end (hung)")
                        w.state, w.cause = "stopped", w.stopped_because()

    def close(self) -> None:
        """Let the workers that finished exit, stop any still running (the job ended
        early), and release the pipes."""
        for w in self.workers:
            if w.state == "done":
                w.process.join(timeout=30)
        for w in self.workers:
            if w.process.is_alive():
                w.process.terminate()
        for w in self.workers:
            w.process.join(timeout=10)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.rows_conn.close()
            w.results_conn.close()

    def reports(self) -> list[dict]:
        return [w.report() for w in self.workers]

"""One `--devices` worker: a process that loads the model and the artifacts on its device,
answers the rows its parent sends, and sends back their results (codec.py messages).

The engine's input is a stream the parent keeps topped up, so its batches stay full. Every
BEAT_SECONDS a thread sends the engine's counters: the parent sees that the engine still
makes progress (a worker that stops stepping with rows in hand is hung, and is replaced),
and a worker that dies mid-job still leaves its counters in the job's statistics. While
the model loads it sends `loading` instead: a loading worker silent for the parent's stall
time (a stopped process) is hung. The worker ignores Ctrl-C (the terminal sends it to
every process of the job: the parent decides how the job stops) and exits at once when
its parent is gone (a kill -9), so a `--resume` does not find it still holding the device.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
import traceback
from typing import Iterator

from relaycli.parallel.codec import recv, request_row, result_message, send

PARENT_GONE = 3  # the exit status of a worker whose parent died
BEAT_SECONDS = 1.0  # how often a ready worker reports its counters


class _Outbox:
    """The results pipe, shared by the engine's thread and the beat thread: one message at a time."""

    def __init__(self, conn) -> None:
        self._conn, self._lock = conn, threading.Lock()

    def send(self, message: dict) -> None:
        with self._lock:
            send(self._conn, message)


def _beat(outbox: _Outbox, stats, stop: threading.Event) -> None:
    """Every BEAT_SECONDS until stop: the engine's counters, or while the model loads (stats
    None) a `loading` message, which says the process still runs."""
    while not stop.wait(BEAT_SECONDS):
        try:
            outbox.send({"type": "beat", "stats": stats.counters()} if stats is not None else {"type": "loading"})
        except OSError:
            return  # the parent is gone: the inbox thread ends the process


def _beating(outbox: _Outbox, stats) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    thread = threading.Thread(target=_beat, args=(outbox, stats, stop), name="relay-beat", daemon=True)
    thread.start()
    return thread, stop


class _Inbox:
    """Receives the parent's rows on a thread, so the parent's sends never wait for the engine."""

    def __init__(self, conn) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.finished = False  # the job's end was reported: the parent may close the pipe
        threading.Thread(target=self._run, args=(conn,), name="relay-inbox", daemon=True).start()

    def _run(self, conn) -> None:
        while True:
            try:
                message = recv(conn)
            except (EOFError, OSError):
                if not self.finished:
                    os._exit(PARENT_GONE)  # no one is left to take the answers
                return
            if message["type"] == "rows":
                for row in message["rows"]:
                    self._queue.put(row)
            elif message["type"] == "end":
                self._queue.put(None)

    def rows(self) -> Iterator:
        while (message := self._queue.get()) is not None:
            yield request_row(message)


def _load(spec: dict):
    import torch

    from relaycli.compile import load_checked
    from relaycli.config import EngineConfig
    from relaycli.engine.engine import Engine
    from relaycli.models.registry import load_model

    if spec["threads"] is not None:
        torch.set_num_threads(spec["threads"])
    if spec["device"].startswith("cuda:") and torch.cuda.is_available():
        index = int(spec["device"].split(":")[1])
        if index < torch.cuda.device_count():
            torch.cuda.set_device(index)  # kernels, streams and graphs of this process on its GPU
    loaded = load_model(spec["model"], spec["dtype"], spec["device"])
    artifacts = [load_checked(p, loaded, spec["allow_cast"]) for p in spec["prompts"]]
    return Engine(loaded, artifacts, EngineConfig(**spec["engine"])), artifacts


def _ready(engine, artifacts) -> dict:
    from relaycli.artifact import dtype_name
    from relaycli.job import artifact_infos, prompt_records

    run_dtype = dtype_name(engine.loaded.model.dtype)
    return {"type": "ready", "pid": os.getpid(), "device": str(engine.loaded.model.device),
            "model": engine.loaded.reference, "fingerprint": engine.loaded.fingerprint, "dtype": run_dtype,
            "prompts": prompt_records(artifacts), "artifacts": artifact_infos(artifacts, run_dtype),
            "attention": ("relay" if engine.config.relay else "no-relay") + f" ({engine.runner.attention_impl})",
            "load_seconds": engine.loaded.load_seconds, "graphs_available": engine.stats.graphs_available}


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".encode("utf-8", "backslashreplace").decode("utf-8")


def main(spec_text: str, rows_conn, results_conn) -> None:
    """The worker process's entry. spec_text: JSON of relaycli.parallel.job.worker_spec."""
    from relaycli.errors import RelayError

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = json.loads(spec_text)
    outbox = _Outbox(results_conn)
    loading, loaded = _beating(outbox, None)
    try:
        try:
            engine, artifacts = _load(spec)
        finally:
            loaded.set()
            loading.join()  # no `loading` message follows `ready` or `failed`
    except RelayError as exc:
        outbox.send({"type": "failed", "refusal": True, "message": str(exc)})
        return
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which names the worker
        traceback.print_exc()
        outbox.send({"type": "failed", "refusal": False, "message": _failure(exc)})
        raise SystemExit(1)
    inbox = _Inbox(rows_conn)
    try:
        outbox.send(_ready(engine, artifacts))
        engine.stats.started = time.perf_counter()
        _, stop = _beating(outbox, engine.stats)
        for result in engine.generate(inbox.rows()):
            outbox.send({"type": "result", "row": result_message(result)})
        inbox.finished = True
        stop.set()
        outbox.send({"type": "done", "stats": engine.stats.as_dict(), "samples": engine.stats.samples()})
    except (BrokenPipeError, ConnectionResetError):
        os._exit(PARENT_GONE)
    except Exception as exc:  # noqa: BLE001 - the parent gives this worker's rows to the others
        traceback.print_exc()
        try:
            outbox.send({"type": "failed", "refusal": False, "message": _failure(exc)})
        finally:
            os._exit(1)

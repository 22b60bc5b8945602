"""Answers written on a thread behind the engine.

A part's write ends in an fsync, and the answer's bookkeeping is host work: done on the
engine's thread, each stalls the steps. `WriteBehind` hands results to a thread that owns
the writer; the engine's thread only queues them. A write that fails (a full disk, a
vanished folder; the writer raises it as an `OutputError` naming the path, the cause and
the fix) is raised on the engine's thread at its next `put`; `close` writes what
is queued and raises such a failure too, so every answer finished is saved before the
job stops.
"""

from __future__ import annotations

import queue
import threading

_DONE = object()


class WriteBehind:
    def __init__(self, write, depth: int = 8192) -> None:
        """write: the writer's write(result), called on this object's thread in put order."""
        self._write = write
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._error: BaseException | None = None  # a failed write, still to be raised
        self._failed = False  # once a write fails, nothing more is written
        self._thread = threading.Thread(target=self._run, name="relay-write", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if not self._failed:
                try:
                    self._write(item)
                except BaseException as exc:  # noqa: BLE001 - raised on the engine's thread
                    self._error, self._failed = exc, True

    def put(self, result) -> None:
        self._raise()
        self._queue.put(result)

    def close(self) -> None:
        """Write everything queued, stop the thread; raise a write's failure."""
        self._queue.put(_DONE)
        self._thread.join()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

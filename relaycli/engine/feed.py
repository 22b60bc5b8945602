"""Where the engine takes its next requests from: a plain iterator, or a background stage.

The engine's thread should only schedule and launch steps. Reading, validating, rendering
and tokenizing rows is host work of its own, so `Prefetch` runs it on a thread ahead of
the engine, in a bounded queue: the engine takes what is ready and waits only when it
has nothing else to do. The engine's thread releases the GIL while it waits for the
device, so the two overlap. Rows come out in the order they went in.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")
_DONE = object()


class Feed(Generic[T]):
    """The engine's view of its input: take up to n items, waiting for at least one only
    when told to. A plain iterator always waits (its next item is computed on demand)."""

    def __init__(self, items: Iterable[T]) -> None:
        self._it = iter(items)
        self.exhausted = False

    def take(self, n: int, wait: bool) -> list[T]:
        out: list[T] = []
        while len(out) < n and not self.exhausted:
            item = next(self._it, _DONE)
            if item is _DONE:
                self.exhausted = True
            else:
                out.append(item)
        return out

    def close(self) -> None:
        """Stop producing (the consumer is done early); idempotent."""


class Prefetch(Feed[T]):
    """`convert(item)` for every item of `items`, run on a daemon thread at most `depth`
    items ahead. An exception in the stage (an input file that breaks midway) is raised
    from take(), after the items converted before it."""

    def __init__(self, items: Iterable[T], convert: Callable[[object], T], depth: int) -> None:
        super().__init__(())
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(iter(items), convert), name="relay-prefetch",
                                        daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, items: Iterator, convert: Callable) -> None:
        try:
            for raw in items:
                if not self._put(convert(raw)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer's thread
            self._error = exc
        self._put(_DONE)

    @property
    def exhausted(self) -> bool:
        """Every item was taken; a stage error, if any, is still to be raised by take()."""
        return self._finished and self._error is None

    @exhausted.setter
    def exhausted(self, value: bool) -> None:
        self._finished = value

    def take(self, n: int, wait: bool) -> list[T]:
        out: list[T] = []
        while len(out) < n and not self._finished:
            try:
                item = self._queue.get(block=wait and not out)
            except queue.Empty:
                break
            if item is _DONE:
                self._finished = True
            else:
                out.append(item)
        if self._finished and self._error is not None and not out:
            error, self._error = self._error, None
            raise error
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def feed_of(items: Iterable[T] | Feed[T]) -> Feed[T]:
    return items if isinstance(items, Feed) else Feed(items)

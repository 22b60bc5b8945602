"""`relay run` as a child process a test can pause at a chosen moment, fault, and kill.

The child is the real CLI. Two switches, by environment variable, only hold it still
so that a fault (a full disk, a read-only or moved folder, a cut input file) or a kill
lands where the test wants it; the failure itself is the operating system's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq

PRELUDE = r'''
import os, signal, sys, time
# Past a file-size limit a write then fails with EFBIG, as on a full disk, instead of the
# signal killing the process.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
fsize = os.environ.get("RELAY_TEST_FSIZE")
if fsize:
    import resource
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(fsize), resource.RLIM_INFINITY))
parts, go = os.environ.get("RELAY_TEST_PAUSE_PARTS"), os.environ.get("RELAY_TEST_GO")
if parts:  # once a part is saved, the engine's thread waits until the file `go` exists
    from relaycli.io import write_behind
    real_put, paused, queued = write_behind.WriteBehind.put, [], []
    def saved():
        return os.path.isdir(parts) and any(n.startswith("part-") for n in os.listdir(parts))
    def put(self, result):
        real_put(self, result)
        queued.append(1)
        if not paused and len(queued) >= 2:  # a part's rows (the tests' --flush-rows 2) are queued:
            while not saved():  # hold the engine until the writer has saved them, so the job
                time.sleep(0.01)  # cannot end first however slow the writer's thread is
        if not paused and saved():
            paused.append(True)
            print("PAUSED", file=sys.stderr, flush=True)
            while not os.path.exists(go):
                time.sleep(0.01)
    write_behind.WriteBehind.put = put
stop = os.environ.get("RELAY_TEST_STOP_AT")
if stop:  # PHASE:N: wait (to be killed) the N-th time a write reaches PHASE
    phase, nth = stop.split(":")
    seen = {}
    from relaycli.io import writer
    real_write = writer.write_atomically
    def reach(name):
        seen[name] = seen.get(name, 0) + 1
        if name == phase and seen[name] == int(nth):
            print("STOPPED " + name, file=sys.stderr, flush=True)
            time.sleep(600)
    def write_atomically(path, write):
        kind = "part" if path.name.startswith("part-") else "out"
        def written(f):
            write(f)
            f.flush()
            reach(kind + "-tmp")  # the temp file is written, not yet renamed
        real_write(path, written)
        reach(kind + "-renamed")  # in place; for OUT, its parts not yet removed
    writer.write_atomically = write_atomically
from relaycli.cli import entry
entry()
'''
MARKERS = ("PAUSED", "STOPPED")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # the CLI's torch on a small machine: 1 thread is fastest


class Child:
    """A running `relay` child; its stderr is read on a thread, so a test can wait for a marker."""

    def __init__(self, args: list, wrap: list[str] = (), **env: str) -> None:
        """wrap: a command the child is started through (e.g. setpriv)."""
        cmd = [*wrap, sys.executable, "-c", PRELUDE, *map(str, args)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**ENV, **env})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, marker: str, timeout: float = 300.0) -> bool:
        """Whether the child printed a line starting with marker before it ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.startswith(marker) for line in self.lines):
                return True
            if self.proc.poll() is not None:
                self._reader.join(5)
                return any(line.startswith(marker) for line in self.lines)
            time.sleep(0.01)
        raise AssertionError(f"no {marker!r} from the child within {timeout} s; stderr: {self.lines[-5:]}")

    def finish(self, timeout: float = 300.0) -> tuple[int, list[str]]:
        """(exit status, stderr lines other than the markers)."""
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc, [line for line in self.lines if line.strip() and not line.startswith(MARKERS)]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self._reader.join(5)


def run(args: list, **env: str) -> tuple[int, list[str]]:
    return Child(args, **env).finish()


def assert_one_line_error(rc: int, lines: list[str], *fragments: str) -> str:
    """Exit status 2 and one line, 'error: ...', holding every fragment; no traceback."""
    assert rc == 2, (rc, lines)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def saved_rows(out: Path) -> list[dict]:
    """The rows of OUT's saved parts, each part sorted by row, in the order written."""
    parts = sorted(Path(f"{out}.parts").glob("part-*.parquet"))
    return [row for p in parts for row in pq.read_table(p).to_pylist()]

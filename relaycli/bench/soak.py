"""`relay bench soak`: jobs stopped again and again, resumed each time, for as long as asked.

One job (a tiny dummy model that borrows the default model's tokenizer; greedy and sampled
rows, stop strings, varied lengths) is first answered uninterrupted: the reference. Then,
until the time is up, the same job runs into a new output path and is stopped by SIGTERM
(how timeouts, systemd and Slurm stop a job) and every fourth time by SIGKILL, then
started again with `--resume`, until a run finishes. A run is stopped a random pause after
it saves its first answers, never during its start-up, so every run moves its job on
however long relay takes to start. Each finished output must equal the reference row for
row; any difference ends the soak with the row. At the deadline the run in flight is
stopped and the answers its job saved so far are checked against the reference too.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
from rich.table import Table

from relaycli.io.parts import TMP

SYSTEM = "You are a careful assistant. Answer briefly and plainly."
_RELAY = [sys.executable, "-c", "from relaycli.cli import entry; entry()"]
_WORDS = "river stone cloud lamp orange violin harbor pencil meadow engine copper garden".split()
_COLUMNS = ["id", "text", "finish_reason", "completion_tokens", "error"]
_POLL_S = 0.05  # how often a run's parts folder is looked at for its first saved answers
_STOPPED = (-signal.SIGKILL, 128 + signal.SIGTERM, -signal.SIGTERM)  # how a stopped run exits


class SoakError(ValueError):
    """A soak run that failed or answered differently from the reference; names its files."""


class SoakStopped(BaseException):
    """The soak itself got SIGTERM or SIGHUP: it unwinds like Ctrl-C, removing its files."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@dataclass
class SoakOptions:
    minutes: float = 30.0
    rows: int = 400
    # mean seconds a run lives after it saves its first answers; None: a third of the reference's answering time
    pause: float | None = None
    model: str = "dummy:tiny"
    max_batch: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.rows < 1 or (self.pause is not None and self.pause <= 0) or self.max_batch < 1:
            raise ValueError("--minutes and --pause must be positive, --rows and --max-batch at least 1")


def soak_rows(n: int, seed: int) -> list[dict]:
    """Rows of every kind a job meets: greedy, sampled with a seed, with stop strings."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        row = {"id": f"s{i}", "prompt": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 30))),
               "max_tokens": rng.randint(1, 48)}
        if i % 3:
            row.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 31))
        if i % 7 == 0:
            row["stop"] = [rng.choice(_WORDS)[:3]]
        rows.append(row)
    return rows


def _run(args: list[str], env: dict, log: Path, sig: int, deadline: float, stop_after: float | None = None,
         answering: Callable[[], bool] | None = None) -> int:
    """One relay command, stopped with sig stop_after seconds after answering() first
    holds, or at the deadline (time.perf_counter()), unless it ends first. Whatever ends
    the wait early (Ctrl-C, SIGTERM to the soak) kills the run first."""
    with open(log, "ab") as err:
        proc = subprocess.Popen([*_RELAY, *args], stdout=subprocess.DEVNULL, stderr=err, env=env)
        stop_at, timed = deadline, stop_after is None or answering is None  # timed: stop_at is final
        try:
            while True:
                try:
                    return proc.wait(timeout=max(0.0, min(_POLL_S, stop_at - time.perf_counter())))
                except subprocess.TimeoutExpired:
                    pass
                if time.perf_counter() >= stop_at:
                    proc.send_signal(sig)
                    return proc.wait()
                if not timed and answering():
                    stop_at, timed = min(deadline, time.perf_counter() + stop_after), True
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _part_names(out: Path) -> set[str]:
    """The finished parts in OUT.parts: a new name means the run saved answers."""
    parts = out.with_name(out.name + ".parts")
    try:
        return {e.name for e in os.scandir(parts) if e.name.endswith(".parquet") and not e.name.startswith(TMP)}
    except OSError:
        return set()


def _answers(path: Path) -> list[dict]:
    return pq.read_table(path, columns=_COLUMNS).to_pylist()


def _saved(out: Path) -> dict[int, dict]:
    """The answers a stopped job keeps in OUT.parts, by row index: the rows --resume skips.
    A part that cannot be read back whole is left out (--resume answers its rows again)."""
    parts = out.with_name(out.name + ".parts")
    saved: dict[int, dict] = {}
    for path in sorted(parts.glob("*.parquet")) if parts.is_dir() else []:
        if not path.name.startswith(TMP):
            try:
                for row in pq.read_table(path, columns=["row_index", *_COLUMNS]).to_pylist():
                    saved[row.pop("row_index")] = row
            except (pa.ArrowException, OSError):
                continue
    return saved


@contextmanager
def _stoppable() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SoakStopped in the main thread, so the soak's files are
    removed as after Ctrl-C; the handlers in place before are restored after."""
    def stop(signum, _frame):
        for s in (signal.SIGTERM, signal.SIGHUP):  # a second signal must not cut the clean-up short
            signal.signal(s, signal.SIG_IGN)
        raise SoakStopped(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)
                    if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in previous.items():
            if handler is not None:  # None: a handler set from C, which Python cannot restore
                signal.signal(s, handler)


def run_soak(opts: SoakOptions, keep: Path | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """Stop and resume jobs until opts.minutes are up (counted from the call, reference run
    included); the report of what ran. The folder of the runs is removed on every exit
    unless it is `keep`."""
    started = time.perf_counter()
    deadline = started + 60 * opts.minutes
    if keep is not None:
        if keep.exists() or not keep.parent.is_dir():
            raise ValueError(f"--keep {keep}: give a new folder in an existing one")
        keep.mkdir()
    say = progress or (lambda _msg: None)
    with _stoppable():
        folder = Path(tempfile.mkdtemp(prefix="relay-soak-")) if keep is None else keep
        try:
            return _soak(opts, folder, started, deadline, say)
        finally:
            if keep is None:
                shutil.rmtree(folder, ignore_errors=True)


def _soak(opts: SoakOptions, folder: Path, started: float, deadline: float, say: Callable[[str], None]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rng = random.Random(opts.seed)
    log = folder / "stderr.log"
    too_short = "raise --minutes or lower --rows"
    (folder / "sys.txt").write_text(SYSTEM)
    prompt, src = folder / "sys.relaykv", folder / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in soak_rows(opts.rows, opts.seed)))
    rc = _run(["compile-prompt", str(folder / "sys.txt"), "--model", opts.model, "--out", str(prompt), "--quiet"],
              env, log, signal.SIGKILL, deadline)
    if rc in _STOPPED:
        raise SoakError(f"--minutes {opts.minutes:g} ran out while compiling the system prompt: {too_short}")
    if rc:
        raise SoakError(f"relay compile-prompt failed (see {log})")
    flags = ["--in", str(src), "--prompt", str(prompt), "--model", opts.model, "--max-batch", str(opts.max_batch),
             "--flush-rows", "8", "--quiet"]
    ref, stats = folder / "reference.parquet", folder / "reference.stats.json"
    began = time.perf_counter()
    rc = _run(["run", *flags, "--out", str(ref), "--stats-json", str(stats)], env, log, signal.SIGKILL, deadline)
    if rc in _STOPPED:
        raise SoakError(f"--minutes {opts.minutes:g} ran out during the uninterrupted reference run: {too_short}")
    if rc:
        raise SoakError(f"the uninterrupted reference run failed (see {log})")
    reference_s = time.perf_counter() - began
    reference = _answers(ref)
    answering_s = json.loads(stats.read_text())["stats"]["elapsed_seconds"]  # first row in to last answer out
    pause = opts.pause if opts.pause is not None else max(0.2, answering_s / 3)
    say(f"reference run {reference_s:.1f} s ({answering_s:.1f} s answering); runs stopped about {pause:.1f} s "
        "after they save their first answers")
    jobs = stops = kills = 0
    partial = None  # rows the job cut off by the deadline saved (all checked); None: no job was cut off
    statuses: dict[str, int] = {}
    while time.perf_counter() < deadline:
        out = folder / f"job-{jobs}.parquet"
        rc = None
        while time.perf_counter() < deadline:
            kill = (stops + 1) % 4 == 0
            sig = signal.SIGKILL if kill else signal.SIGTERM
            before = _part_names(out)
            rc = _run(["run", *flags, "--out", str(out), "--resume"], env, log, sig, deadline,
                      rng.uniform(0.5, 1.5) * pause, lambda o=out, b=before: bool(_part_names(o) - b))
            statuses[str(rc)] = statuses.get(str(rc), 0) + 1
            if rc == 0:
                break
            if rc not in _STOPPED:
                raise SoakError(f"job {jobs} exited with status {rc} (see {log})")
            stops += 1
            kills += kill
        if rc != 0 and not out.exists():  # the deadline came first: check what this job saved so far
            saved = _saved(out)
            bad = next((i for i, row in sorted(saved.items()) if row != reference[i]), None)
            if bad is not None:
                raise SoakError(f"job {jobs} saved row {bad} differently from the reference (files in {folder})")
            partial = len(saved)
            break
        got = _answers(out)
        if got != reference:
            bad = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), min(len(got), len(reference)))
            raise SoakError(f"job {jobs} differs from the reference at row {bad} (files in {folder})")
        out.unlink()
        jobs += 1
        say(f"{jobs} jobs, {stops} stops, {(time.perf_counter() - started) / 60:.1f} min")
    return {"kind": "soak", "model": opts.model, "rows": opts.rows, "minutes": (time.perf_counter() - started) / 60,
            "minutes_asked": opts.minutes, "reference_s": reference_s, "pause_s": pause,
            "jobs": jobs, "stops": stops, "sigkills": kills, "sigterms": stops - kills, "exit_statuses": statuses,
            "rows_checked": jobs * opts.rows, "unfinished_rows_checked": partial}


def soak_table(report: dict) -> Table:
    """One line: time, jobs, stops and the rows found equal to the uninterrupted run's; the
    caption says how far the job cut off by the deadline got."""
    t = Table(title=f"relay run stopped and resumed ({report['model']}, {report['rows']} rows a job)")
    for name in ("minutes", "jobs", "stops (SIGTERM / SIGKILL)", "rows checked, all as uninterrupted"):
        t.add_column(name, justify="right")
    partial = report.get("unfinished_rows_checked")
    t.add_row(f"{report['minutes']:.1f}", str(report["jobs"]), f"{report['sigterms']} / {report['sigkills']}",
              f"{report['rows_checked'] + (partial or 0):,}")
    if partial is not None:
        t.caption = (f"time up during job {report['jobs'] + 1}: the {partial:,} of its {report['rows']:,} rows "
                     "it had saved are counted, also as uninterrupted")
    return t

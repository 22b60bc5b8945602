"""`relay bench soak`: jobs stopped again and again, resumed each time, for as long as asked.

One job (a tiny dummy model that borrows the default model's tokenizer; greedy and sampled
rows, stop strings, varied lengths) is first answered uninterrupted: the reference. Then,
until the time is up, the same job runs into a new output path and is stopped after a
random pause, by SIGTERM (how timeouts, systemd and Slurm stop a job) and every fourth
time by SIGKILL, then started again with `--resume`, until a run finishes. Each finished
output must equal the reference row for row; any difference ends the soak with the row.
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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq
from rich.table import Table

SYSTEM = "You are a careful assistant. Answer briefly and plainly."
_RELAY = [sys.executable, "-c", "from relaycli.cli import entry; entry()"]
_WORDS = "river stone cloud lamp orange violin harbor pencil meadow engine copper garden".split()


class SoakError(ValueError):
    """A soak run that failed or answered differently from the reference; names its files."""


@dataclass
class SoakOptions:
    minutes: float = 30.0
    rows: int = 400
    pause: float | None = None  # mean seconds a run lives before it is stopped; None: a third of the reference run
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


def _run(args: list[str], env: dict, log: Path, stop_after: float | None, sig: int) -> int:
    """One `relay run`; stopped with sig after stop_after seconds unless it ends first."""
    with open(log, "ab") as err:
        proc = subprocess.Popen([*_RELAY, *args], stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            return proc.wait(timeout=stop_after)
        except subprocess.TimeoutExpired:
            proc.send_signal(sig)
            return proc.wait()


def _answers(path: Path) -> list[dict]:
    return pq.read_table(path, columns=["id", "text", "finish_reason", "completion_tokens", "error"]).to_pylist()


def run_soak(opts: SoakOptions, keep: Path | None = None, progress: Callable[[str], None] | None = None) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="relay-soak-")) if keep is None else keep
    if keep is not None:
        if keep.exists() or not keep.parent.is_dir():
            raise ValueError(f"--keep {keep}: give a new folder in an existing one")
        keep.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rng = random.Random(opts.seed)
    log = folder / "stderr.log"
    try:
        (folder / "sys.txt").write_text(SYSTEM)
        prompt, src = folder / "sys.relaykv", folder / "rows.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in soak_rows(opts.rows, opts.seed)))
        if _run(["compile-prompt", str(folder / "sys.txt"), "--model", opts.model, "--out", str(prompt), "--quiet"],
                env, log, None, 0):
            raise SoakError(f"relay compile-prompt failed (see {log})")
        flags = ["--in", str(src), "--prompt", str(prompt), "--model", opts.model, "--max-batch", str(opts.max_batch),
                 "--flush-rows", "8", "--quiet"]
        started = time.perf_counter()
        ref = folder / "reference.parquet"
        if _run(["run", *flags, "--out", str(ref)], env, log, None, 0):
            raise SoakError(f"the uninterrupted reference run failed (see {log})")
        reference = _answers(ref)
        reference_s = time.perf_counter() - started
        pause = opts.pause if opts.pause is not None else max(1.0, reference_s / 3)
        jobs = stops = kills = 0
        statuses: dict[str, int] = {}
        deadline = started + 60 * opts.minutes
        while time.perf_counter() < deadline:
            out = folder / f"job-{jobs}.parquet"
            for attempt in range(100):
                kill = (stops + 1) % 4 == 0
                sig = signal.SIGKILL if kill else signal.SIGTERM
                rc = _run(["run", *flags, "--out", str(out), "--resume"], env, log,
                          rng.uniform(0.5, 1.5) * pause, sig)
                statuses[str(rc)] = statuses.get(str(rc), 0) + 1
                if rc == 0:
                    break
                if rc not in (-signal.SIGKILL, 128 + signal.SIGTERM, -signal.SIGTERM):
                    raise SoakError(f"job {jobs} exited with status {rc} (see {log})")
                stops += 1
                kills += kill
            else:
                raise SoakError(f"job {jobs} never finished in 100 runs of about {pause:.1f} s: raise --pause")
            got = _answers(out)
            if got != reference:
                bad = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), min(len(got), len(reference)))
                raise SoakError(f"job {jobs} differs from the reference at row {bad} (files in {folder})")
            out.unlink()
            jobs += 1
            if progress is not None:
                progress(f"{jobs} jobs, {stops} stops, {(time.perf_counter() - started) / 60:.1f} min")
        return {"kind": "soak", "model": opts.model, "rows": opts.rows, "minutes": (time.perf_counter() - started) / 60,
                "reference_s": reference_s, "pause_s": pause, "jobs": jobs, "stops": stops, "sigkills": kills, "sigterms": stops - kills,
                "exit_statuses": statuses, "rows_checked": jobs * opts.rows}
    finally:
        if keep is None:
            shutil.rmtree(folder, ignore_errors=True)


def soak_table(report: dict) -> Table:
    t = Table(title=f"relay run stopped and resumed ({report['model']}, {report['rows']} rows a job)")
    for name in ("minutes", "jobs", "stops (SIGTERM / SIGKILL)", "rows checked, all as uninterrupted"):
        t.add_column(name, justify="right")
    t.add_row(f"{report['minutes']:.1f}", str(report["jobs"]), f"{report['sigterms']} / {report['sigkills']}",
              f"{report['rows_checked']:,}")
    return t

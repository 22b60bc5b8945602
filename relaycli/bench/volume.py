"""`relay bench volume`: rows a second and peak memory of `relay run` as a job grows.

Each run is a fresh `relay run` process over N tiny rows (`{"prompt": "hi", "max_tokens":
1}`) behind a short compiled system prompt, greedy, so the host's per-row path (reading,
rendering, tokenizing, admission, writing parts, the final merge) is what is measured,
not the model. Its peak resident memory is the child's own (`os.wait4`'s rusage), so runs
do not see each other's. A job streams: its peak memory must not grow with N.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq
from rich.table import Table

ROW = b'{"prompt": "hi", "max_tokens": 1}\n'
SYSTEM = "You are a terse assistant. Answer in one word."
_RELAY = [sys.executable, "-c", "from relaycli.cli import entry; entry()"]


class VolumeError(ValueError):
    """A `relay run` of the volume bench that failed or answered wrongly; names its files."""


@dataclass
class VolumeOptions:
    rows: list[int] = field(default_factory=lambda: [10_000, 100_000])
    max_batch: int = 256
    model: str = "dummy:tiny"
    threads: int = 1  # torch threads of each relay run (OMP_NUM_THREADS)

    def __post_init__(self) -> None:
        if not self.rows or min(self.rows) < 1:
            raise ValueError(f"--rows takes row counts of at least 1, got {self.rows}")
        if self.max_batch < 1 or self.threads < 1:
            raise ValueError("--max-batch and --threads must be at least 1")


def write_rows(path: Path, n: int) -> None:
    with open(path, "wb") as f:
        for start in range(0, n, 100_000):
            f.write(ROW * min(100_000, n - start))


def run_measured(cmd: list[str], env: dict) -> tuple[int, float, int, str]:
    """(exit status, seconds, peak resident bytes, stderr's tail) of one child process."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not all children's
        seconds = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        tail = err.read()[-2000:].decode("utf-8", "replace")
    return proc.returncode, seconds, usage.ru_maxrss * 1024, tail  # Linux: ru_maxrss in KiB


def one_run(folder: Path, prompt: Path, n: int, opts: VolumeOptions, env: dict) -> dict:
    rows, out, stats = folder / f"rows-{n}.jsonl", folder / f"answers-{n}.parquet", folder / f"stats-{n}.json"
    write_rows(rows, n)
    cmd = [*_RELAY, "run", "--in", str(rows), "--out", str(out), "--prompt", str(prompt), "--model", opts.model,
           "--max-tokens", "1", "--temperature", "0", "--max-batch", str(opts.max_batch), "--quiet",
           "--stats-json", str(stats)]
    rc, seconds, peak, tail = run_measured(cmd, env)
    if rc != 0:
        last = (tail.strip().splitlines() or ["no message"])[-1]
        raise VolumeError(f"relay run over {n} rows (files in {folder}) exited with status {rc}: {last}")
    summary = json.loads(stats.read_text())
    written = pq.ParquetFile(out).metadata.num_rows
    if written != n or summary["error_rows"]:
        raise VolumeError(f"relay run over {n} rows wrote {written} rows, {summary['error_rows']} of them errors "
                          f"(files in {folder})")
    job_s = summary["stats"]["elapsed_seconds"]
    result = {"rows": n, "process_s": seconds, "job_s": job_s, "rows_per_s": n / job_s,
              "process_rows_per_s": n / seconds, "peak_rss_mb": peak / 2**20}
    for p in (rows, out):
        p.unlink()  # a million rows' files need not wait for the next run
    return result


def run_volume(opts: VolumeOptions, keep: Path | None = None,
               progress: Callable[[str], None] | None = None) -> dict:
    """Each row count of opts.rows through its own `relay run`; the report's rows."""
    folder = Path(tempfile.mkdtemp(prefix="relay-volume-")) if keep is None else keep
    if keep is not None:
        if keep.exists() or not keep.parent.is_dir():
            raise ValueError(f"--keep {keep}: give a new folder in an existing one")
        keep.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": str(opts.threads)}
    try:
        (folder / "sys.txt").write_text(SYSTEM)
        prompt = folder / "sys.relaykv"
        rc, _, _, tail = run_measured([*_RELAY, "compile-prompt", str(folder / "sys.txt"), "--model", opts.model,
                                       "--out", str(prompt), "--quiet"], env)
        if rc != 0:
            raise VolumeError(f"relay compile-prompt failed with status {rc}: {tail.strip()[-300:]}")
        rows = []
        for n in opts.rows:
            if progress is not None:
                progress(f"relay run over {n} rows")
            rows.append(one_run(folder, prompt, n, opts, env))
            rows[-1]["rss_vs_first"] = rows[-1]["peak_rss_mb"] / rows[0]["peak_rss_mb"]
    finally:
        if keep is None:
            shutil.rmtree(folder, ignore_errors=True)
    return {"kind": "volume", "model": opts.model, "max_batch": opts.max_batch, "threads": opts.threads,
            "cpu_count": os.cpu_count(), "rows": rows}


def volume_table(report: dict) -> Table:
    t = Table(title=f"relay run over tiny rows ({report['model']}, --max-batch {report['max_batch']}, "
                    f"{report['threads']} torch thread(s))")
    for name in ("rows", "job s", "rows/s (job)", "process s", "peak RSS MiB", "RSS / first"):
        t.add_column(name, justify="right")
    for r in report["rows"]:
        t.add_row(f"{r['rows']:,}", f"{r['job_s']:.1f}", f"{r['rows_per_s']:,.0f}", f"{r['process_s']:.1f}",
                  f"{r['peak_rss_mb']:.0f}", f"{r['rss_vs_first']:.3f}")
    return t

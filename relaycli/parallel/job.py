"""`relay run --devices`: the job of relaycli.job with its rows answered by worker processes.

The parent does everything but the model: the checks, the reader, the validation of each
row, the one writer (parts, `--resume`, the final ordered file) and the progress. The
workers (pool.py) load the model and the artifacts on their devices and send back the
job record's model half (fingerprint, dtype, artifact checksums), which binds the output
as a single-process job would.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from relaycli.engine.stats import EngineStats
from relaycli.io.reader import read_requests
from relaycli.io.requests import ResultRow
from relaycli.io.write_behind import WriteBehind
from relaycli.job import JobOptions, JobSummary, check_inputs, job_record, write_stats
from relaycli.parallel.devices import cpu_threads
from relaycli.parallel.pool import Worker, WorkerError, WorkerPool


def worker_spec(opts: JobOptions) -> dict:
    """What every worker loads, as JSON values (the device is added per worker)."""
    return {"model": opts.model, "dtype": opts.dtype, "prompts": [str(p) for p in opts.prompt_paths],
            "allow_cast": opts.allow_cast, "engine": dataclasses.asdict(opts.engine),
            "threads": cpu_threads(opts.devices)}


def in_flight_window(opts: JobOptions) -> int:
    """Rows a worker holds: what its engine keeps admitted, plus a batch waiting to be admitted."""
    return opts.engine.max_pending_rows + opts.engine.max_num_seqs


def run_parallel_job(opts: JobOptions, on_start: Callable[[int, int], None] | None = None,
                     on_result: Callable[[EngineStats], None] | None = None,
                     on_workers: Callable[[list[dict]], None] | None = None) -> JobSummary:
    source, writer = check_inputs(opts)
    pool = None
    try:
        done = writer.done_row_indices()
        t0 = time.perf_counter()
        pool = WorkerPool(opts.devices, worker_spec(opts), in_flight_window(opts), opts.worker_timeout)
        infos = pool.wait_ready()
        first = infos[0]
        for info in infos[1:]:
            if (info["fingerprint"], info["dtype"], info["prompts"]) != (first["fingerprint"], first["dtype"],
                                                                         first["prompts"]):
                raise WorkerError(f"the workers on {first['device']} and {info['device']} loaded different models "
                                  "or dtypes; give --dtype so every device runs the same one")
        stats = EngineStats(graphs_available=first["graphs_available"])
        summary = JobSummary(
            input_rows=source.num_rows, skipped_rows=len(done), stats=stats, model=first["model"],
            attention=first["attention"], device=", ".join(i["device"] for i in infos), dtype=first["dtype"],
            artifacts=first["artifacts"], load_seconds=time.perf_counter() - t0, output_path=str(opts.output_path))
        ids = (row.id for row in read_requests(source, opts.defaults)) if writer.already_complete else iter(())
        writer.bind_job(job_record(opts, source, first["fingerprint"], first["prompts"], first["dtype"]),
                        source.num_rows, ids)
        if writer.already_complete:
            summary.already_complete, summary.skipped_rows = True, source.num_rows
        else:
            if on_start is not None:
                on_start(source.num_rows, len(done))
            _answer(opts, source, writer, pool, stats, done, on_result, on_workers)
            pool.finish()
            for w in pool.workers:
                if w.stats is not None:  # a worker that stopped: its counters up to its last beat
                    stats.add_counters(w.stats)
                if w.samples is not None:  # the job's TTFT and step quantiles over every worker
                    stats.add_samples(w.samples)
        summary.workers = pool.reports()
        writer.finalize(source.num_rows)
        stats.ended = time.perf_counter()  # the workers' exit (pool.close) is no part of the job
        summary.error_rows = writer.error_rows
    finally:
        try:
            if pool is not None:
                pool.close()
        finally:
            writer.close()
    write_stats(opts, summary)
    return summary


def _answer(opts, source, writer, pool: WorkerPool, stats: EngineStats, done, on_result, on_workers) -> None:
    behind = WriteBehind(writer.write)

    def emit(result: ResultRow, worker: Worker | None) -> None:
        behind.put(result)
        stats.count_result(result)
        if on_result is not None:
            on_result(stats)
        if on_workers is not None:
            on_workers(pool.reports())

    try:
        stats.started = time.perf_counter()
        pool.answer(read_requests(source, opts.defaults, skip=done), emit)
    finally:
        behind.close()  # the answers received are written; a failed write is raised here


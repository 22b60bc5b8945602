"""One `relay run` job: input rows -> engine -> output file, resumable.

Everything that can refuse the job (input, output, model, artifacts) is checked
before any row is computed. Progress goes to an optional callback; nothing prints.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from relaycli.kernels.compile_log import CompileLog, prepare_cache_key
from relaycli.models.registry import LoadedModel, load_model, resolve_device
from relaycli.artifact import dtype_name
from relaycli.compile import load_checked
from relaycli.config import EngineConfig
from relaycli.errors import ConfigError
from relaycli.engine.engine import Engine, EngineStats, frozen_heap
from relaycli.io.parts import write_json
from relaycli.io.reader import RequestSource, open_requests, read_requests
from relaycli.io.requests import RequestDefaults
from relaycli.io.rowset import RowSet
from relaycli.io.write_behind import WriteBehind
from relaycli.io.failures import writing
from relaycli.io.writer import OutputError, ResultWriter, check_writable, same_file


@dataclass
class JobOptions:
    input_path: Path
    output_path: Path
    prompt_paths: list[Path] = field(default_factory=list)
    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    input_format: str | None = None
    output_format: str | None = None
    resume: bool = False
    allow_cast: bool = False
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    engine: EngineConfig = field(default_factory=EngineConfig)
    stats_json: Path | None = None
    flush_rows: int = 256  # answers per saved part: what a crash can cost at most
    # --devices: one worker process per entry (relaycli.parallel); None: this process answers
    devices: list[str] | None = None
    # --devices: a worker holding rows with no answer and no engine step for this long is hung
    worker_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not self.worker_timeout > 0:
            raise ConfigError(f"--worker-timeout must be a positive number of seconds, got {self.worker_timeout}")
        if self.devices is not None:
            from relaycli.parallel.devices import check_devices
            check_devices(self.devices)
            if self.device is not None:
                raise ConfigError("--device and --devices both given; keep --devices (a worker per device)")
        seen: dict[str, Path] = {}
        for p in self.prompt_paths:
            if p.name in seen:
                raise ConfigError(f"--prompt {seen[p.name]} and --prompt {p} have the same file name; rows pick "
                                 "artifacts by name: rename one")
            seen[p.name] = p


@dataclass
class JobSummary:
    input_rows: int
    skipped_rows: int  # answered by an earlier run (--resume)
    stats: EngineStats
    model: str
    attention: str
    device: str
    dtype: str
    artifacts: list[dict]
    load_seconds: float
    already_complete: bool = False
    output_path: str = ""
    error_rows: int = 0  # error rows in the whole output, earlier runs' included
    # start-up work inside the job: Triton kernels compiled (a machine's first run) or loaded
    # from Triton's on-disk cache, and CUDA graphs captured (each a warm-up pass and a capture)
    triton_kernels_compiled: int = 0
    triton_compile_seconds: float = 0.0
    triton_kernels_loaded: int = 0
    triton_compiled_names: dict = field(default_factory=dict)  # kernel name -> variants compiled
    graph_captures: int = 0
    graph_capture_seconds: float = 0.0
    graph_evictions: int = 0  # graphs dropped for newer keys past the engine's bound
    # --devices: per worker {device, pid, rows, errors, completion_tokens, state, cause, stats}
    workers: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["stats"] = self.stats.as_dict()
        if not self.workers:
            del d["workers"]
        return d


def _is_openai_input(source) -> bool:
    """Whether the file holds OpenAI Batch lines, judged by its first readable row, so that
    one unreadable first line does not switch the whole output to relay's row format."""
    for _, raw, _ in source:
        if isinstance(raw, dict):
            return "custom_id" in raw and "body" in raw
    return False


def check_paths(opts: JobOptions) -> None:
    """Files a job would destroy: refused before it opens anything. What the job reads
    (input, artifacts, a model file) must not be what it writes (--out, --stats-json)."""
    reads = [(opts.input_path, "the input file"), *((p, f"the --prompt artifact {p}") for p in opts.prompt_paths)]
    if opts.model is not None and Path(opts.model).is_file():
        reads.append((Path(opts.model), "the --model file"))
    writes = [(opts.output_path, "--out")]
    if opts.stats_json is not None:
        writes.append((opts.stats_json, "--stats-json"))
        if same_file(opts.stats_json, opts.output_path):
            raise OutputError(f"--stats-json {opts.stats_json} is the --out file; give the stats another name")
    for target, flag in writes:
        for source, what in reads:
            if same_file(target, source):
                raise OutputError(f"{flag} {target} is {what}; write to another file name")


def prompt_records(artifacts) -> list[list[str]]:
    """The loaded artifacts as the job record holds them: [name, checksum, dtype] each."""
    return [[a.name, a.meta["checksum"], dtype_name(a.dtype)] for a in artifacts]


def artifact_infos(artifacts, run_dtype: str) -> list[dict]:
    """The loaded artifacts as the summary shows them."""
    return [{"name": a.name, "tokens": a.num_tokens, "cast_from": a.meta["dtype"] if a.meta["dtype"] != run_dtype
             else None} for a in artifacts]


def job_record(opts: JobOptions, source: RequestSource, fingerprint: str, prompts: list, run_dtype: str) -> dict:
    """What the answers depend on, so a resumed run can prove it is the same job."""
    return {"input_sha256": source.content_sha256(), "model_fingerprint": fingerprint, "dtype": run_dtype,
            # sorted: rows pick artifacts by name, so the order of --prompt changes no answer
            "prompts": sorted(list(p) for p in prompts), "defaults": dataclasses.asdict(opts.defaults)}


def _job_record(opts: JobOptions, source: RequestSource, loaded: LoadedModel, artifacts, run_dtype: str) -> dict:
    return job_record(opts, source, loaded.fingerprint, prompt_records(artifacts), run_dtype)


def run_job(opts: JobOptions, on_start: Callable[[int, int], None] | None = None,
            on_result: Callable[[EngineStats], None] | None = None,
            loaded: LoadedModel | None = None,
            on_workers: Callable[[list[dict]], None] | None = None) -> JobSummary:
    """Check the inputs, bind (or resume) the output, answer the rows, finish the output.
    on_start(total_rows, already_done); on_result(stats) after each answered row. With
    opts.devices the rows are answered by worker processes (relaycli.parallel), and
    on_workers(rows) gets each worker's state after each answered row."""
    if opts.devices is not None:
        if loaded is not None:
            raise ConfigError("a loaded model cannot be shared with --devices workers; each loads its own")
        from relaycli.parallel.job import run_parallel_job
        return run_parallel_job(opts, on_start, on_result, on_workers)
    source, writer = check_inputs(opts)
    try:
        engine, summary, done = _bind_output(opts, source, writer, loaded)
        if not summary.already_complete:
            if on_start is not None:
                on_start(source.num_rows, len(done))
            _answer(opts, source, writer, engine, summary, done, on_result)
        writer.finalize(source.num_rows)  # for a complete output: parts a crash left after its rename go
        summary.error_rows = writer.error_rows
    finally:
        writer.close()
    write_stats(opts, summary)
    return summary


def write_stats(opts: JobOptions, summary: JobSummary) -> None:
    if opts.stats_json is not None:
        with writing(Path(opts.stats_json)):
            write_json(opts.stats_json, summary.as_dict())


def check_inputs(opts: JobOptions) -> tuple[RequestSource, ResultWriter]:
    """Everything that can refuse the job from its paths alone, before any model loads."""
    check_paths(opts)
    if opts.stats_json is not None:
        check_writable(Path(opts.stats_json), "--stats-json")
    source = open_requests(opts.input_path, opts.input_format)
    writer = ResultWriter(opts.output_path, opts.output_format, resume=opts.resume,
                          openai_output=_is_openai_input(source), flush_rows=opts.flush_rows,
                          model_name=opts.model or "default")
    return source, writer


def _first_constraints(source: RequestSource, defaults: RequestDefaults, skip: RowSet, rows: int = 64) -> list:
    """The distinct constraints the first rows to answer ask for (their specs). An input
    that breaks among them is reported by the job's own reading, after the rows before it."""
    specs = {}
    try:
        for row in itertools.islice(read_requests(source, defaults, skip=skip), rows):
            spec = getattr(row, "constraint", None)  # error rows have none
            if spec is not None:
                specs.setdefault(spec.key, spec)
    except Exception:  # noqa: BLE001 - see above
        pass
    return list(specs.values())


def uses_triton(opts: JobOptions) -> bool:
    """The job's attention may run Triton kernels: a CUDA device and an impl of auto or triton."""
    return opts.engine.attention_impl in ("auto", "triton") and resolve_device(opts.device).type == "cuda"


def _import_quietly(name: str) -> None:
    try:
        importlib.import_module(name)
    except ImportError:  # a constrained row then becomes an error row naming the fix
        pass


def _bind_output(opts: JobOptions, source: RequestSource, writer: ResultWriter,
                 loaded: LoadedModel | None) -> tuple[Engine, JobSummary, RowSet]:
    """Load the model and the artifacts, make the engine, and bind the output to this job's
    record (a resumed output must belong to the same job)."""
    done = writer.done_row_indices()
    constrained = _first_constraints(source, opts.defaults, done)
    if constrained:  # xgrammar's import (most of its start) runs while the model loads
        threading.Thread(target=_import_quietly, args=("xgrammar",), daemon=True).start()
    triton = uses_triton(opts)
    if loaded is None and triton:  # so does Triton's key, where the command has not begun it
        threading.Thread(target=prepare_cache_key, daemon=True).start()
    threading.Thread(target=writer.warm_up, daemon=True).start()  # and pyarrow's first table
    if loaded is None:
        loaded = load_model(opts.model, opts.dtype, opts.device)
    artifacts = [load_checked(p, loaded, opts.allow_cast) for p in opts.prompt_paths]
    if triton:  # Triton's one-time cache key, made (or being made) since the command began
        prepare_cache_key()
    engine = Engine(loaded, artifacts, opts.engine)
    if constrained and engine.grammars is not None:
        engine.grammars.prepare_in_background(constrained)
    run_dtype = dtype_name(loaded.model.dtype)
    summary = JobSummary(
        input_rows=source.num_rows, skipped_rows=len(done), stats=engine.stats, model=loaded.reference,
        attention=("relay" if opts.engine.relay else "no-relay") + f" ({engine.runner.attention_impl})",
        device=str(loaded.model.device), dtype=run_dtype, artifacts=artifact_infos(artifacts, run_dtype),
        load_seconds=loaded.load_seconds, output_path=str(opts.output_path))
    # The input's ids are read only to check a finished output row by row.
    ids = (row.id for row in read_requests(source, opts.defaults)) if writer.already_complete else iter(())
    writer.bind_job(_job_record(opts, source, loaded, artifacts, run_dtype), source.num_rows, ids)
    if writer.already_complete:
        summary.already_complete, summary.skipped_rows = True, source.num_rows
    return engine, summary, done


def _answer(opts: JobOptions, source: RequestSource, writer: ResultWriter, engine: Engine, summary: JobSummary,
            done: RowSet, on_result: Callable[[EngineStats], None] | None) -> None:
    """The rows not yet answered (done: those an earlier run answered), through the engine;
    their answers are written behind it."""
    rows = read_requests(source, opts.defaults, skip=done)
    compiles = CompileLog().install()
    behind = WriteBehind(writer.write)
    try:
        with frozen_heap():
            engine.stats.started = time.perf_counter()  # after the entry's one collection
            for result in engine.generate(rows):
                behind.put(result)
                if on_result is not None:
                    on_result(engine.stats)
    finally:
        try:
            behind.close()  # the answers queued are written; a failed write is raised here
        finally:
            _count_startup(summary, engine, compiles)


def _count_startup(summary: JobSummary, engine: Engine, compiles: CompileLog) -> None:
    """What the job paid to start: Triton kernels compiled or loaded, CUDA graphs captured."""
    compiles.uninstall()
    summary.triton_kernels_compiled = compiles.compiled
    summary.triton_compile_seconds = compiles.compile_seconds
    summary.triton_kernels_loaded = compiles.loaded
    summary.triton_compiled_names = dict(compiles.compiled_names)
    graphs = engine.runner.graphs
    if graphs is not None:
        summary.graph_captures, summary.graph_capture_seconds = graphs.num_captures, graphs.capture_seconds
        summary.graph_evictions = graphs.num_evicted

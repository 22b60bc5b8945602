"""`relay run --ray`: read -> map -> write on a Ray cluster, for users who do not write Python.

Ray's read tasks read the input in place with relay's reader (`RequestDatasource`: each row
keeps its exact JSON, and an unreadable line becomes the same error row as in a local job);
the driver only plans them. Ray Data deals the rows to `RelayPredictor` actors (one per GPU
of the cluster, or one on the CPU), and the answers are written as a Parquet dataset: a
folder of files, each in input order, with relay's output columns and `row_index`. The
cluster is `RAY_ADDRESS` when set, else a local one.

A job is resumable through Ray Data's checkpointing, keyed on `row_index`: the folder
`.OUT.ray-checkpoint` beside OUT holds the row indexes of the files written so far and the
job's record (input and options); `--resume` skips those rows and answers the rest. A file
written but not yet checkpointed when the job stopped is deleted on resuming, so OUT ends
with every row once. The checkpoint folder is removed when the job completes. On a cluster
of several nodes OUT, and so the checkpoint, must be on storage that every node sees.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from relaycli.errors import ConfigError, RelayError
from relaycli.io.reader import open_requests
from relaycli.io.writer import OutputError
from relaycli.job import JobOptions, check_paths

_RECORD = "job.json"
_PENDING = ".pending.parquet"  # Ray's suffix for a checkpoint of a file not yet known written


def predictor_kwargs(opts: JobOptions) -> dict:
    """RelayPredictor's constructor arguments for the job's options."""
    d, e = opts.defaults, opts.engine
    kwargs = {"model": opts.model, "prompts": [str(Path(p).resolve()) for p in opts.prompt_paths],
              "max_batch": e.max_num_seqs, "kv_cache_gb": e.kv_cache_gb,
              "prefix_cache_gb": e.prefix_cache_gb, "no_relay": not e.relay,
              "attention_impl": e.attention_impl, "allow_cast": opts.allow_cast, "max_tokens": d.max_tokens,
              "temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "seed": d.seed_base,
              "ignore_eos": d.ignore_eos, "dtype": opts.dtype, "device": opts.device}
    return {k: v for k, v in kwargs.items() if v is not None or k in ("max_tokens", "top_k")}


def checkpoint_dir(out: Path) -> Path:
    """Where a --ray job's checkpoint lives: beside OUT, so OUT holds only the answers."""
    return out.parent / f".{out.name}.ray-checkpoint"


def _record(opts: JobOptions, source, kwargs: dict) -> dict:
    """What the answers depend on: a resumed job must have the same."""
    from relaycli.artifact import read_artifact
    # The checksum each artifact's metadata holds (a map and a header read, not the KV bytes);
    # the actors verify it when they load the artifacts.
    prompts = [read_artifact(p, verify_checksum=False).meta["checksum"] for p in opts.prompt_paths]
    record = {"input_sha256": source.content_sha256(), "prompts_sha256": prompts, "predictor": kwargs}
    return json.loads(json.dumps(record))  # as the file holds it


def _bind_output(opts: JobOptions, out: Path, state: Path, record: dict) -> None:
    """Refuse an OUT of another or a finished job; record a new job's checkpoint folder."""
    if not opts.resume:
        if out.exists():
            raise OutputError(f"{out} already exists; add --resume to finish it, or remove it or choose another "
                              "--out (with --ray it is a folder)")
        if state.exists():
            raise OutputError(f"{state} holds the checkpoint of an unfinished --ray job for {out}; add --resume "
                              "to finish it, or remove that folder")
    elif state.exists():
        try:
            earlier = json.loads((state / _RECORD).read_text())
        except (OSError, ValueError):
            earlier = None
        differ = [k for k in record if earlier is None or earlier.get(k) != record[k]]
        if differ:
            what = {"input_sha256": "the input file", "prompts_sha256": "the --prompt artifacts"}.get(
                differ[0], "the options")
            raise ConfigError(f"--resume: {what} differ from the unfinished job in {out}; run it with the same "
                              "ones, or remove OUT and its checkpoint folder to start again")
        return
    elif out.exists():
        raise OutputError(f"{out} holds a finished --ray job (there is no checkpoint {state}); nothing to resume")
    state.mkdir()
    (state / _RECORD).write_text(json.dumps(record, indent=1))


def _checkpointed_rows(ids: Path) -> int:
    """Rows already written by an earlier run: those of the committed checkpoint files."""
    import pyarrow.parquet as pq
    if not ids.is_dir():
        return 0
    return sum(pq.read_metadata(p).num_rows for p in ids.iterdir()
               if p.name.endswith(".parquet") and not p.name.endswith(_PENDING))


def _count(out: Path) -> tuple[int, int]:
    """(rows, error rows) of the dataset, one column read a batch at a time."""
    import pyarrow.compute as pc
    import pyarrow.dataset as pds
    rows = errors = 0
    for batch in pds.dataset(str(out), format="parquet").to_batches(columns=["finish_reason"]):
        rows += batch.num_rows
        errors += pc.sum(pc.equal(batch.column(0), "error")).as_py() or 0
    return rows, errors


def actor_cpus(nodes: list[dict], available: dict, spare: int = 0) -> int:
    """CPUs each predictor actor asks for: a GPU node's CPUs shared among its GPUs (the
    fewest of any GPU node), or on a cluster without GPUs the largest node's, for the one
    actor; never more than the cluster's free CPUs (available) shared among its actors, so
    that CPUs other work holds do not leave the actors waiting; spare CPUs are kept for Ray
    Data's own actors (the checkpoint filter of a resumed job takes one). Ray sets an
    actor's torch threads (OMP_NUM_THREADS) to the CPUs it asks for: at Ray's default of
    one, the engine's host work, and on a CPU its whole forward pass, would use one core."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    gpu_nodes = [r for r in alive if r.get("GPU", 0) >= 1]
    if gpu_nodes:
        share = min(int((r.get("CPU", 0) - spare) // r["GPU"]) for r in gpu_nodes)
        free = int((available.get("CPU", 0) - spare) // max(available.get("GPU", 0), 1))
    else:
        share = max([0, *(int(r.get("CPU", 0)) - spare for r in alive)])
        free = int(available.get("CPU", 0)) - spare
    return max(1, min(share, free))


def relay_cause(exc: BaseException | None) -> RelayError | None:
    """The RelayError that a Ray task or actor raised, from under Ray's wrappers (their
    text holds a traceback; a user gets the one sentence)."""
    from ray.exceptions import RayError
    for _ in range(16):
        if exc is None or (isinstance(exc, RelayError) and not isinstance(exc, RayError)):
            return exc
        exc = getattr(exc, "cause", None) or exc.__cause__
    return None


def run_ray_job(opts: JobOptions, quiet: bool = False) -> dict:
    """Answer every row on Ray; {rows, skipped_rows, error_rows, seconds, rows_per_second,
    output_path, actors}. quiet: without Ray Data's progress bars and execution logs."""
    if opts.devices is not None:
        raise ConfigError("--devices and --ray both given; Ray places one actor per GPU of its cluster: drop one")
    check_paths(opts)
    out = Path(opts.output_path)
    if not out.parent.is_dir():
        raise OutputError(f"the output folder {out.parent} does not exist; create it first")
    started = time.monotonic()
    source = open_requests(Path(opts.input_path).resolve(), opts.input_format)
    kwargs = predictor_kwargs(opts)
    state = checkpoint_dir(out)
    _bind_output(opts, out, state, _record(opts, source, kwargs))
    ids = state / "ids"  # Ray Data's checkpoint: the row ids already written
    skipped = _checkpointed_rows(ids)
    import ray
    from ray.data.checkpoint import CheckpointConfig

    from relaycli.ray import RelayPredictor
    from relaycli.ray_source import RequestDatasource
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR if quiet else logging.INFO)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    ctx = ray.data.DataContext.get_current()
    shown = ("enable_progress_bars", "enable_operator_progress_bars", "print_on_execution_start",
             "enable_auto_log_stats")
    saved = ctx.execution_options.preserve_order, ctx.checkpoint_config, {k: getattr(ctx, k) for k in shown}
    data_log = logging.getLogger("ray.data")
    saved_level = data_log.level
    if quiet:
        for key in shown:
            setattr(ctx, key, False)
        data_log.setLevel(logging.ERROR)  # also its notice that the bars are off
    ctx.execution_options.preserve_order = True  # each file of the dataset holds its rows in input order
    ctx.checkpoint_config = CheckpointConfig(id_column="row_index", checkpoint_path=str(ids.resolve()),
                                             delete_checkpoint_on_success=False)
    try:
        rows_in = RequestDatasource(source, min_blocks=max(gpus, 1))
        filtered = ids.is_dir() and any(ids.iterdir())  # Ray Data then adds its checkpoint filter's actor
        # Reading and writing take no CPU of Ray's count: on a small machine the actors (the
        # predictors, and on resuming Ray's checkpoint filter) would otherwise hold every CPU
        # and the job would wait forever. Ray Data's backpressure still bounds them.
        ds = ray.data.read_datasource(rows_in, num_cpus=0).map_batches(
            RelayPredictor, fn_constructor_kwargs=kwargs, compute=ray.data.ActorPoolStrategy(size=max(gpus, 1)),
            num_gpus=1 if gpus else 0, num_cpus=actor_cpus(ray.nodes(), ray.available_resources(), int(filtered)),
            batch_size=4 * opts.engine.max_num_seqs, batch_format="pyarrow")
        ds.write_parquet(str(out.resolve()), ray_remote_args={"num_cpus": 0})
    except Exception as e:
        cause = relay_cause(e)
        if cause is None:
            raise
        raise cause from None
    finally:
        ctx.execution_options.preserve_order, ctx.checkpoint_config, flags = saved
        for key, value in flags.items():
            setattr(ctx, key, value)
        data_log.setLevel(saved_level)
    out.mkdir(exist_ok=True)  # an input of no rows writes no file
    rows, errors = _count(out)
    if rows != source.num_rows:
        raise OutputError(f"{out} holds {rows} answers for the {source.num_rows} rows of the input; remove it and "
                          f"{state}, and run the job again")
    shutil.rmtree(state)  # the job is complete: OUT holds every row
    seconds = time.monotonic() - started
    return {"rows": rows, "skipped_rows": skipped, "error_rows": errors, "seconds": round(seconds, 3),
            "rows_per_second": round((rows - skipped) / seconds, 3) if seconds > 0 else 0.0,
            "output_path": str(out), "actors": max(gpus, 1)}

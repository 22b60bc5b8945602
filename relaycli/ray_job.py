"""`relay run --ray`: read -> map -> write on a Ray cluster, for users who do not write Python.

relay reads the input on the driver with its own reader (each row keeps its exact JSON,
and an unreadable line becomes the same error row as in a local job), Ray Data deals the
rows to `RelayPredictor` actors (one per GPU of the cluster, or one on the CPU), and the
answers are written as a Parquet dataset: a folder of files in input order, with relay's
output columns and `row_index`. The cluster is `RAY_ADDRESS` when set, else a local one.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from relaycli.errors import ConfigError
from relaycli.io.reader import open_requests
from relaycli.io.writer import OutputError
from relaycli.job import JobOptions, check_paths


def predictor_kwargs(opts: JobOptions) -> dict:
    """RelayPredictor's constructor arguments for the job's options."""
    d, e = opts.defaults, opts.engine
    kwargs = {"model": opts.model, "prompts": [str(Path(p).resolve()) for p in opts.prompt_paths],
              "max_batch": e.max_num_seqs, "kv_cache_gb": e.kv_cache_gb, "no_relay": not e.relay,
              "attention_impl": e.attention_impl, "allow_cast": opts.allow_cast, "max_tokens": d.max_tokens,
              "temperature": d.temperature, "top_p": d.top_p, "top_k": d.top_k, "seed": d.seed_base,
              "ignore_eos": d.ignore_eos, "dtype": opts.dtype, "device": opts.device}
    return {k: v for k, v in kwargs.items() if v is not None or k in ("max_tokens", "top_k")}


def run_ray_job(opts: JobOptions) -> dict:
    """Answer every row on Ray; {rows, error_rows, output_path, actors}."""
    if opts.resume:
        raise ConfigError("--resume does not apply to --ray; Ray Data's checkpointing by the id column resumes "
                          "there (docs/architecture.md, Scale-out)")
    if opts.devices is not None:
        raise ConfigError("--devices and --ray both given; Ray places one actor per GPU of its cluster: drop one")
    check_paths(opts)
    out = Path(opts.output_path)
    if out.exists():
        raise OutputError(f"{out} already exists; remove it or choose another --out (with --ray it is a folder)")
    if not out.parent.is_dir():
        raise OutputError(f"the output folder {out.parent} does not exist; create it first")
    source = open_requests(opts.input_path, opts.input_format)
    items = [{"row_index": i, "request": None if error is not None else json.dumps(raw, default=str),
              "read_error": error} for i, raw, error in source]
    import ray

    from relaycli.ray import RelayPredictor
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False, log_to_driver=False)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the dataset's files hold the rows in input order
    # Few large blocks: an actor runs the batches of one block concurrently, all into one
    # engine, so its batch stays full from one Ray batch to the next.
    blocks = max(max(gpus, 1), math.ceil(len(items) / 4096))
    ds = ray.data.from_items(items, override_num_blocks=blocks).map_batches(
        RelayPredictor, fn_constructor_kwargs=predictor_kwargs(opts), concurrency=max(gpus, 1),
        num_gpus=1 if gpus else 0, batch_size=4 * opts.engine.max_num_seqs, batch_format="pyarrow")
    ds.write_parquet(str(out))
    import pyarrow.dataset as pds
    table = pds.dataset(str(out), format="parquet").to_table(columns=["finish_reason"])
    errors = sum(r == "error" for r in table.column("finish_reason").to_pylist())
    return {"rows": table.num_rows, "error_rows": errors, "output_path": str(out), "actors": max(gpus, 1)}

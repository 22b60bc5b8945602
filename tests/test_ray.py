"""Ray Data on a local 2-CPU cluster: `RelayPredictor` in `map_batches` and `relay run --ray`
give the answers of a local job, error rows included (skipped where ray is not installed)."""

from __future__ import annotations

import asyncio
import json
import re

import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest

from relaycli.config import EngineConfig
from relaycli.errors import ConfigError
from relaycli.io.writer import OutputError
from relaycli.io.requests import RequestDefaults
from relaycli.job import JobOptions, run_job
from tests.helpers_faults import run

ray = pytest.importorskip("ray")
N = 24


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("ray")
    (d / "sys.txt").write_text("You are a test assistant. Answer briefly.")
    rc, lines = run(["compile-prompt", d / "sys.txt", "--model", "dummy:tiny", "--device", "cpu", "--quiet"])
    assert rc == 0, lines
    rows = [{"id": f"r{i}", "prompt": f"tell me about {i}", "max_tokens": 10 + i % 4,
             "temperature": 0 if i % 2 else 0.9} for i in range(N)]
    with open(d / "in.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write("{not json\n")
    opts = _opts(d, d / "ref.parquet", device="cpu")
    run_job(opts)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield d, rows, pq.read_table(d / "ref.parquet").to_pylist()
    ray.shutdown()


def _opts(d, out, **kw) -> JobOptions:
    return JobOptions(input_path=d / "in.jsonl", output_path=out, prompt_paths=[d / "sys.relaykv"], model="dummy:tiny",
                      engine=EngineConfig(max_num_seqs=4), defaults=RequestDefaults(max_tokens=16, seed_base=3), **kw)


def _kwargs(d) -> dict:
    return {"model": "dummy:tiny", "prompts": [str(d / "sys.relaykv")], "max_batch": 4, "device": "cpu",
            "max_tokens": 16, "seed": 3}


def test_relay_predictor_in_map_batches_answers_as_a_local_job(job):
    from relaycli.ray import RelayPredictor
    d, rows, reference = job
    ds = ray.data.from_items([{**r, "row_index": i} for i, r in enumerate(rows)], override_num_blocks=1)
    out = ds.map_batches(RelayPredictor, fn_constructor_kwargs=_kwargs(d), concurrency=1, batch_size=4,
                         batch_format="pyarrow").take_all()
    assert [r["row_index"] for r in out] == list(range(N))
    assert [{k: v for k, v in r.items() if k != "row_index"} for r in out] == reference[:N]


def test_relay_run_ray_writes_the_answers_of_a_local_job(job, tmp_path):
    from relaycli.ray_job import run_ray_job
    d, _, reference = job
    result = run_ray_job(_opts(d, tmp_path / "answers"))
    assert result["rows"] == N + 1 and result["error_rows"] == 1
    table = pds.dataset(tmp_path / "answers", format="parquet").to_table()
    assert table.column("row_index").to_pylist() == list(range(N + 1))  # the dataset keeps input order
    assert table.drop_columns(["row_index"]).to_pylist() == reference  # the unreadable line too
    assert not (tmp_path / ".answers.ray-checkpoint").exists()  # removed once the job is complete
    with pytest.raises(OutputError, match="already exists; add --resume"):
        run_ray_job(_opts(d, tmp_path / "answers"))
    with pytest.raises(OutputError, match="holds a finished --ray job"):
        run_ray_job(_opts(d, tmp_path / "answers", resume=True))


def test_a_predictor_outside_ray_names_bad_rows_and_options(job):
    from relaycli.ray import RelayPredictor
    d, rows, reference = job
    with pytest.raises(ConfigError, match="unknown option 'max_batches'"):
        RelayPredictor("dummy:tiny", max_batches=3)
    predictor = RelayPredictor(**_kwargs(d))
    batch = pa.Table.from_pylist([{**rows[1], "row_index": 1}, {"id": "x", "prompt": "", "row_index": 7}])
    got = asyncio.run(predictor(batch)).to_pylist()
    assert {k: v for k, v in got[0].items() if k != "row_index"} == reference[1]
    assert got[1]["finish_reason"] == "error" and got[1]["error"].startswith("row 7 (id \"x\"): 'prompt' is empty")


HELD_DRIVER = r'''
import asyncio, json, sys
from pathlib import Path
import relaycli.ray
from relaycli.config import EngineConfig
from relaycli.io.requests import RequestDefaults
from relaycli.job import JobOptions
from relaycli.ray_job import run_ray_job

class Held(relaycli.ray.RelayPredictor):
    """Holds the batch of the last row, so the driver's kill lands while rows remain."""
    async def __call__(self, batch):
        if max(batch.column("row_index").to_pylist()) == 24:
            await asyncio.Event().wait()
        return await super().__call__(batch)

relaycli.ray.RelayPredictor = Held
d, out = Path(sys.argv[1]), Path(sys.argv[2])
run_ray_job(JobOptions(input_path=d / "in.jsonl", output_path=out, prompt_paths=[d / "sys.relaykv"],
                       model="dummy:tiny", engine=EngineConfig(max_num_seqs=4),
                       defaults=RequestDefaults(max_tokens=16, seed_base=3)))
'''


def test_relay_run_ray_resumes_after_the_driver_is_killed(job, tmp_path):
    """The driver (a `relay run --ray` process on the cluster) is killed with SIGKILL once
    some answers are written; --resume answers the rest, and OUT holds every row once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from relaycli.ray_job import checkpoint_dir, run_ray_job
    d, _, reference = job
    out = tmp_path / "answers"
    ids = checkpoint_dir(out) / "ids"
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    with open(tmp_path / "driver.log", "wb") as log:
        driver = subprocess.Popen([sys.executable, "-c", HELD_DRIVER, str(d), str(out)], env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
        # The actor's start (a worker process importing torch and loading the model) takes
        # minutes on a loaded 2-core machine: the deadline bounds a hang, not the speed.
        deadline = time.monotonic() + 600
        while not (ids.is_dir() and any(p.name.endswith(".parquet") and ".pending" not in p.name
                                        for p in ids.iterdir())):
            assert driver.poll() is None and time.monotonic() < deadline, (tmp_path / "driver.log").read_text()
            time.sleep(0.02)
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    first = pds.dataset(out, format="parquet").to_table().column("row_index").to_pylist()
    assert 0 < len(set(first)) and N not in first  # some rows written, not the held ones
    with pytest.raises(OutputError, match="add --resume"):
        run_ray_job(_opts(d, out))
    rc, lines = run(["run", "--in", d / "in.jsonl", "--out", out, "--prompt", d / "sys.relaykv", "--model",
                     "dummy:tiny", "--max-batch", "4", "--max-tokens", "16", "--seed", "3", "--ray", "--resume"],
                    COLUMNS="400", **{k: v for k, v in env.items() if k.startswith("RAY")})  # ray.init's token too
    summary = [line for line in lines if line.startswith("wrote ")]
    assert rc == 0 and len(summary) == 1, lines
    assert re.fullmatch(rf"wrote {re.escape(str(out))}/: {N + 1} rows \({len(first)} from an earlier run\), 1 error "
                        r"rows, [\d.]+ s, [\d.]+ rows/s \(1 Ray actor\(s\)\)", summary[0]), summary
    table = pds.dataset(out, format="parquet").to_table().sort_by("row_index")
    assert table.column("row_index").to_pylist() == list(range(N + 1))  # every row once
    assert table.drop_columns(["row_index"]).to_pylist() == reference
    assert not checkpoint_dir(out).exists()


def test_request_datasource_reads_parquet_row_groups_as_relays_reader(job, tmp_path):
    from relaycli.io.reader import open_requests
    from relaycli.ray_source import RequestDatasource
    _, rows, _ = job
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=5)
    source = RequestDatasource(path, min_blocks=3, block_rows=8)
    assert [(s.first_row, s.num_rows) for s in source.read_spans()] == [(0, 10), (10, 10), (20, 4)]
    got = ray.data.read_datasource(source).take_all()
    expected = [{"row_index": i, "request": json.dumps(raw), "read_error": None} for i, raw, _ in open_requests(path)]
    assert sorted(got, key=lambda r: r["row_index"]) == expected


def test_a_read_task_refuses_an_input_changed_after_planning(job, tmp_path):
    from relaycli.io.reader import InputError
    from relaycli.ray_job import relay_cause
    from relaycli.ray_source import RequestDatasource
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    source = RequestDatasource(path)
    with open(path, "a") as f:
        f.write('{"prompt": "added"}\n')
    with pytest.raises(Exception) as caught:
        ray.data.read_datasource(source).take_all()
    cause = relay_cause(caught.value)  # what `relay run --ray` shows: one sentence, no traceback
    assert type(cause) is InputError and str(cause).startswith(f"the input file {path} changed while the job ran")


def test_relay_run_ray_quiet_leaves_out_ray_datas_progress(job, tmp_path):
    import os
    d, _, _ = job
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}  # with the cluster's token
    args = ["run", "--ray", "--in", d / "in.jsonl", "--prompt", d / "sys.relaykv", "--model", "dummy:tiny",
            "--device", "cpu", "--max-batch", "4"]
    rc, loud = run([*args, "--out", tmp_path / "loud"], **env)
    assert rc == 0 and any("Running Dataset" in line for line in loud), loud
    rc, quiet = run([*args, "--out", tmp_path / "quiet", "--quiet"], **env)
    assert rc == 0, quiet
    assert not [line for line in quiet if re.search(r"Running Dataset|Progress|INFO|WARNING", line)], quiet
    assert pds.dataset(tmp_path / "quiet", format="parquet").count_rows() == N + 1


def test_an_actor_asks_for_its_share_of_a_nodes_cpus():
    from relaycli.ray_job import actor_cpus
    node = lambda cpu, gpu=0, alive=True: {"Alive": alive, "Resources": {"CPU": cpu, **({"GPU": gpu} if gpu else {})}}  # noqa: E731
    free = lambda cpu, gpu=0: {"CPU": cpu, **({"GPU": gpu} if gpu else {})}  # noqa: E731
    assert actor_cpus([node(2)], free(2)) == 2  # the one CPU actor: every core, so torch runs that many threads
    assert actor_cpus([node(2)], free(2), spare=1) == 1  # a resumed job's checkpoint filter keeps one
    assert actor_cpus([node(1)], free(1), spare=1) == 1
    assert actor_cpus([node(16, 8), node(64, 8), node(96)], free(176, 16)) == 2  # the fewest of a GPU node's
    assert actor_cpus([node(128, 8)], free(128, 8), spare=1) == 15
    assert actor_cpus([node(8), node(32), node(64, alive=False)], free(40)) == 32
    assert actor_cpus([node(128, 8)], free(40, 8)) == 5  # other work holds CPUs: ask only for free ones
    assert actor_cpus([node(8)], free(0.5)) == 1


def test_the_default_model_on_ray_answers_as_a_local_job(job, default_model, tmp_path):
    """The embedded default model in a Ray actor (`relay run --ray`): the answers of one
    local process, greedy and sampled."""
    from relaycli.compile import compile_prompt
    from relaycli.ray_job import run_ray_job
    compile_prompt(default_model, "You are a support assistant for a small shop. Answer in one sentence.",
                   tmp_path / "sys.relaykv")
    rows = [{"id": f"q{i}", "prompt": f"Which day is refund day number {i}?", "max_tokens": 6,
             "temperature": 0 if i % 2 else 0.8} for i in range(4)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    opts = lambda out: JobOptions(input_path=tmp_path / "in.jsonl", output_path=out,  # noqa: E731
                                  prompt_paths=[tmp_path / "sys.relaykv"], model=None, device="cpu",
                                  engine=EngineConfig(max_num_seqs=4), defaults=RequestDefaults(seed_base=7))
    run_job(opts(tmp_path / "local.parquet"), loaded=default_model)
    result = run_ray_job(opts(tmp_path / "answers"))
    assert result["rows"] == 4 and result["error_rows"] == 0
    table = pds.dataset(tmp_path / "answers", format="parquet").to_table().sort_by("row_index")
    local = pq.read_table(tmp_path / "local.parquet").to_pylist()
    assert table.drop_columns(["row_index"]).to_pylist() == local
    assert all(r["completion_tokens"] > 0 for r in local)

"""`relay bench`: the typer sub-app (the only part of relaycli.bench that prints).

    relay bench kernels [...]   decode attention: relay vs --no-relay vs per-request SDPA
    relay bench e2e [...]       whole engine: relay vs --no-relay vs transformers generate
    relay bench e2e --through-run   the same rows through `relay run`, beside the engine alone
    relay bench volume [...]    rows/s and peak memory of `relay run` as the row count grows
    relay bench soak [...]      a job stopped and resumed again and again; outputs as uninterrupted
    relay bench modules [...]   prompt modules: TTFT against full prefill, independent agreement
    relay bench jobs [PART ...] whole `relay run` jobs on a CUDA machine (relaycli/bench/jobs.py)
    relay bench show FILE ...   the tables of saved results again

`relay bench` alone prints this list (its help); every option belongs to a subcommand.
Options left out take defaults that depend on the device (small on CPU).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

bench_app = typer.Typer(no_args_is_help=True,
                        help="Benchmarks: reproducible comparisons of relay against its baselines; "
                             "pick a subcommand.")
_err = Console(stderr=True)


def _out() -> Console:
    out = Console()
    return out if out.is_terminal else Console(width=200)


def default_e2e(cuda: bool) -> dict:
    """Defaults: a one-minute run on CPU; on CUDA the acceptance model at moderate size."""
    if not cuda:
        return dict(model="dummy:tiny", requests=16, system_tokens=[0, 512, 2048], max_batch=[16],
                    max_output_len=128)
    return dict(model="dummy:llama2-7b", requests=256, system_tokens=[0, 2048, 8192], max_batch=[64],
                hf_requests=64)


def default_kernels(cuda: bool) -> dict:
    """Kernel shapes: the H200 cases of docs/kernels.md on CUDA, seconds-long ones on CPU."""
    if cuda:
        return dict(model="dummy:llama2-7b", system_tokens=[2048, 8192, 16384], batch=[64, 256], own_tokens=128)
    return dict(model="dummy:llama3-8b", system_tokens=[512, 2048], batch=[8, 32], own_tokens=64)


def _ints(text: Optional[str], flag: str) -> Optional[list[int]]:
    if text is None:
        return None
    try:
        values = [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    except ValueError:
        example = "64,256" if flag == "--max-batch" else "0,512,2048"
        raise ValueError(f"{flag} takes comma-separated whole numbers, e.g. {example}; got {text!r}") from None
    if not values:
        raise ValueError(f"{flag} needs at least one value")
    return values


@contextmanager
def _refusals(threads: Optional[int] = None):
    """A bad option or model becomes one red line and exit status 2."""
    try:
        if threads is not None:
            if threads < 1:
                raise ValueError(f"--threads must be at least 1, got {threads}")
            import torch
            torch.set_num_threads(threads)
        yield
    except ValueError as exc:
        _err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2)


def _is_cuda(device: Optional[str]) -> bool:
    from relaycli.models.registry import resolve_device
    return resolve_device(device).type == "cuda"


def _progress(quiet: bool):
    return None if quiet else (lambda msg: _err.print(f"[dim]{escape(msg)}[/dim]", highlight=False, soft_wrap=True))


def _check_outputs(json_path: Optional[Path], plot_path: Optional[Path]) -> None:
    """Before a long run: the output folders exist and matplotlib is there for --plot."""
    import importlib.util
    for path in (json_path, plot_path):
        if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
            raise ValueError(f"the folder of {path} does not exist; create it first")
        if path is not None and Path(path).is_dir():
            raise ValueError(f"{path} is a folder; give a file name")
    if plot_path is not None and Path(plot_path).suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG; name it .png, not {Path(plot_path).name}")
    if plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or relay-batch[plot]); "
                         "or write --json now and draw it later with `relay bench show FILE --plot PNG`")


def _save(reports: list[dict], json_path: Optional[Path], plot_path: Optional[Path], quiet: bool) -> None:
    from relaycli.bench.report import plot_throughput
    from relaycli.io.parts import write_json
    if json_path is not None:
        write_json(json_path, reports[0] if len(reports) == 1 else {"kind": "bench", "reports": reports})
        if not quiet:
            _err.print(f"[green]wrote[/green] {escape(str(json_path))}", highlight=False)
    if plot_path is not None:
        plot_throughput(reports, plot_path)
        if not quiet:
            _err.print(f"[green]wrote[/green] {escape(str(plot_path))}", highlight=False)


def _given(model, workload, requests, system_tokens, max_batch, systems, max_output_len) -> dict:
    """The e2e options given on the command line (None: left to the defaults)."""
    given = dict(model=model, workload=workload, requests=requests,
                 system_tokens=_ints(system_tokens, "--system-tokens"),
                 max_batch=_ints(max_batch, "--max-batch"), max_output_len=max_output_len,
                 systems=[s.strip() for s in systems.split(",") if s.strip()] if systems else None)
    return {k: v for k, v in given.items() if v is not None}


def _e2e(model, workload, requests, system_tokens, max_batch, systems, dtype, device, seed, max_output_len,
         hf_requests, kv_cache_gb, quiet, sampling: dict | None = None, repeats: int = 1) -> dict:
    from relaycli.bench.e2e import E2EOptions, run_e2e
    given = _given(model, workload, requests, system_tokens, max_batch, systems, max_output_len)
    if hf_requests is not None:
        given["hf_requests"] = hf_requests
    opts = {**default_e2e(_is_cuda(device)), **given}
    report = run_e2e(E2EOptions(**opts, dtype=dtype, device=device, seed=seed, kv_cache_gb=kv_cache_gb,
                                repeats=repeats, **(sampling or {})), _progress(quiet))
    _print_e2e(report)
    return report


def _through_run(model, workload, requests, system_tokens, max_batch, systems, dtype, device, seed,
                 max_output_len, hf_requests, kv_cache_gb, quiet, sampling: dict, repeats: int,
                 keep: Optional[Path]) -> dict:
    """The e2e defaults without the transformers peer and without S = 0 (rows need a prompt)."""
    from relaycli.bench.e2e import E2EOptions
    from relaycli.bench.through_run import SYSTEMS, run_through
    defaults = default_e2e(_is_cuda(device))
    defaults.update(system_tokens=[s for s in defaults["system_tokens"] if s > 0], systems=list(SYSTEMS),
                    hf_requests=hf_requests)
    opts = {**defaults, **_given(model, workload, requests, system_tokens, max_batch, systems, max_output_len)}
    report = run_through(E2EOptions(**opts, dtype=dtype, device=device, seed=seed, kv_cache_gb=kv_cache_gb,
                                    repeats=repeats, **sampling), keep, _progress(quiet))
    _print_through_run(report)
    return report


def _print_through_run(report: dict) -> None:
    from relaycli.bench.run_report import host_table, through_run_table
    _out().print(through_run_table(report), host_table(report))


def _print_e2e(report: dict) -> None:
    """The e2e table, the decode steps by batch size, the whole jobs against their floor,
    then the sweep across system-prompt lengths (also kept in the JSON)."""
    from relaycli.bench.report import e2e_table, job_table, steps_table, sweep_summary, sweep_table
    _out().print(e2e_table(report))
    for extra in (steps_table(report), job_table(report)):
        if extra is not None:
            _out().print(extra)
    report["sweep"] = sweep_summary(report)
    sweep = sweep_table(report)
    if sweep is not None:
        _out().print(sweep)


def _kernels(model, system_tokens, max_batch, context, dtype, device, seed, quiet, l2_flush="clean") -> dict:
    from relaycli.bench.kernels import KernelOptions, run_kernels
    from relaycli.bench.report import kernels_table
    given = dict(model=model, system_tokens=_ints(system_tokens, "--system-tokens"),
                 batch=_ints(max_batch, "--max-batch"), own_tokens=context)
    opts = {**default_kernels(_is_cuda(device)), **{k: v for k, v in given.items() if v is not None}}
    report = run_kernels(KernelOptions(**opts, dtype=dtype, device=device, seed=seed, l2_flush=l2_flush),
                         _progress(quiet))
    _out().print(kernels_table(report))
    return report


_JSON = typer.Option(None, "--json", help="Write the results as JSON here.")
_PLOT = typer.Option(None, "--plot", help="Write a PNG plot of throughput against system-prompt length here.")
_DTYPE = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16; default float32 on CPU, bfloat16 on CUDA.")
_DEVICE = typer.Option(None, "--device", help="cpu | cuda | cuda:N; default: cuda when available.")
_SEED = typer.Option(0, "--seed", help="Seed of the workload lengths, token ids and dummy weights.")
_QUIET = typer.Option(False, "--quiet", help="Only the table.")
_THREADS = typer.Option(None, "--threads", help="torch intra-op threads (CPU); default: torch's own choice.")
_SYS = typer.Option(None, "--system-tokens", help="System-prompt lengths, comma-separated, e.g. 0,512,2048,8192,16384.")


@bench_app.command("e2e")
def e2e_cmd(
    model: Optional[str] = typer.Option(None, "--model", help="dummy:PRESET, HF dir, .gguf, default; default: dummy:tiny on CPU, dummy:llama2-7b on CUDA."),
    workload: str = typer.Option("sharegpt", "--workload", help="sharegpt | fixed-IN-OUT (e.g. fixed-128-256, fixed-32-16)."),
    requests: Optional[int] = typer.Option(None, "--requests", help="Requests a run (16 on CPU, 256 on CUDA)."),
    system_tokens: Optional[str] = _SYS,
    max_batch: Optional[str] = typer.Option(None, "--max-batch", help="Batch limits, comma-separated, e.g. 16,64,256."),
    systems: Optional[str] = typer.Option(None, "--systems", help="Any of relay,no-relay,hf (default: all three)."),
    dtype: Optional[str] = _DTYPE,
    device: Optional[str] = _DEVICE,
    seed: int = _SEED,
    max_output_len: Optional[int] = typer.Option(None, "--max-output-len", help="Clip output lengths (default: 128 on CPU, none on CUDA)."),
    hf_requests: Optional[int] = typer.Option(None, "--hf-requests", help="transformers answers only the first N requests (default: 64 on CUDA, all on CPU)."),
    kv_cache_gb: Optional[float] = typer.Option(None, "--kv-cache-gb", help="The engine's paged KV cache size."),
    temperature: float = typer.Option(0.0, "--temperature", help="Every request samples at this temperature (seed: its index); 0: greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus filter of sampled requests (with --temperature)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Top-k filter of sampled requests (with --temperature)."),
    repeats: int = typer.Option(1, "--repeats", help="Runs of each engine system, alternating; rows report the run of median time (transformers runs once)."),
    through_run: bool = typer.Option(False, "--through-run", help="Run the rows as text through `relay run` too, "
                                     "beside the engine alone on the same rows, with the host's per-row costs."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="--through-run: keep its prompts, rows, answers and "
                                        "stats in this new folder (default: deleted)."),
    json_path: Optional[Path] = _JSON,
    plot_path: Optional[Path] = _PLOT,
    threads: Optional[int] = _THREADS,
    quiet: bool = _QUIET,
) -> None:
    """Throughput of relay, --no-relay and transformers' generate on one workload."""
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    with _refusals(threads):
        _check_outputs(json_path, plot_path)
        if keep is not None and not through_run:
            raise ValueError("--keep keeps the files of --through-run; add --through-run or drop --keep")
        if through_run:
            if plot_path is not None:
                raise ValueError("--plot draws engine-only runs; drop --plot with --through-run (use --json)")
            report = _through_run(model, workload, requests, system_tokens, max_batch, systems, dtype, device,
                                  seed, max_output_len, hf_requests, kv_cache_gb, quiet, sampling, repeats, keep)
            _save([report], json_path, None, quiet)
            return
        report = _e2e(model, workload, requests, system_tokens, max_batch, systems, dtype, device, seed,
                      max_output_len, hf_requests, kv_cache_gb, quiet,
                      sampling=sampling, repeats=repeats)
        _save([report], json_path, plot_path, quiet)


@bench_app.command("kernels")
def kernels_cmd(
    model: Optional[str] = typer.Option(None, "--model", help="dummy:PRESET whose head shapes to use (llama3-8b on CPU, llama2-7b on CUDA)."),
    system_tokens: Optional[str] = _SYS,
    max_batch: Optional[str] = typer.Option(None, "--max-batch", help="Batch sizes, comma-separated (8,32 on CPU; 64,256 on CUDA)."),
    context: Optional[int] = typer.Option(None, "--context", help="Own keys per request (64 on CPU, 128 on CUDA)."),
    l2_flush: str = typer.Option("clean", "--l2-flush", help="CUDA: empty the L2 before each timed run by reading "
                                 "a large buffer (clean) or by zeroing one as triton's do_bench does (dirty: the "
                                 "run also pays for writing those lines back)."),
    dtype: Optional[str] = _DTYPE,
    device: Optional[str] = _DEVICE,
    seed: int = _SEED,
    json_path: Optional[Path] = _JSON,
    plot_path: Optional[Path] = _PLOT,
    threads: Optional[int] = _THREADS,
    quiet: bool = _QUIET,
) -> None:
    """Decode attention alone: relay vs the --no-relay baseline vs per-request SDPA."""
    with _refusals(threads):
        _check_outputs(json_path, plot_path)
        report = _kernels(model, system_tokens, max_batch, context, dtype, device, seed, quiet, l2_flush)
        _save([report], json_path, plot_path, quiet)


@bench_app.command("volume")
def volume_cmd(
    rows: str = typer.Option("10000,100000", "--rows", help="Row counts, comma-separated; each is one relay run."),
    max_batch: int = typer.Option(256, "--max-batch", help="Sequences in flight."),
    model: str = typer.Option("dummy:tiny", "--model", help="The model of the runs."),
    threads: int = typer.Option(1, "--threads", help="torch threads of each relay run (OMP_NUM_THREADS)."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="Keep the prompt and stats in this new folder."),
    json_path: Optional[Path] = _JSON,
    quiet: bool = _QUIET,
) -> None:
    """Rows/s and peak memory of `relay run` over N tiny rows: memory must not grow with N."""
    from relaycli.bench.volume import VolumeOptions, run_volume, volume_table
    with _refusals():
        _check_outputs(json_path, None)
        opts = VolumeOptions(rows=_ints(rows, "--rows"), max_batch=max_batch, model=model, threads=threads)
        report = run_volume(opts, keep, _progress(quiet))
        _out().print(volume_table(report))
        _save([report], json_path, None, quiet)


@bench_app.command("soak")
def soak_cmd(
    minutes: float = typer.Option(30.0, "--minutes", help="How long the whole soak runs, its reference run included; "
                                  "at the end the run in flight is stopped and its saved rows checked."),
    rows: int = typer.Option(400, "--rows", help="Rows of the job."),
    pause: Optional[float] = typer.Option(None, "--pause", help="Mean seconds a run lives after it saves its first "
                                          "answers, before it is stopped (default: a third of the uninterrupted "
                                          "run's answering time)."),
    model: str = typer.Option("dummy:tiny", "--model", help="The model of the runs."),
    max_batch: int = typer.Option(16, "--max-batch", help="Sequences in flight."),
    seed: int = typer.Option(0, "--seed", help="Seed of the rows and of the stop times."),
    keep: Optional[Path] = typer.Option(None, "--keep", help="Keep the rows, prompt and logs in this new folder."),
    json_path: Optional[Path] = _JSON,
    quiet: bool = _QUIET,
) -> None:
    """A job stopped and resumed again and again: every output as uninterrupted.

    Stops the job by SIGTERM or SIGKILL and resumes it, for --minutes: every finished output must equal an uninterrupted run's."""
    import signal

    from relaycli.bench.soak import SoakOptions, SoakStopped, run_soak, soak_table
    with _refusals():
        _check_outputs(json_path, None)
        opts = SoakOptions(minutes=minutes, rows=rows, pause=pause, model=model, max_batch=max_batch, seed=seed)
        try:
            report = run_soak(opts, keep, _progress(quiet))
        except (KeyboardInterrupt, SoakStopped) as exc:
            signum = exc.signum if isinstance(exc, SoakStopped) else signal.SIGINT
            files = f"its files are in {keep}" if keep is not None else "its temporary folder is removed"
            _err.print(f"[yellow]stopped ({signal.Signals(signum).name}):[/yellow] the soak ended early; "
                       f"{escape(files)}", highlight=False, soft_wrap=True)
            raise typer.Exit(128 + signum) from None
        _out().print(soak_table(report))
        _save([report], json_path, None, quiet)


# What `relay bench show` prints: each kind with the table its subcommand prints.
_SHOWN = "e2e, e2e --through-run, kernels, volume, soak and modules --json files and the jobs.json of relay bench jobs"


def _read_results(path: Path) -> list[dict]:
    """The reports of one saved file: a --json file (one report or {"kind": "bench",
    "reports": [...]}) or the list of job rows `relay bench jobs` writes."""
    import json
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON ({exc})") from None
    if isinstance(data, list) and data and all(isinstance(r, dict) and "job" in r for r in data):
        return [{"kind": "jobs", "rows": data}]
    found = data.get("reports", [data]) if isinstance(data, dict) else []
    kinds = ("e2e", "kernels", "e2e-through-run", "volume", "soak", "modules", "jobs")
    if not found or any(not isinstance(r, dict) or r.get("kind") not in kinds for r in found):
        raise ValueError(f"{path} is not a relay bench result; relay bench show reads the {_SHOWN}")
    return found


@bench_app.command("show")
def show_cmd(
    paths: list[Path] = typer.Argument(..., help="Files written by relay bench: the --json files of e2e, kernels, "
                                       "volume, soak and modules, and jobs.json of relay bench jobs."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG plot of throughput against "
                                             "system-prompt length here (e2e and kernels results)."),
    json_path: Optional[Path] = _JSON,
) -> None:
    """Print saved results again, each in the table of the subcommand that wrote it.

    E.g. runs made on a GPU machine; e2e runs of one model, dtype and workload are joined (rows of several --system-tokens runs make one line)."""
    from relaycli.bench.report import jobs_table, kernels_table, merge_reports, modules_tables
    with _refusals():
        _check_outputs(json_path, plot_path)
        reports = [rep for path in paths for rep in _read_results(path)]
        reports = merge_reports(reports)
        drawn = [rep["kind"] for rep in reports if rep["kind"] not in ("e2e", "kernels")]
        if plot_path is not None and drawn:
            raise ValueError(f"--plot draws e2e and kernels results; drop --plot for the {drawn[0]} results")
        for rep in reports:
            if rep["kind"] == "e2e":
                _print_e2e(rep)
            elif rep["kind"] == "e2e-through-run":
                _print_through_run(rep)
            elif rep["kind"] == "volume":
                from relaycli.bench.volume import volume_table
                _out().print(volume_table(rep))
            elif rep["kind"] == "soak":
                from relaycli.bench.soak import soak_table
                _out().print(soak_table(rep))
            elif rep["kind"] == "modules":
                _out().print(*modules_tables(rep))
            elif rep["kind"] == "jobs":
                _out().print(jobs_table(rep))
            else:
                _out().print(kernels_table(rep))
        _save(reports, json_path, plot_path, False)


@bench_app.command("modules")
def modules_cmd(
    module_tokens: int = typer.Option(3000, "--module-tokens", help="Tokens of the modules a timed row names (one path of 3)."),
    docs_per_union: int = typer.Option(6, "--docs-per-union", help="Independent agreement: documents per union; pairs = this squared x 3."),
    answer_tokens: int = typer.Option(16, "--answer-tokens", help="Independent agreement: greedy answer tokens a pair."),
    threads: Optional[int] = _THREADS,
    json_path: Optional[Path] = _JSON,
) -> None:
    """Prompt modules: time to first token against full prefill, independent agreement.

    On the default model (fp32, CPU): time to first token with a library vs full prefill of the same tokens; independent modules' teacher-forced greedy agreement."""
    from relaycli.bench.modules import independent_agreement, ttft
    from relaycli.bench.report import modules_tables
    from relaycli.io.parts import write_json
    from relaycli.models.registry import load_model
    with _refusals(threads):
        _check_outputs(json_path, None)
        loaded = load_model(None, "float32", "cpu")
        report = {"kind": "modules", "ttft": ttft(loaded, module_tokens),
                  "independent": independent_agreement(loaded, docs_per_union, answer_tokens)}
        _out().print(*modules_tables(report))
        if json_path is not None:
            write_json(json_path, report)


@bench_app.command("jobs")
def jobs_cmd(
    parts: Optional[list[str]] = typer.Argument(None, help="examples | mixed | cold | modules (default: examples mixed)."),
    out: Path = typer.Option(Path("out"), "--out", help="Folder for jobs.json."),
) -> None:
    """Whole `relay run` jobs on a CUDA GPU, relay against --no-relay.

    Each job runs through the CLI in its own process (relaycli/bench/jobs.py says what each part runs); from a checkout."""
    import json

    from relaycli.bench.jobs import run_parts
    try:
        run_parts(parts or ["examples", "mixed"], out, lambda row: _out().print(json.dumps(row), highlight=False))
    except ValueError as exc:
        _err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None

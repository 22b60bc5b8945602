"""The `relay` command: a thin face over the library (compile, inspect, run)."""

from __future__ import annotations

import errno
import json
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from relaycli import __version__
from relaycli.bench.cli import bench_app

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Batch LLM inference for jobs that share one long system prompt.")
err_console = Console(stderr=True)
app.add_typer(bench_app, name="bench")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"relay {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """relay: compile a system prompt once, then stream request files through it."""


# A disk that cannot take a write is the machine's state, not a defect of relay.
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)


@contextmanager
def _user_errors():
    """Refusals (relaycli.errors.RelayError) become one red line and exit status 2, and so
    does a write the disk refuses wherever it happens (full, over the file-size limit,
    read-only); any other exception is a defect and keeps its traceback."""
    from relaycli.errors import RelayError
    try:
        yield
    except RelayError as exc:
        _error_line(str(exc))
        raise typer.Exit(2)
    except OSError as exc:
        if exc.errno not in _DISK_ERRNOS:
            raise
        where = f"cannot write {exc.filename}" if exc.filename else "a write failed"
        _error_line(f"{where} ({exc.strerror}); free space or write elsewhere, then run the command again "
                    "(relay run: with --resume)")
        raise typer.Exit(2)


def _error_line(message: str) -> None:
    err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False, soft_wrap=True)


class _Stopped(BaseException):
    """SIGTERM or SIGHUP (timeout, systemd, Kubernetes, Slurm): unwinds the job like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def _interruptible(output_path: Path):
    """Ctrl-C, SIGTERM, SIGHUP: unwind, so the writer saves every finished answer; say how to
    go on. Signals after the first are ignored, so they cannot cut that save short."""
    def stop(signum, _frame):
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt if signum == signal.SIGINT else _Stopped(signum)

    # Not where a signal is ignored (nohup ignores SIGHUP, shells ignore SIGINT in background
    # jobs), and only from the main thread, the one that may set handlers.
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, stop) for s in _STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    except (KeyboardInterrupt, _Stopped) as exc:
        signum = exc.signum if isinstance(exc, _Stopped) else signal.SIGINT
        err_console.print(f"[yellow]stopped ({signal.Signals(signum).name}):[/yellow] the answers finished so far "
                          f"are saved next to {escape(str(output_path))}; run the same command with --resume to "
                          "answer the rest", highlight=False)
        raise typer.Exit(128 + signum)
    finally:
        for s, handler in previous.items():
            if handler is not None:  # None: a handler set from C, which Python cannot restore
                signal.signal(s, handler)


@app.command("compile-prompt")
def compile_prompt_cmd(
    sys_txt: List[Path] = typer.Argument(..., help="A system prompt (UTF-8 text) or a prompt-module schema (.pml); several compile with one model load."),
    model: Optional[str] = typer.Option(None, "--model", help="HF model dir, .gguf file, dummy:PRESET; default: the embedded SmolLM2-135M-Instruct."),
    out: Optional[Path] = typer.Option(None, "--out", help="Artifact path (one SYS_TXT only); default: SYS_TXT with suffix .relaykv."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16; default float32 on CPU, bfloat16 on CUDA."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda | cuda:N; default: cuda when available."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress, only errors."),
) -> None:
    """Compile system prompts into .relaykv KV artifacts.

    A .pml schema compiles to a module library (docs/modules.md). Its exact modules (the default) answer as the same tokens sent whole; independent modules (mode="independent", Prompt Cache's way) are computed without seeing each other, so rows combine them freely and their answers differ from a full prefill of the same text."""
    from relaycli.ui import compile_with_progress
    with _user_errors():
        compile_with_progress(sys_txt, model, out, dtype, device, quiet)


@app.command("inspect")
def inspect_cmd(
    path: Path = typer.Argument(..., help="A .relaykv artifact."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Show what an artifact holds and whether its checksum is intact."""
    from relaycli.artifact import ArtifactError
    from relaycli.ui import inspect_artifact
    with _user_errors():
        try:
            info = inspect_artifact(path, as_json)
        except ArtifactError as exc:  # a script reading --json gets the refusal as JSON too (exit 2)
            if as_json:
                typer.echo(json.dumps({"path": str(path), "readable": False, "error": str(exc)}, indent=2))
            raise
    if as_json:
        typer.echo(json.dumps(info, indent=2))
    if not info["checksum_ok"]:
        raise typer.Exit(1)


@app.command("run")
def run_cmd(
    input_path: Path = typer.Option(..., "--in", help="Requests: .jsonl or .parquet (OpenAI Batch lines too)."),
    output_path: Path = typer.Option(..., "--out", help="Answers: .parquet or .jsonl."),
    prompt: List[Path] = typer.Option([], "--prompt", help="A compiled .relaykv artifact (a system prompt or a module library); repeat for several."),
    model: Optional[str] = typer.Option(None, "--model", help="HF model dir, .gguf file, dummy:PRESET; default: embedded SmolLM2-135M-Instruct."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 | bfloat16 | float16."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda | cuda:N."),
    devices: Optional[str] = typer.Option(None, "--devices", help="One worker process per device: cuda:0,cuda:1 | all | cpu,cpu."),
    worker_timeout: float = typer.Option(300.0, "--worker-timeout", help="With --devices: seconds a worker may hold rows with no answer and no engine step (or, while it loads, send nothing) before it counts as hung and its rows go to the others."),
    input_format: Optional[str] = typer.Option(None, "--format", help="Input format if the extension does not say: jsonl | parquet."),
    max_batch: int = typer.Option(64, "--max-batch", help="Sequences in flight."),
    max_tokens: int = typer.Option(256, "--max-tokens", help="Default max_tokens for rows without one."),
    temperature: float = typer.Option(1.0, "--temperature", help="Default temperature for rows without one (0 = greedy)."),
    seed: int = typer.Option(0, "--seed", help="Base of the per-row seeds of rows without one."),
    kv_cache_gb: Optional[float] = typer.Option(None, "--kv-cache-gb", help="KV cache size; default: a share of free memory."),
    prefix_cache_gb: Optional[float] = typer.Option(None, "--prefix-cache-gb", help="Memory for prompt-module paths: unused paths are dropped for room, and rows of a path wait while the paths in use fill it. Default: room for every path of the libraries, grown when the paths in use fill it."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted job: answer only missing rows."),
    no_relay: bool = typer.Option(False, "--no-relay", help="Baseline: per-request attention over the shared prefix."),
    attention_impl: str = typer.Option("auto", "--attention-impl", help="auto | torch | cpu-flash | triton."),
    allow_cast: bool = typer.Option(False, "--allow-cast", help="Accept an artifact of another dtype and convert it."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Generate max_tokens for every row (benchmarks)."),
    stats_json: Optional[Path] = typer.Option(None, "--stats-json", help="Write the job's statistics as JSON here."),
    flush_rows: int = typer.Option(256, "--flush-rows", help="Answers saved per part (also every 10 s); a crash loses at most these."),
    fail_on_error: bool = typer.Option(False, "--fail-on-error", help="Exit 1 when any row became an error row."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress or summary, only errors."),
    use_ray: bool = typer.Option(False, "--ray", help="Run on Ray Data (RAY_ADDRESS or a local cluster); OUT is a Parquet folder."),
) -> None:
    """Answer every request of a file, reusing compiled system prompts."""
    from relaycli.kernels.compile_log import start_cache_key
    if devices is None and not use_ray and attention_impl in ("auto", "triton"):
        start_cache_key(device)  # beside torch's import and the model's load
    from relaycli.config import EngineConfig
    from relaycli.io.requests import RequestDefaults
    from relaycli.job import JobOptions
    from relaycli.ui import run_with_progress
    with _user_errors(), _interruptible(output_path):
        if devices is not None:
            from relaycli.parallel.devices import parse_devices
            devices = parse_devices(devices)
        opts = JobOptions(
            input_path=input_path, output_path=output_path, prompt_paths=list(prompt), model=model,
            dtype=dtype, device=device, input_format=input_format, resume=resume, allow_cast=allow_cast,
            defaults=RequestDefaults(max_tokens=max_tokens, temperature=temperature, seed_base=seed,
                                     ignore_eos=ignore_eos),
            engine=EngineConfig(max_num_seqs=max_batch, kv_cache_gb=kv_cache_gb, prefix_cache_gb=prefix_cache_gb,
                                relay=not no_relay, attention_impl=attention_impl),
            stats_json=stats_json, flush_rows=flush_rows, devices=devices, worker_timeout=worker_timeout)
        if use_ray:
            summary = _run_on_ray(opts, quiet)
        else:
            summary = run_with_progress(opts, quiet)
    if fail_on_error and summary.error_rows:
        err_console.print(f"[red]error:[/red] {summary.error_rows} rows of {escape(str(output_path))} are error rows "
                          "(--fail-on-error)", highlight=False)
        raise typer.Exit(1)


def _run_on_ray(opts, quiet: bool):
    """relay run --ray; the summary's error_rows decide --fail-on-error as for a local job."""
    from types import SimpleNamespace

    from relaycli.errors import ConfigError
    try:
        from relaycli.ray_job import run_ray_job
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("--ray needs Ray Data: pip install 'relay-batch[ray]'") from None
    result = run_ray_job(opts, quiet)
    if opts.stats_json is not None:
        from relaycli.io.parts import write_json
        write_json(opts.stats_json, result)
    if not quiet:
        earlier = f" ({result['skipped_rows']} from an earlier run)" if result["skipped_rows"] else ""
        err_console.print(f"wrote {escape(result['output_path'])}/: {result['rows']} rows{earlier}, "
                          f"{result['error_rows']} error rows, {result['seconds']:.1f} s, "
                          f"{result['rows_per_second']:.2f} rows/s ({result['actors']} Ray actor(s))", highlight=False)
    return SimpleNamespace(error_rows=result["error_rows"])


def entry() -> None:  # pragma: no cover - console-script shim
    app(prog_name="relay")
    sys.exit(0)

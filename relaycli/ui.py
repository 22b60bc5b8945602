"""Terminal output of the CLI: rich progress bars, summary tables, inspect tables."""

from __future__ import annotations

import hashlib
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from relaycli.job import JobOptions, JobSummary, run_job

console = Console(stderr=True)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _is_artifact(path: Path) -> bool:
    """A file compile-prompt may replace: named .relaykv (a damaged one is recompiled
    too), or any name whose content reads as an artifact."""
    from relaycli.artifact import ArtifactError, read_artifact
    if path.suffix.lower() == ".relaykv":
        return True
    try:
        read_artifact(path, verify_checksum=False)
    except ArtifactError:
        return False
    return True


def compile_with_progress(sys_txts: list[Path], model: str | None, out: Path | None, dtype: str | None,
                          device: str | None, quiet: bool) -> None:
    """Every file is checked (readable text, a writable output that is no other file) before
    the model loads once for all of them."""
    from relaycli.models.registry import load_model
    from relaycli.compile import compile_prompt, read_system_text
    from relaycli.module_compile import compile_library
    from relaycli.modules import is_schema_file, read_schema
    from relaycli.io.writer import OutputError, check_writable, same_file

    if out is not None and len(sys_txts) > 1:
        raise OutputError(f"--out names one artifact, and {len(sys_txts)} prompt files were given; leave --out out "
                          "(each file gets its own .relaykv beside it)")
    jobs = []
    for sys_txt in sys_txts:
        target = out or Path(sys_txt).with_suffix(".relaykv")
        check_writable(target)  # its folder exists and takes a file, and it is no folder
        if same_file(sys_txt, target):
            raise OutputError(f"the output path {target} is the system prompt file {sys_txt} itself; "
                              "give another --out (the prompt text would be overwritten)")
        if target.exists() and not _is_artifact(target):
            # Recompiling over an artifact is what users do; over a request file it loses data.
            raise OutputError(f"{target} exists and is not a .relaykv artifact; remove it or choose another --out")
        if any(same_file(target, t) for _, t, _ in jobs):
            raise OutputError(f"two prompt files would both be compiled to {target}; rename one")
        # a schema (prompt modules) is parsed here: a malformed one is refused before the model loads
        jobs.append((sys_txt, target, read_schema(sys_txt) if is_schema_file(sys_txt) else read_system_text(sys_txt)))
    loaded = load_model(model, dtype, device)
    for sys_txt, target, text in jobs:
        with Progress(TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                      TimeElapsedColumn(), console=console, disable=quiet, transient=True) as bar:
            task = bar.add_task("compile", total=None)
            compile_fn = compile_prompt if isinstance(text, str) else compile_library
            result = compile_fn(loaded, text, target, progress=lambda done, total: bar.update(
                task, completed=done, total=total))
        if not quiet:
            console.print(f"[green]wrote[/green] {escape(str(result.path))}: {result.num_tokens} tokens, "
                          f"{_human_bytes(result.num_bytes)}, {result.seconds:.2f} s "
                          f"(model {escape(loaded.reference)}, {str(loaded.model.dtype).replace('torch.', '')})",
                          highlight=False)


def inspect_artifact(path: Path, as_json: bool) -> dict:
    from relaycli.artifact import ChecksumError, read_artifact
    checksum_ok, problem = True, None
    try:
        art = read_artifact(path)
    except ChecksumError as exc:  # still readable: show what it holds, flagged (exit 1)
        checksum_ok, problem = False, str(exc)
        art = read_artifact(path, verify_checksum=False)
    meta = art.meta
    info = {
        "path": str(path), "readable": True, "format_version": meta["format_version"],
        "relay_version": meta["relay_version"],
        "model": meta["model_reference"], "model_fingerprint": meta["model_fingerprint"],
        "tokens": art.num_tokens, "dtype": meta["dtype"], "layers": meta["num_layers"],
        "kv_heads": meta["num_kv_heads"], "head_dim": meta["head_dim"], "rope": meta["rope"],
        "size_bytes": Path(path).stat().st_size, "checksum": meta["checksum"], "checksum_ok": checksum_ok,
        "meta_checksum": meta.get("meta_checksum"), "checksum_problem": problem,
        "segments": meta["segments"],
        "schema": meta.get("schema"),  # a prompt-module library's: name, mode, next_position
        "text_sha256": hashlib.sha256(meta["system_text"].encode()).hexdigest(),
        "text_start": meta["system_text"][:200],
    }
    if not as_json:
        # Every value shown comes from the file: escaped, so "[/INST]" in a prompt is text, not markup.
        table = Table(title=escape(str(path)), show_header=False)
        modules = meta["segments"][1:] if info["schema"] is not None else []
        for key in ("model", "tokens", "dtype", "layers", "kv_heads", "head_dim", "format_version",
                    "relay_version"):
            value = str(info[key])
            if key == "tokens" and modules:
                value += f" (system) + {sum(m['end'] - m['start'] for m in modules)} in {len(modules)} modules"
            table.add_row(key, escape(value))
        table.add_row("size", _human_bytes(info["size_bytes"]))
        if modules:
            table.add_row("schema", escape(f"{info['schema']['name']} ({info['schema']['mode']})"))
        table.add_row("checksum", ("[green]ok[/green] " if checksum_ok else "[red]MISMATCH[/red] ")
                      + escape(meta["checksum"][:23]))
        if problem:
            table.add_row("problem", escape(problem))
        table.add_row("text", escape(info["text_start"][:120].replace("\n", " "))
                      + ("…" if len(meta["system_text"]) > 120 else ""))
        Console().print(table)
        if modules:
            Console().print(_modules_table(modules, _kv_bytes_per_token(art)))
    return info


def _kv_bytes_per_token(art) -> int:
    """Bytes of K and V one token takes in every layer of an artifact (one row of each tensor)."""
    return sum(t[0].nbytes for t in (*art.keys, *art.values))


def _modules_table(modules: list[dict], per_token: int) -> Table:
    """A library's modules: tokens, positions, what each was computed right after (its
    parent, or the system prompt), its union, its parameters and the bytes of its KV."""
    table = Table(title="modules")
    for column in ("module", "tokens", "positions", "after", "union", "parameters", "KV"):
        table.add_column(column, justify="right" if column in ("tokens", "KV") else "left", overflow="fold")
    for m in modules:
        tokens = m["end"] - m["start"]
        params = ", ".join(f"{r['parameter']} (<= {r['len']})" for r in m["rest"] if "parameter" in r)
        table.add_row(escape(m["name"]), str(tokens), f"{m['position']}-{m['position'] + tokens - 1}",
                      escape(m["after"][-1]), "" if m["union"] is None else str(m["union"]),
                      escape(params), _human_bytes(tokens * per_token))
    return table


def run_with_progress(opts: JobOptions, quiet: bool) -> JobSummary:
    columns = (TextColumn("[bold]rows"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tps]}"),
               TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn())
    if opts.devices is not None:  # each worker's answered rows
        columns += (TextColumn("{task.fields[workers]}"),)
    # The bar appears only once every check has passed (on_start): a job refused at the
    # start prints its one error line and no empty bar. Until then a transient spinner.
    bar = Progress(*columns, console=console, disable=quiet, transient=False)
    task = bar.add_task("rows", total=None, tps="", workers="")
    status = None if quiet else console.status("checking the inputs and loading the model")

    def on_start(total: int, done: int) -> None:
        if status is not None:
            status.stop()
        bar.update(task, total=total, completed=done)
        bar.start()

    def on_result(stats) -> None:
        bar.update(task, advance=1, tps=f"{stats.generated_tokens_per_second():.1f} tok/s")

    def on_workers(reports) -> None:
        bar.update(task, workers=" · ".join(_worker_cell(r) for r in reports))

    if status is not None:
        status.start()
    try:
        summary = run_job(opts, on_start, on_result, on_workers=on_workers if opts.devices is not None else None)
    finally:
        if status is not None:
            status.stop()
        if bar.live.is_started:  # on_start ran
            bar.stop()
    if not quiet:
        print_summary(summary)
    return summary


def _worker_cell(report: dict) -> str:
    cell = f"{report['device']} {report['rows']}"
    return cell if report["state"] != "stopped" else f"{cell} (stopped)"


def _workers_rows(s: JobSummary) -> list[tuple[str, str]]:
    rows = []
    for i, w in enumerate(s.workers):
        st = w["stats"] or {}
        what = f"{w['rows']} rows, {w['completion_tokens']} generated tokens"
        if st.get("elapsed_seconds"):
            what += f", {w['completion_tokens'] / st['elapsed_seconds']:.1f} tok/s"
        if w["state"] == "stopped":
            what += f"; stopped: {escape(str(w['cause']))} (its unanswered rows went to the others)"
        rows.append((f"worker {i} ({w['device']})", what))
    return rows


def print_summary(s: JobSummary) -> None:
    if s.already_complete:
        console.print(f"{escape(s.output_path)} is already complete ({s.input_rows} rows, {s.error_rows} error rows); "
                      "nothing to do", highlight=False)
        return
    d = s.stats.as_dict()
    for art in s.artifacts:
        if art["cast_from"]:
            console.print(f"[yellow]note:[/yellow] {escape(art['name'])} was cast from {art['cast_from']} to "
                          f"{s.dtype} "
                          "(--allow-cast); outputs may differ from a matching artifact")
    table = Table(title=f"relay run: {escape(s.output_path)}", show_header=False)
    rows = [
        ("rows", f"{s.input_rows} ({s.skipped_rows} from an earlier run)" if s.skipped_rows else str(s.input_rows)),
        ("errors", f"{s.error_rows} ({d['errors']} in this run)" if s.skipped_rows else str(d["errors"])),
        ("prefix hits / misses", f"{d['prefix_hits']} / {d['prefix_misses']}"),
        ("prompt / cached / generated tokens", f"{d['prompt_tokens']} / {d['cached_tokens']} / {d['completion_tokens']}"),
        ("throughput", f"{d['generated_tokens_per_second']:.1f} generated tok/s, {d['rows_per_second']:.2f} rows/s"),
        ("time", f"{d['elapsed_seconds']:.1f} s (model load {s.load_seconds:.1f} s)"),
        ("model", f"{escape(s.model)} · {s.dtype} · {s.device} · {s.attention}"),
    ]
    if d["graphs_available"] and d["decode_steps"]:
        rows.insert(5, ("decode steps", f"{d['decode_steps']} ({d['graphed_decode_steps']} as CUDA graphs)"))
    if d["module_paths_built"]:
        dropped = d["module_paths_dropped"]
        rows.insert(3, ("module paths", f"{d['module_paths_built']} loaded" + (
            f", {dropped} dropped for room (rows sorted by module load each path once)" if dropped else "")))
    if s.triton_kernels_compiled or s.graph_captures:
        rows.insert(-1, ("start-up in the job", f"{s.triton_kernels_compiled} Triton kernels compiled in "
                         f"{s.triton_compile_seconds:.1f} s ({s.triton_kernels_loaded} from Triton's cache), "
                         f"{s.graph_captures} CUDA graphs captured in {s.graph_capture_seconds:.1f} s"
                         + (f" ({s.graph_evictions} dropped for newer ones)" if s.graph_evictions else "")))
    for k, v in rows + _workers_rows(s):
        table.add_row(k, v)
    console.print(table)
    eager = d["eager_decode_steps"]
    if d["graphs_available"] and eager > 0.05 * max(d["decode_steps"], 1):
        why = "; ".join(f"{reason}: {count}" for reason, count in sorted(d["eager_reasons"].items(),
                                                                          key=lambda kv: -kv[1]))
        console.print(f"[yellow]warning:[/yellow] {eager} of {d['decode_steps']} decode steps ran without a CUDA "
                      f"graph, several times slower ({escape(why) or 'no reason recorded'})", highlight=False)

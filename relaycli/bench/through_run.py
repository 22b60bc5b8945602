"""`relay bench e2e --through-run`: the workload through `relay run`, beside the engine alone.

`relay bench e2e` feeds token ids to the engine after a warm-up; users run `relay run`
(JSONL in, Parquet out), which also reads, parses, renders and tokenizes every row and
pays its start-up inside the job. Here, for each system-prompt length S, a system text
whose compiled prefix has S tokens and one user prompt a request of the workload's own
input length are written as sys.txt/sys.relaykv and rows.jsonl; then

  * the engine alone answers the very token ids `relay run`'s own prompt path gives
    those rows (PromptMatcher.prepare), through e2e.run_engine;
  * `relay run` answers rows.jsonl in a subprocess, timed as a whole, its job time and
    step counts read from --stats-json, its output checked row by row;
  * the host's per-row work is timed in this process on the same rows: reading and
    parsing, rendering alone, and rendering + tokenizing + prefix matching.

All engine runs come first, then the model is dropped from this process, so that each
`relay run` sizes its KV cache from the device memory a user's job would see.
Nothing here prints; `progress` gets one line per run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq

from relaycli.models.registry import load_model
from relaycli.artifact import dtype_name
from relaycli.bench.e2e import E2EOptions, median_run, run_engine
from relaycli.bench.hf_peer import free_memory
from relaycli.bench.report import machine_info
from relaycli.bench.run_report import combine_rows, run_line
from relaycli.bench.run_texts import WordBank, fit_system_text, fit_user_rows
from relaycli.bench.workloads import RequestShape, get_workload, length_summary, make_requests
from relaycli.compile import compile_prompt, load_checked
from relaycli.io.reader import open_requests, read_requests
from relaycli.io.requests import RequestRow
from relaycli.prompts import PromptMatcher

SYSTEMS = ("relay", "no-relay")
_HOST_PASSES = 3  # the host timings keep the fastest pass (the least disturbed)


class ThroughRunError(ValueError):
    """A `relay run` that failed or answered wrongly; the message names the files."""


@dataclass
class Case:
    """One system-prompt length: its files, rows, and what the engine-only runs need."""

    tokens: int  # asked for
    folder: Path
    prefix_tokens: int  # the compiled prefix's real length
    shapes: list[RequestShape]  # real own input lengths, the workload's output lengths
    own_ids: list[list[int]]
    host: dict

    @property
    def rows_path(self) -> Path:
        return self.folder / "rows.jsonl"

    @property
    def prompt_path(self) -> Path:
        return self.folder / "sys.relaykv"


def check_options(opts: E2EOptions, keep: Path | None) -> None:
    bad = [s for s in opts.systems if s not in SYSTEMS]
    if bad:
        raise ValueError(f"--through-run compares relay and no-relay through `relay run`; drop {bad[0]!r} "
                         "from --systems")
    twice = sorted({s for s in opts.system_tokens if opts.system_tokens.count(s) > 1})
    if twice:
        raise ValueError(f"--system-tokens lists {twice[0]} more than once; give each length once")
    if opts.hf_requests is not None:
        raise ValueError("--hf-requests is for transformers runs; --through-run compares relay and no-relay only, "
                         "so drop it")
    if keep is not None:
        keep = Path(keep)
        if keep.exists() and not keep.is_dir():
            raise ValueError(f"--keep {keep} is a file; give a folder for the bench's inputs and answers")
        taken = [keep / f"s{s}" for s in opts.system_tokens if (keep / f"s{s}").exists()]
        if taken:
            raise ValueError(f"--keep {keep} already holds a run ({taken[0]}); give a new or empty folder")


def _best_pass(fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(_HOST_PASSES):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _write_rows(path: Path, texts: list[str], shapes: list[RequestShape], opts: E2EOptions) -> None:
    sampling = {"temperature": opts.temperature, "top_p": opts.top_p}
    if opts.top_k is not None:
        sampling["top_k"] = opts.top_k
    with open(path, "w", encoding="utf-8") as f:
        for i, (text, shape) in enumerate(zip(texts, shapes)):
            row = {"id": str(i), "prompt": text, "max_tokens": shape.output_len, "ignore_eos": True,
                   **sampling, "seed": i}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def prepare_case(lm, bank: WordBank, tokens: int, shapes: list[RequestShape], opts: E2EOptions,
                 folder: Path, rng: random.Random) -> tuple[Case, object]:
    """Texts, the compiled artifact and rows.jsonl for one S, and the host's per-row costs.
    Returns the case and the loaded artifact (for the engine-only runs)."""
    tok = lm.tokenizer
    folder.mkdir(parents=True)
    system = fit_system_text(tok, bank, tokens, rng)
    (folder / "sys.txt").write_text(system.text + "\n", encoding="utf-8")
    compile_prompt(lm, system.text, folder / "sys.relaykv")
    artifact = load_checked(folder / "sys.relaykv", lm)
    start = time.perf_counter()
    matcher = PromptMatcher(tok, [artifact])
    matcher_s = time.perf_counter() - start
    fitted = fit_user_rows(matcher, bank, [s.input_len for s in shapes], rng)
    rows_path = folder / "rows.jsonl"
    _write_rows(rows_path, [f.text for f in fitted], shapes, opts)
    real = [RequestShape(len(f.own_ids), s.output_len) for f, s in zip(fitted, shapes)]

    def read() -> list:
        return list(read_requests(open_requests(rows_path)))

    rows = read()
    if len(rows) != len(shapes) or not all(isinstance(r, RequestRow) for r in rows):
        raise ThroughRunError(f"{rows_path}: the bench's own rows did not parse as requests")
    chats = [[{"role": "system", "content": system.text}, *r.messages] for r in rows]
    n = len(rows)
    host = {
        "read_parse_us": 1e6 * _best_pass(read) / n,
        "render_us": 1e6 * _best_pass(lambda: [tok.render_text(c) for c in chats]) / n,
        "prepare_us": 1e6 * _best_pass(lambda: [matcher.prepare(r.messages, r.system_prompt) for r in rows]) / n,
        "matcher_setup_ms": 1e3 * matcher_s,
        "full_render_rows": sum(f.prepared.full_render for f in fitted),
        "spliced": matcher.splices[0] is not None,
        "own_tokens_exact": sum(r.input_len == s.input_len for r, s in zip(real, shapes)),
        "words_exact": bank.exact,
    }
    case = Case(tokens, folder, len(system.prefix_ids), real, [f.own_ids for f in fitted], host)
    return case, artifact


def run_cli(case: Case, max_batch: int, system: str, model: str | None, dtype: str, device: str,
            opts: E2EOptions, tag: str, threads: int) -> dict:
    """One `relay run` of the case's rows as a subprocess; its times, counts and answers."""
    name = f"{system}-b{max_batch}{tag}"
    out, stats = case.folder / f"answers-{name}.parquet", case.folder / f"stats-{name}.json"
    cmd = [sys.executable, "-c", "from relaycli.cli import entry; entry()", "run", "--in", str(case.rows_path),
           "--out", str(out), "--prompt", str(case.prompt_path), "--dtype", dtype, "--device", device,
           "--max-batch", str(max_batch), "--stats-json", str(stats), "--quiet"]
    cmd += ["--model", model] if model is not None else []
    cmd += ["--no-relay"] if system == "no-relay" else []
    cmd += ["--kv-cache-gb", f"{opts.kv_cache_gb:g}"] if opts.kv_cache_gb is not None else []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # the bench process's torch threads
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    process_s = time.perf_counter() - start
    where = f"relay run ({system}, S={case.tokens}, B={max_batch}; files in {case.folder})"
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise ThroughRunError(f"{where} exited with status {proc.returncode}: {last}")
    answers = pq.read_table(out).to_pylist()
    summary = json.loads(stats.read_text())
    ids = [a["id"] for a in answers]
    if ids != [str(i) for i in range(len(case.shapes))]:
        raise ThroughRunError(f"{where} wrote {len(answers)} rows for {len(case.shapes)} input rows, or out of order")
    failed = [a for a in answers if a["finish_reason"] == "error"]
    if failed:
        raise ThroughRunError(f"{where} answered {len(failed)} rows with errors, e.g. {failed[0]['error']}")
    st = summary["stats"]
    job_s = st["elapsed_seconds"]
    return {"process_s": process_s, "job_s": job_s, "requests_per_s": len(answers) / job_s,
            "process_requests_per_s": len(answers) / process_s, "load_s": summary["load_seconds"],
            "rows": len(answers), "error_rows": summary["error_rows"],
            "generated_tokens": sum(a["completion_tokens"] for a in answers),
            "exact_lengths": all(a["completion_tokens"] == s.output_len for a, s in zip(answers, case.shapes)),
            "cached_tokens": sum(a["cached_tokens"] for a in answers),
            "prefill_s": st["prefill_seconds"], "decode_s": st["decode_seconds"],
            **{k: summary.get(k) for k in ("graph_captures", "graph_capture_seconds", "triton_kernels_compiled",
                                           "triton_compile_seconds", "triton_kernels_loaded")},
            **{k: st[k] for k in ("decode_steps", "graphed_decode_steps", "eager_decode_steps", "eager_reasons",
                                  "prefill_steps", "prefix_hits", "prefix_misses", "prompt_fallbacks",
                                  "device_wait_seconds")},
            "_texts": [a["text"] for a in answers]}


def _engine_runs(lm, opts: E2EOptions, work: Path, shapes: list[RequestShape], sampling: dict | None,
                 say: Callable[[str], None]) -> tuple[list[Case], dict]:
    """Every case's files and host costs, and the engine alone on its rows (median of
    --repeats runs), keyed by (S, batch limit, system)."""
    tok = lm.tokenizer
    bank, rng = WordBank(tok), random.Random(opts.seed + 1)
    cases, engine = [], {}
    for s in opts.system_tokens:
        case, artifact = prepare_case(lm, bank, s, shapes, opts, work / f"s{s}", rng)
        cases.append(case)
        h = case.host
        say(f"S={s}: prefix {case.prefix_tokens} tokens; host per row: read+parse {h['read_parse_us']:.0f} us, "
            f"render {h['render_us']:.0f} us, prepare {h['prepare_us']:.0f} us")
        for b in opts.max_batch:
            runs: dict[str, list] = {system: [] for system in opts.systems}
            for _ in range(opts.repeats):
                for system in opts.systems:
                    row = run_engine(lm, artifact, case.shapes, case.own_ids, b, system == "relay", opts.kv_cache_gb,
                                     sampling=sampling)
                    row["requests_per_s"] = row["requests"] / row["seconds"]
                    runs[system].append((row, row.pop("_ids")))
                    say(f"engine    {system:8s} S={s:<6d} B={b:<4d} {row['requests_per_s']:8.2f} req/s")
            for system in opts.systems:
                row, ids = median_run(runs[system])
                row["_texts"] = [tok.decode(ids[i]) for i in range(len(case.shapes))]
                engine[(s, b, system)] = row
        del artifact
    return cases, engine


def run_through(opts: E2EOptions, keep: Path | None = None,
                progress: Callable[[str], None] | None = None) -> dict:
    say = progress or (lambda _msg: None)
    check_options(opts, keep)
    spec = get_workload(opts.workload)
    shapes = make_requests(spec, opts.requests, opts.seed, opts.max_output_len)
    lm = load_model(opts.model, opts.dtype, opts.device)  # relay run's own weights (dummy seed 0)
    need = max(opts.system_tokens) + max(r.input_len + r.output_len for r in shapes)
    limit = lm.config.max_position_embeddings
    if need > limit:
        raise ValueError(f"the longest system prompt plus the longest request needs {need} positions, {lm.reference} "
                         f"has {limit}; use fewer --system-tokens or --max-output-len (dummy:tiny has 32,768)")
    if lm.tokenizer is None:
        raise ValueError(f"{lm.reference} has no tokenizer; --through-run needs one to write text rows")
    import torch
    dev, threads = lm.model.device, torch.get_num_threads()
    dtype, reference = dtype_name(lm.model.dtype), lm.reference
    sampling = (dict(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k)
                if opts.temperature > 0 else None)
    work = Path(keep) if keep is not None else Path(tempfile.mkdtemp(prefix="relay-bench-run-"))
    say(f"model {reference} ({dtype}, {dev}); files in {work}")
    try:
        cases, engine = _engine_runs(lm, opts, work, shapes, sampling, say)
        del lm
        free_memory(dev)  # each relay run sizes its KV cache from what a job alone would see
        runs = {}
        for case in cases:
            for b in opts.max_batch:
                for system in opts.systems:
                    tries = []
                    for rep in range(opts.repeats):
                        tag = f"-run{rep + 1}" if opts.repeats > 1 else ""
                        tries.append(run_cli(case, b, system, opts.model, dtype, str(dev), opts, tag, threads))
                        say(run_line(system, case.tokens, b, tries[-1]))
                    median = sorted(tries, key=lambda r: r["job_s"])[len(tries) // 2]
                    runs[(case.tokens, b, system)] = {**median, "job_s_runs": [r["job_s"] for r in tries]}
    except ThroughRunError:
        raise  # its message names the files: they stay
    except BaseException:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
        raise
    rows = combine_rows(cases, engine, runs, opts)
    if keep is None:
        shutil.rmtree(work, ignore_errors=True)
    return {"kind": "e2e-through-run", "machine": machine_info(dev), "model": reference, "dtype": dtype,
            "workload": {**spec.describe(), "seed": opts.seed, "requests": opts.requests,
                         "max_output_len": opts.max_output_len, "lengths": length_summary(shapes)},
            "files": str(work) if keep is not None else None,
            "options": {k: v for k, v in opts.__dict__.items()}, "rows": rows}

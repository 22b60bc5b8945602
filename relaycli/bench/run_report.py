"""Rows and tables of `relay bench e2e --through-run`: `relay run` beside the engine alone.

One row per (system-prompt length, batch limit, system). `engine_*`: the engine alone on
the rows' token ids, after its warm-up. `run_*`: the `relay run` process on the same rows
as text; its job time (`run_job_s`, from the job's --stats-json: the engine loop with the
reading, rendering, tokenizing and writing of rows, and the compiles and graph captures
a job meets; not model and artifact loading or building the engine) and its whole
process (`run_process_s`: Python's start and all loading too). `host_*`: the host's
per-row work measured in the bench process on the same rows.
"""

from __future__ import annotations

from rich.table import Table

_ENGINE_KEYS = ("seconds", "requests_per_s", "generated_tokens", "exact_lengths", "decode_steps",
                "graphed_decode_steps", "eager_decode_steps", "prefill_s", "warmup_s", "attention_impl",
                "graph_captures_in_run", "kernel_compiles_in_run", "seconds_runs", "same_ids_across_runs")


def _same_texts(a: list[str], b: list[str]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def combine_rows(cases, engine: dict, runs: dict, opts) -> list[dict]:
    """The report's rows from each case's engine-only and `relay run` results, with the
    ratios between them and relay's speed-ups over no-relay of the same S and batch."""
    rows = []
    for case in cases:
        n = len(case.shapes)
        for b in opts.max_batch:
            for system in opts.systems:
                e, r = engine[(case.tokens, b, system)], runs[(case.tokens, b, system)]
                host_us = case.host["read_parse_us"] + case.host["prepare_us"]
                job_us = 1e6 * r["job_s"] / n
                row = {"system": system, "system_tokens": case.tokens, "prefix_tokens": case.prefix_tokens,
                       "max_batch": b, "requests": n,
                       "own_tokens_mean": sum(s.input_len for s in case.shapes) / n,
                       **{f"engine_{k}": e.get(k) for k in _ENGINE_KEYS},
                       **{f"run_{k}": v for k, v in r.items() if not k.startswith("_")},
                       "run_over_engine": r["requests_per_s"] / e["requests_per_s"],
                       "same_generated_tokens": r["generated_tokens"] == e["generated_tokens"],
                       "same_text_as_engine": _same_texts(r["_texts"], e["_texts"]),
                       **{f"host_{k}": v for k, v in case.host.items()},
                       "host_us_per_row": host_us, "run_job_us_per_row": job_us,
                       "host_share_of_run_job": host_us / job_us}
                rows.append(row)
    add_run_speedups(rows)
    return rows


def add_run_speedups(rows: list[dict]) -> None:
    """relay's speed-up over no-relay of the same S and batch limit: for the engine alone,
    for `relay run`'s job time and for its whole process."""
    base = {(r["system_tokens"], r["max_batch"]): r for r in rows if r["system"] == "no-relay"}
    for r in rows:
        ref = base.get((r["system_tokens"], r["max_batch"]))
        if r["system"] == "relay" and ref is not None:
            r["engine_speedup_vs_no_relay"] = r["engine_requests_per_s"] / ref["engine_requests_per_s"]
            r["run_speedup_vs_no_relay"] = r["run_requests_per_s"] / ref["run_requests_per_s"]
            r["run_process_speedup_vs_no_relay"] = ref["run_process_s"] / r["run_process_s"]


def run_line(system: str, tokens: int, batch: int, r: dict) -> str:
    """One progress line of a `relay run`."""
    return (f"relay run {system:8s} S={tokens:<6d} B={batch:<4d} {r['requests_per_s']:8.2f} req/s (job "
            f"{r['job_s']:.2f} s, process {r['process_s']:.2f} s, decode steps graphed/eager "
            f"{r['graphed_decode_steps']}/{r['eager_decode_steps']})")


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def through_run_table(report: dict) -> Table:
    """Throughput: the engine alone against `relay run` on the same rows."""
    wl = report["workload"]
    title = (f"relay bench e2e --through-run: {report['model']} {report['dtype']} on "
             f"{report['machine'].get('gpu', 'cpu')}; {wl['name']} x {wl['requests']} (seed {wl['seed']}); "
             "engine: token ids after a warm-up; run: `relay run` JSONL -> Parquet, req/s by its job time")
    t = Table(title=title, title_justify="left")
    for col in ("system", "S", "max batch", "engine req/s", "run req/s", "run/engine", "run job (s)",
                "run process (s)", "x no-relay engine", "x no-relay run", "run steps graphed/eager", "same text"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for r in report["rows"]:
        s = str(r["system_tokens"]) + ("" if r["prefix_tokens"] == r["system_tokens"] else f" ({r['prefix_tokens']})")
        t.add_row(r["system"], s, str(r["max_batch"]), f"{r['engine_requests_per_s']:.2f}",
                  f"{r['run_requests_per_s']:.2f}", f"{r['run_over_engine']:.3f}", f"{r['run_job_s']:.2f}",
                  f"{r['run_process_s']:.1f}", _f(r.get("engine_speedup_vs_no_relay"), ".2f"),
                  _f(r.get("run_speedup_vs_no_relay"), ".2f"),
                  f"{r['run_graphed_decode_steps']}/{r['run_eager_decode_steps']}",
                  r["same_text_as_engine"] + ("" if r["same_generated_tokens"] else ", token counts differ"))
    return t


def host_table(report: dict) -> Table:
    """The host's work per row at each system-prompt length (one line an S: it does not
    depend on the system), against the relay run's job time per row."""
    t = Table(title="host work per row, measured in the bench process on the same rows (fastest of 3 passes)",
              title_justify="left")
    for col in ("S", "own tokens (mean)", "read+parse (us)", "render (us)", "render+tokenize+match (us)",
                "matcher setup (ms)", "relay run job (us/row)", "host % of job", "rows tokenized whole"):
        t.add_column(col, justify="right")
    seen = set()
    for r in report["rows"]:
        if r["system_tokens"] in seen or r["system"] != report["rows"][0]["system"]:
            continue
        seen.add(r["system_tokens"])
        t.add_row(str(r["prefix_tokens"]), f"{r['own_tokens_mean']:.1f}", f"{r['host_read_parse_us']:.0f}",
                  f"{r['host_render_us']:.0f}", f"{r['host_prepare_us']:.0f}", f"{r['host_matcher_setup_ms']:.0f}",
                  f"{r['run_job_us_per_row']:.0f}", f"{100 * r['host_share_of_run_job']:.2g}",
                  f"{r['host_full_render_rows']}/{r['requests']}")
    return t

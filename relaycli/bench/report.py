"""Benchmark output: rich tables, the JSON file, and the PNG plot (matplotlib, Agg).

Builds objects and writes files; printing them is the CLI's business.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.table import Table

from relaycli.engine.stats import quantile


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ceilings(report: dict) -> str:
    c = report["ceilings"]
    return (f"copy {c['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (read+write), "
            f"matmul {c['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s ({report['dtype']})")


def _req_s(row: dict) -> str:
    """req/s of the row; after repeats, the median run's, then the range of all runs."""
    if not row.get("requests_per_s_runs"):
        return f"{row['requests_per_s']:.2f}"
    runs = row["requests_per_s_runs"]
    return f"{row['requests_per_s']:.2f} ({min(runs):.2f}-{max(runs):.2f}, {len(runs)} runs)"


def e2e_table(report: dict) -> Table:
    wl = report["workload"]
    opts = report.get("options", {})
    drawn = ""
    if opts.get("temperature"):
        drawn = (f", sampled at temperature {opts['temperature']}"
                 + (f" top_p {opts['top_p']}" if opts.get("top_p", 1.0) < 1 else "")
                 + (f" top_k {opts['top_k']}" if opts.get("top_k") else ""))
    title = (f"relay bench e2e: {report['model']} {report['dtype']} on {report['machine'].get('gpu', 'cpu')}; "
             f"{wl['name']} x {wl['requests']} (seed {wl['seed']}{drawn}); {_ceilings(report)}")
    t = Table(title=title, title_justify="left")
    for col in ("system", "S", "max batch", "req/s", "tok/s", "x no-relay", "TTFT p50 (s)", "TTFT p90 (s)",
                "step (ms)", "floor (ms)", "% floor", "% floor B>=64", "exact", "same ids"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for r in report["rows"]:
        if "skipped" in r:
            t.add_row(r["system"], str(r["system_tokens"]), str(r["max_batch"]), f"skipped: {r['skipped']}")
            continue
        step, floor = r.get("decode_step_s"), r.get("floor_step_s")
        capped = "hf_batch" in r and r["hf_batch"] != r["max_batch"]
        t.add_row(r["system"] + (f" (B={r['hf_batch']})" if capped else ""),
                  str(r["system_tokens"]), str(r["max_batch"]), _req_s(r),
                  f"{r['tokens_per_s']:.1f}", _fmt(r.get("speedup_vs_no_relay"), ".2f"),
                  _fmt(r.get("ttft_p50_s"), ".3f"), _fmt(r.get("ttft_p90_s"), ".3f"),
                  _fmt(step and 1e3 * step, ".2f"), _fmt(floor and 1e3 * floor, ".3f"),
                  _fmt(r.get("floor_fraction") and 100 * r["floor_fraction"], ".1f"),
                  _fmt(r.get("large_batch_floor_fraction") and 100 * r["large_batch_floor_fraction"], ".1f"),
                  "yes" if r.get("exact_lengths") else "NO", r.get("same_tokens_as_relay", "-"))
    return t


def sweep_summary(report: dict) -> list[dict]:
    """How relay's throughput changes from the shortest to the longest system prompt,
    against what the roofline predicts for its decode step (throughput taken as the
    inverse of the step floor). points_over_prediction > 0: it fell by that many
    percentage points more than predicted. One entry per max batch with relay rows at two
    or more system-prompt lengths. Only relay: the floor is relay's work, not a peer's."""
    groups: dict[int, list[dict]] = {}
    for r in report.get("rows", []):
        if r["system"] == "relay" and "skipped" not in r and r.get("floor_step_s") and r.get("requests_per_s"):
            groups.setdefault(r["max_batch"], []).append(r)
    out = []
    for batch, rows in groups.items():
        if len({r["system_tokens"] for r in rows}) < 2:
            continue
        lo = min(rows, key=lambda r: r["system_tokens"])
        hi = max(rows, key=lambda r: r["system_tokens"])
        measured = hi["requests_per_s"] / lo["requests_per_s"] - 1
        predicted = lo["floor_step_s"] / hi["floor_step_s"] - 1
        out.append(dict(system="relay", max_batch=batch, from_tokens=lo["system_tokens"], to_tokens=hi["system_tokens"],
                        measured_change=measured, predicted_change=predicted,
                        points_over_prediction=100 * (predicted - measured)))
    return out


def sweep_table(report: dict) -> Table | None:
    rows = sweep_summary(report)
    if not rows:
        return None
    t = Table(title="relay's throughput across system-prompt lengths (prediction: its decode-step floor)",
              title_justify="left")
    for col in ("system", "max batch", "S from", "S to", "req/s change", "predicted", "points over prediction"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        t.add_row(r["system"], str(r["max_batch"]), str(r["from_tokens"]), str(r["to_tokens"]),
                  f"{100 * r['measured_change']:+.1f}%", f"{100 * r['predicted_change']:+.1f}%",
                  f"{r['points_over_prediction']:+.1f}")
    return t


def steps_table(report: dict) -> Table | None:
    """Engine rows' decode steps in four batch ranges (four of steps_by_batch's ranges
    each: quarters of the batch limit): how many steps each range took, their mean
    time, and the floor of those steps. None when no row carries decode_steps_by_batch."""
    from relaycli.bench.roofline import STEP_BINS, step_bin_width
    rows = [r for r in report.get("rows", []) if r.get("decode_steps_by_batch")]
    if not rows:
        return None
    t = Table(title="decode steps by batch size (a job's tail runs in the small ranges)", title_justify="left")
    for col in ("system", "S", "max batch", "batch", "steps", "step mean (ms)", "floor (ms)", "% floor"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        limit = r["max_batch"]
        width = step_bin_width(limit)
        per_row = STEP_BINS // 4
        quarters: dict[int, list[dict]] = {}
        for b in r["decode_steps_by_batch"]:
            quarters.setdefault((b["batch_from"] - 1) // width // per_row, []).append(b)
        for q, bins in sorted(quarters.items()):
            steps = sum(b["steps"] for b in bins)
            mean = sum(b["step_mean_s"] * b["steps"] for b in bins) / steps
            floor = sum(b["floor_s"] * b["steps"] for b in bins) / steps
            lo, hi = q * per_row * width + 1, min((q + 1) * per_row * width, limit)
            t.add_row(r["system"], str(r["system_tokens"]), str(limit), f"{lo}-{hi}", str(steps),
                      f"{1e3 * mean:.2f}", f"{1e3 * floor:.2f}", f"{100 * floor / mean:.1f}")
    return t


def job_table(report: dict) -> Table | None:
    """Engine runs against their job floor: prefill at the matmul rate plus every decode
    step at its floor. For relay, the most it could gain over the measured --no-relay
    run of the same S and batch limit (that run's time over relay's floor)."""
    rows = [r for r in report.get("rows", []) if r.get("job_floor_s")]
    if not rows:
        return None
    base = {(r["system_tokens"], r["max_batch"]): r for r in rows if r["system"] == "no-relay"}
    t = Table(title="whole jobs against their floor (prefill and every decode step at its floor)",
              title_justify="left")
    for col in ("system", "S", "max batch", "seconds", "floor (s)", "% floor", "req/s at floor",
                "x no-relay", "x no-relay at floor"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for r in rows:
        ref = base.get((r["system_tokens"], r["max_batch"])) if r["system"] == "relay" else None
        t.add_row(r["system"], str(r["system_tokens"]), str(r["max_batch"]), f"{r['seconds']:.2f}",
                  f"{r['job_floor_s']:.2f}", f"{100 * r['job_floor_fraction']:.1f}",
                  f"{r['job_floor_requests_per_s']:.2f}", _fmt(r.get("speedup_vs_no_relay"), ".2f"),
                  f"{ref['seconds'] / r['job_floor_s']:.2f}" if ref else "-")
    return t


def kernels_table(report: dict) -> Table:
    h = report["heads"]
    title = (f"relay bench kernels ({report['impl']}): Hq={h['q_heads']} Hkv={h['kv_heads']} D={h['head_dim']} "
             f"{report['dtype']} on {report['machine'].get('gpu', 'cpu')}; {_ceilings(report)}")
    if report["impl"] == "triton":  # CUDA timings: say how the L2 was emptied (reports without the field: do_bench's way)
        title += f"; L2 emptied {report['options'].get('l2_flush', 'dirty')} before each run"
    t = Table(title=title, title_justify="left")
    for col in ("kernel", "S", "batch", "own", "time (us)", "floor (us)", "bound", "% floor", "x no-relay",
                "rel diff"):
        t.add_column(col, justify="left" if col in ("kernel", "bound") else "right")
    for r in report["rows"]:
        t.add_row(r["system"], str(r["system_tokens"]), str(r["batch"]), str(r["own_tokens"]),
                  f"{r['time_us']:.1f}", f"{r['floor_us']:.2f}", r["bound"], f"{100 * r['floor_fraction']:.1f}",
                  f"{r['speedup_vs_no_relay']:.2f}", f"{r['rel_diff_vs_no_relay']:.1e}")
    return t


def modules_tables(report: dict) -> list[Table]:
    """`relay bench modules`: time to first token with a module library against full
    prefill of the same tokens, then independent modules' agreement with full prefill."""
    t = report["ttft"]
    ttft = Table(title=f"prompt modules: time to first token, {t['module_tokens']:,} module tokens of "
                       f"{t['prompt_tokens']:,} ({t['threads']} threads)", title_justify="left")
    for col in ("library, first row (s)", "library, later rows (s)", "full prefill (s)", "x full prefill, first",
                "x full prefill, later"):
        ttft.add_column(col, justify="right")
    ttft.add_row(f"{t['relay_cold_s']:.3f}", f"{t['relay_warm_s']:.3f}", f"{t['full_prefill_s']:.3f}",
                 f"{t['speedup_cold']:.2f}", f"{t['speedup_warm']:.2f}")
    i = report["independent"]
    agree = Table(title=f"independent modules: greedy agreement with full prefill, teacher-forced "
                        f"({i['pairs']} pairs, {i['answer_tokens']:,} answer tokens)", title_justify="left")
    for col in ("agreement", "first token", "control (no modules)"):
        agree.add_column(col, justify="right")
    agree.add_row(f"{100 * i['agreement']:.1f}%", f"{100 * i['first_token_agreement']:.1f}%",
                  f"{100 * i['control_agreement']:.1f}%")
    return [ttft, agree]


def jobs_table(report: dict) -> Table:
    """`relay bench jobs`' rows, one a job; x no-relay: a job's rows/s over those of its
    --no-relay twin (the job of the same name with -no-relay in it)."""
    rows = report["rows"]
    rate = {r["job"]: r.get("rows_per_second") for r in rows}
    t = Table(title="relay bench jobs: whole relay run jobs", title_justify="left")
    for col in ("job", "rows", "errors", "process (s)", "job (s)", "rows/s", "x no-relay", "decode steps (graphed)",
                "step p50 (ms)", "prefill (s)", "prefix hits / misses", "Triton kernels compiled (s)"):
        # a job's whole name on one line, the numbers' columns narrowed for it
        t.add_column(col, justify="left" if col == "job" else "right", no_wrap=col == "job",
                     min_width=max((len(r["job"]) for r in rows), default=3) if col == "job" else None)
    for r in rows:
        twin = next((rate[n] for n in (r["job"] + "-no-relay", r["job"].replace("-cold", "-no-relay-cold"))
                     if n != r["job"] and rate.get(n)), None)
        own = r.get("rows_per_second")
        steps, hits, kernels = r.get("decode_steps"), r.get("prefix_hits"), r.get("triton_kernels_compiled")
        t.add_row(r["job"], _fmt(r.get("rows"), ","), _fmt(r.get("errors"), "d"), _fmt(r.get("process_seconds"), ".2f"),
                  _fmt(r.get("job_seconds"), ".2f"), _fmt(own, ".1f"),
                  _fmt(own / twin if own and twin else None, ".2f"),
                  "-" if steps is None else f"{steps:,} ({r['graphed_decode_steps']:,})",
                  _fmt(r.get("decode_step_p50_ms"), ".2f"), _fmt(r.get("prefill_seconds"), ".2f"),
                  "-" if hits is None else f"{hits:,} / {r['prefix_misses']:,}",
                  "-" if kernels is None else f"{kernels} ({r['triton_compile_seconds']:.1f})")
    return t


def ttft_stats(values: list[float]) -> dict:
    """Mean, median and 90th percentile of times to first token (seconds)."""
    s = sorted(values)
    return {"ttft_mean_s": sum(s) / len(s) if s else None, "ttft_p50_s": quantile(s, 0.5),
            "ttft_p90_s": quantile(s, 0.9)}


def compare_tokens(rows: list[dict], ids_by_system: dict) -> None:
    """How many requests generated the same ids as relay (greedy, same weights): a check
    that every system computed the same thing; low-precision near-ties may flip a few."""
    mine = ids_by_system.get("relay")
    for r in rows:
        theirs = ids_by_system.get(r["system"])
        if mine and theirs and r["system"] != "relay":
            r["same_tokens_as_relay"] = f"{sum(mine.get(i) == t for i, t in theirs.items())}/{len(theirs)}"


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_no_relay: tokens/s over those of --no-relay at the same S and batch limit."""
    ref = {(r["system_tokens"], r["max_batch"]): r for r in rows if r["system"] == "no-relay" and "tokens_per_s" in r}
    for r in rows:
        base = ref.get((r["system_tokens"], r["max_batch"]))
        if base and "tokens_per_s" in r:
            r["speedup_vs_no_relay"] = r["tokens_per_s"] / base["tokens_per_s"]


def merge_reports(reports: list[dict]) -> list[dict]:
    """Join e2e reports of one model, dtype and workload (runs split to fit a time limit)
    into one, rows in order; other reports stay as they are."""
    out: list[dict] = []
    by_key: dict[tuple, dict] = {}
    for rep in reports:
        if rep["kind"] != "e2e":
            out.append(rep)
            continue
        wl = rep["workload"]
        key = (rep["model"], rep["dtype"], wl["name"], wl["requests"], wl["seed"], wl.get("max_output_len"))
        if key in by_key:
            by_key[key]["rows"] = by_key[key]["rows"] + rep["rows"]
            add_speedups(by_key[key]["rows"])
        else:
            by_key[key] = dict(rep)
            out.append(by_key[key])
    return out


SYSTEM_COLORS = {"relay": "tab:blue", "no-relay": "tab:orange", "hf": "tab:green", "sdpa": "tab:red"}


def plot_throughput(reports: list[dict], path: Path) -> None:
    """Generated tokens/s against system-prompt length, one line per system (and batch
    limit when several); e2e and kernel reports side by side when both are given."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_steps = any(r.get("decode_steps_by_batch") for rep in reports for r in rep.get("rows", []))
    fig, axes = plt.subplots(2 if with_steps else 1, len(reports), figsize=(6.5 * len(reports), 9 if with_steps else 4.5),
                             squeeze=False)
    if with_steps:
        for ax, rep in zip(axes[1], reports):
            _plot_steps(ax, rep)
    for ax, rep in zip(axes[0], reports):
        batch_key = "max_batch" if rep["kind"] == "e2e" else "batch"
        rows = [r for r in rep["rows"] if "tokens_per_s" in r]
        several = len({r[batch_key] for r in rows}) > 1
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            label = r["system"] + (f" B={r[batch_key]}" if several else "")
            series.setdefault(label, []).append((r["system_tokens"], r["tokens_per_s"]))
        for label, pts in sorted(series.items()):
            pts.sort()
            # one colour per system in every panel (a panel without hf would shift the cycle)
            color = None if several else SYSTEM_COLORS.get(label)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=color)
        ax.set_xscale("symlog", linthresh=256)
        lengths = sorted({r["system_tokens"] for r in rows})
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])  # symlog puts no labels between decades
        ax.set_ylim(bottom=0)
        ax.set_xlabel("system prompt (tokens)")
        if rep["kind"] == "e2e":
            ax.set_ylabel("generated tokens / s")
            ax.set_title(f"{rep['model']} {rep['dtype']}, {rep['workload']['name']} x {rep['workload']['requests']}",
                         fontsize=9)
        else:
            ax.set_ylabel("decode queries / s (one layer's attention)")
            h = rep["heads"]
            ax.set_title(f"attention ({rep['impl']}) Hq={h['q_heads']} Hkv={h['kv_heads']} D={h['head_dim']} "
                         f"{rep['dtype']}", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"relay bench on {reports[0]['machine'].get('gpu', 'cpu')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_steps(ax, rep: dict) -> None:
    """Median decode-step time against batch size, a line per engine row; relay's step
    floor dashed in the same colour."""
    rows = [r for r in rep.get("rows", []) if r.get("decode_steps_by_batch")]
    if not rows:
        ax.set_axis_off()
        return
    several = len({r["max_batch"] for r in rows}) > 1
    for r in rows:
        bins = r["decode_steps_by_batch"]
        label = f"{r['system']} S={r['system_tokens']:,}" + (f" B<={r['max_batch']}" if several else "")
        line, = ax.plot([b["mean_batch"] for b in bins], [1e3 * b["step_p50_s"] for b in bins], marker=".",
                        label=label)
        if r["system"] == "relay":
            ax.plot([b["mean_batch"] for b in bins], [1e3 * b["floor_s"] for b in bins], linestyle="--",
                    color=line.get_color(), alpha=0.7, label=f"{label} floor")
    ax.set_xlabel("decode batch (requests in the step)")
    ax.set_ylabel("decode step, median (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("decode steps by batch size", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def e2e_line(row: dict) -> str:
    """One progress line of an e2e run."""
    head = f"{row['system']:8s} S={row['system_tokens']:<6d} B={row['max_batch']:<4d}"
    if "skipped" in row:
        return f"{head} skipped: {row['skipped']}"
    step = row.get("decode_step_s")
    return (f"{head} {row['tokens_per_s']:9.1f} tok/s {row['requests_per_s']:7.2f} req/s "
            f"step {1e3 * step if step else float('nan'):7.2f} ms  exact={row['exact_lengths']}")


def machine_info(device) -> dict:
    import platform

    import torch
    info = {"device": device.type, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "platform": platform.platform()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info

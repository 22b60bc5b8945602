"""Whole `relay run` jobs as a user runs them (the CLI on a JSONL file, whole process), on a
CUDA machine: the numbers docs/benchmarks.md quotes for the product path. The inputs come
from the repository's examples/, so these run from a checkout.

  examples  the default model on examples/requests.jsonl cycled to 2,000 rows, 64 tokens a
            row, against examples/system_prompt.txt: relay as the file is (two of its 120
            rows bring their own system prompt), relay without those two rows, --no-relay;
            then the README's main job (120 rows)
  mixed     dummy:llama3-8b (random weights, the default model's tokenizer): 8 system
            prompts of 2,048-8,192 tokens evenly mixed, 5% of rows with a system prompt of
            their own, 2,000 rows of 32 prompt and 64 generated tokens; relay and --no-relay
  cold      the examples job with an empty Triton cache, relay and --no-relay (the first
            run on a machine: what it compiles)
  modules   a prompt-module library (docs/modules.md) on dummy:llama3-8b and dummy:llama2-7b:
            a 1,024-token system and 16 documents as root modules (2,048-4,096 tokens;
            1,536-2,432 on llama2-7b, whose positions end at 4,096), 1,000 rows each naming
            one document with a 32-128-token question and a 64-256-token answer (ignore_eos);
            relay, --no-relay, and the same rows with the document in their prompt (full
            prefill), and what the median decode step's time says about the bytes it read;
            on llama3-8b also relay with --prefix-cache-gb 2 (room for 4 of the 16 paths),
            the rows as they are and sorted by document

`relay bench jobs [PART ...] --out DIR` (default: examples mixed) writes DIR/jobs.json.
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
from collections.abc import Callable
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("examples", "mixed", "cold", "modules")
Say = Callable[[dict], None]  # where a finished job's row goes (the CLI prints it)
RELAY = [sys.executable, "-c", "from relaycli.cli import entry; entry()"]


def relay(*args, env=None) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    res = subprocess.run(RELAY + [str(a) for a in args], capture_output=True, text=True, env=env)
    took = time.perf_counter() - started
    if res.returncode != 0:
        raise SystemExit(f"relay {' '.join(map(str, args[:2]))} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return took, res


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_job(say: Say, name: str, work: Path, rows: Path, prompts: list[Path], *extra, env=None) -> dict:
    stats = work / f"{name}.stats.json"
    out = work / f"{name}.parquet"
    args = ["run", "--in", rows, "--out", out, "--stats-json", stats, "--quiet"]
    for p in prompts:
        args += ["--prompt", p]
    seconds, _ = relay(*args, *extra, env=env)
    s = json.loads(stats.read_text())
    st = s["stats"]
    row = {"job": name, "process_seconds": round(seconds, 2), "job_seconds": round(st["elapsed_seconds"], 2),
           "rows": st["rows"], "errors": st["errors"], "rows_per_second": round(st["rows_per_second"], 1),
           "decode_steps": st["decode_steps"], "graphed_decode_steps": st["graphed_decode_steps"],
           "eager_reasons": st["eager_reasons"], "decode_step_p50_ms": round(1e3 * (st["decode_step_p50_seconds"] or 0), 3),
           "ttft_p50_seconds": st["ttft_p50_seconds"] and round(st["ttft_p50_seconds"], 3),
           "decode_seconds": round(st["decode_seconds"], 2), "prefill_seconds": round(st["prefill_seconds"], 2),
           "prefill_steps": st["prefill_steps"], "prefill_tokens": st["prefill_tokens"],
           "device_wait_seconds": round(st["device_wait_seconds"], 2),
           "prefill_launch_seconds": round(st["prefill_launch_seconds"], 2),
           "decode_launch_seconds": round(st["decode_launch_seconds"], 2), "prefix_hits": st["prefix_hits"],
           "prefix_misses": st["prefix_misses"], "prompt_fallbacks": st.get("prompt_fallbacks"),
           "load_seconds": round(s["load_seconds"], 2), "triton_kernels_compiled": s["triton_kernels_compiled"],
           "triton_compile_seconds": round(s["triton_compile_seconds"], 1),
           "graph_captures": s["graph_captures"], "graph_capture_seconds": round(s["graph_capture_seconds"], 1),
           "module_paths_built": st.get("module_paths_built"), "module_paths_dropped": st.get("module_paths_dropped")}
    say(row)
    return row


def examples(work: Path, say: Say, cold: bool = False) -> list[dict]:
    base = [json.loads(line) for line in (ROOT / "examples/requests.jsonl").read_text().splitlines() if line.strip()]
    cycled = [dict(r, id=f"{r.get('id', i)}-{k}") for k in range(17) for i, r in enumerate(base)][:2000]
    plain = [r for r in base if not any(m.get("role") == "system" for m in r.get("messages", []))]
    plain = [dict(r, id=f"{r.get('id', i)}-{k}") for k in range(18) for i, r in enumerate(plain)][:2000]
    as_is, no_own = write_jsonl(work / "examples.jsonl", cycled), write_jsonl(work / "examples_plain.jsonl", plain)
    sys_kv = work / "sys.relaykv"
    if not sys_kv.exists():
        relay("compile-prompt", ROOT / "examples/system_prompt.txt", "--out", sys_kv, "--quiet")
    common = ("--max-batch", 256, "--max-tokens", 64)
    if cold:  # each with an empty Triton cache: what the first run on a machine compiles; the
        # kernels then join the default cache, so that the warm runs after find them
        default = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
        rows = []
        for mode, flags in (("", ()), ("-no-relay", ("--no-relay",))):
            fresh = work / f"triton{mode}"
            rows.append(run_job(say, f"examples{mode}-cold", work, as_is, [sys_kv], *common, *flags,
                                env=dict(os.environ, TRITON_CACHE_DIR=str(fresh))))
            shutil.copytree(fresh, default, dirs_exist_ok=True)
        return rows
    rows = [run_job(say, "examples", work, as_is, [sys_kv], *common),
            run_job(say, "examples-no-relay", work, as_is, [sys_kv], *common, "--no-relay")]
    rows.append(run_job(say, "examples-plain", work, no_own, [sys_kv], *common))
    seconds, _ = relay("run", "--in", ROOT / "examples/requests.jsonl", "--out", work / "answers.parquet",
                       "--prompt", sys_kv, "--max-tokens", 64, "--stats-json", work / "readme.json", "--quiet")
    rows.append({"job": "readme-main-job", "process_seconds": round(seconds, 2)})
    say(rows[-1])
    return rows


def mixed(work: Path, say: Say) -> list[dict]:
    rng = random.Random(0)
    words = (ROOT / "examples/system_prompt.txt").read_text().split()
    prompts = []
    for i in range(8):
        n = 2048 + i * 6144 // 7  # about that many words: 2k-8k tokens and a little more
        text = " ".join(words[j % len(words)] for j in range(i * 97, i * 97 + int(n * 0.8)))
        path = work / f"mix{i}.txt"
        path.write_text(f"Prompt {i}. " + text)
        prompts.append(path)
    model = ("--model", "dummy:llama3-8b", "--dtype", "bfloat16")
    took, _ = relay("compile-prompt", *prompts, *model, "--quiet")
    say({"compile_8_prompts_seconds": round(took, 1)})
    rows = []
    for i in range(2000):
        row = {"id": str(i), "prompt": " ".join(rng.choice(words) for _ in range(24)), "max_tokens": 64,
               "ignore_eos": True, "temperature": 0}
        if i % 20 == 19:  # 5%: a system prompt of their own, answered by full prefill
            row = {"id": str(i), "messages": [{"role": "system", "content": f"You are assistant number {i}."},
                                              {"role": "user", "content": row["prompt"]}],
                   "max_tokens": 64, "ignore_eos": True, "temperature": 0}
        else:
            row["system_prompt"] = f"mix{i % 8}"
        rows.append(row)
    jobs = write_jsonl(work / "mixed.jsonl", rows)
    kvs = [p.with_suffix(".relaykv") for p in prompts]
    common = (*model, "--max-batch", 256)
    return [run_job(say, "mixed-llama3", work, jobs, kvs, *common),
            run_job(say, "mixed-llama3-no-relay", work, jobs, kvs, *common, "--no-relay")]


def modules_library(work: Path, words: list[str], doc_tokens: tuple[int, int],
                    rng: random.Random) -> tuple[Path, str, list[str]]:
    """A PML library of a 1,024-token system and 16 root documents (the default tokenizer
    makes about 0.68 words a token of this text): its path, the system text, the documents."""
    def text(n_tokens: int, start: int) -> str:
        return " ".join(words[(start + j) % len(words)] for j in range(int(0.68 * n_tokens)))
    system = text(1024, 0)
    docs = [f"Document {i}. {text(rng.randint(*doc_tokens), 131 * i + 7)}" for i in range(16)]
    path = work / f"library-{doc_tokens[1]}.pml"
    path.write_text(f'<schema name="docs" mode="exact">\n  <system>{escape(system)}</system>\n'
                    + "".join(f'  <module name="doc{i}">{escape(d)}</module>\n' for i, d in enumerate(docs))
                    + "</schema>\n")
    return path, system, docs


def modules(work: Path, say: Say) -> list[dict]:
    from relaycli.bench.roofline import ModelShape
    from relaycli.models.dummy import PRESETS

    words = (ROOT / "examples/system_prompt.txt").read_text().split()
    results = []
    for preset, doc_tokens in (("llama3-8b", (2048, 4096)), ("llama2-7b", (1536, 2432))):
        rng = random.Random(0)
        library, system_text, doc_texts = modules_library(work, words, doc_tokens, rng)
        kv, sys_kv = work / f"library-{preset}.relaykv", work / f"system-{preset}.relaykv"
        (work / "system.txt").write_text(system_text)
        model = ("--model", f"dummy:{preset}", "--dtype", "bfloat16")
        took, _ = relay("compile-prompt", library, "--out", kv, *model, "--quiet")
        relay("compile-prompt", work / "system.txt", "--out", sys_kv, *model, "--quiet")
        _, res = relay("inspect", kv, "--json")
        meta = json.loads(res.stdout)
        say({"compile": preset, "seconds": round(took, 1)})
        rows = [{"id": str(i), "modules": [f"doc{rng.randrange(16)}"], "max_tokens": rng.randint(64, 256),
                 "prompt": " ".join(rng.choice(words) for _ in range(int(0.68 * rng.randint(32, 128)))),
                 "ignore_eos": True, "temperature": 0} for i in range(1000)]
        # the same rows without modules: the document in the row's own prompt, prefilled per row
        whole = [{k: v for k, v in r.items() if k != "modules"} | {"prompt": doc_texts[int(r["modules"][0][3:])]
                                                                   + "\n\n" + r["prompt"]} for r in rows]
        jobs = write_jsonl(work / f"modules-{preset}.jsonl", rows)
        common = (*model, "--max-batch", 256)
        trio = [run_job(say, f"modules-{preset}", work, jobs, [kv], *common),
                run_job(say, f"modules-{preset}-no-relay", work, jobs, [kv], *common, "--no-relay"),
                run_job(say, f"modules-{preset}-full-prefill", work, write_jsonl(work / "whole.jsonl", whole),
                        [sys_kv], *common)]
        # Bytes a full-batch decode step reads when each path's prefix (the system and one
        # document) is read once for all its rows, and when each row reads its own.
        shape = ModelShape.from_config(type("C", (), PRESETS[preset])(), 2)
        seg_tokens = [seg["end"] - seg["start"] for seg in meta["segments"]]
        system, docs = seg_tokens[0], seg_tokens[1:]
        own = 80 + 160 / 2  # a row's own tokens in the middle of its answer, on average
        batch, doc_mean = 256, sum(docs) / len(docs)
        once = shape.weight_bytes + shape.kv_bytes_per_token * (len(docs) * system + sum(docs) + batch * own)
        per_row = shape.weight_bytes + shape.kv_bytes_per_token * batch * (system + doc_mean + own)
        for row in trio[:2]:
            step = row["decode_step_p50_ms"] / 1e3
            row.update(segment_tokens=seg_tokens, bytes_paths_once_gb=round(once / 1e9, 1),
                       bytes_per_row_gb=round(per_row / 1e9, 1),
                       tb_per_s_if_paths_once=round(once / step / 1e12, 2) if step else None,
                       tb_per_s_if_per_row=round(per_row / step / 1e12, 2) if step else None)
        trio[0]["relay_over_no_relay"] = round(trio[0]["rows_per_second"] / trio[1]["rows_per_second"], 2)
        trio[0]["relay_over_full_prefill"] = round(trio[0]["rows_per_second"] / trio[2]["rows_per_second"], 2)
        say(trio[0])
        results += trio
        if preset == "llama3-8b":  # a library larger than its room: paths dropped and built again
            by_doc = write_jsonl(work / "by-doc.jsonl", sorted(rows, key=lambda r: int(r["modules"][0][3:])))
            for name, file in (("", jobs), ("-sorted", by_doc)):
                row = run_job(say, f"modules-{preset}-prefix-2gb{name}", work, file, [kv], *common,
                              "--prefix-cache-gb", 2)
                row["over_unbounded"] = round(row["rows_per_second"] / trio[0]["rows_per_second"], 2)
                results.append(row)
    return results


def _has_cuda() -> bool:
    """A CUDA GPU is there: the jobs (2,000-row jobs, bf16 8B-shaped dummy models, CUDA
    graphs) are sized for one and have no CPU mode."""
    import torch
    return torch.cuda.is_available()


def run_parts(parts: list[str], out: Path, say: Say) -> list[dict]:
    """Run the parts in order, each job's row given to say as it ends; out/jobs.json holds
    them all, rewritten after each part."""
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part {unknown[0]!r}; the parts are {', '.join(PARTS)}")
    if not _has_cuda():
        raise ValueError("relay bench jobs needs a CUDA GPU and this machine has none; run it on a CUDA machine "
                         "(relay bench e2e --through-run measures relay run on any device)")
    if not (ROOT / "examples/system_prompt.txt").is_file():
        raise ValueError("relay bench jobs reads the repository's examples/; run it from a checkout")
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for part in parts:
            results += {"examples": examples, "mixed": mixed, "modules": modules,
                        "cold": lambda w, s: examples(w, s, cold=True)}[part](work, say)
            (out / "jobs.json").write_text(json.dumps(results, indent=1))
    return results

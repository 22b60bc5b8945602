"""CPU end-to-end benchmark on the default model: relay vs --no-relay vs transformers.

64 requests share a ~2,000-token system prompt (examples/system_prompt.txt); each
generates exactly 64 tokens (greedy, EOS ignored). Systems:
  relay      the engine with RelayAttention (system KV read once per batch)
  no-relay   the same engine, prefix KV shared in memory but read once per request
  hf         transformers' batched generate, fed the system prompt's KV computed once
             and copied into every request's cache (the fairest use of transformers)
Prints a table and writes JSON. Usage: python scripts/bench_cpu.py [--requests 64] [--out F]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from relaycli.models.registry import default_gguf_path, load_model
from relaycli.compile import compile_prompt, load_checked, read_system_text
from relaycli.config import EngineConfig
from relaycli.engine.engine import Engine
from relaycli.io.requests import RequestRow, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def user_questions(n: int) -> list[str]:
    rows = [json.loads(line) for line in (ROOT / "examples/requests.jsonl").read_text().splitlines() if line.strip()]
    prompts = [r["prompt"] if "prompt" in r else r["messages"][-1]["content"] for r in rows
               if "prompt" in r or r["messages"][0]["role"] != "system"]
    return [prompts[i % len(prompts)] for i in range(n)]


def run_engine(lm, art, questions, max_tokens, relay: bool, max_batch: int):
    rows = [RequestRow(i, str(i), [{"role": "user", "content": q}],
                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for i, q in enumerate(questions)]
    engine = Engine(lm, [art], EngineConfig(max_num_seqs=max_batch, relay=relay))
    start = time.perf_counter()
    out = sorted(engine.generate(rows), key=lambda r: r.row_index)
    elapsed = time.perf_counter() - start
    st = engine.stats
    return {"seconds": elapsed, "generated_tokens": st.completion_tokens,
            "tokens_per_second": st.completion_tokens / elapsed, "requests_per_second": len(rows) / elapsed,
            "prefill_seconds": st.prefill_seconds, "decode_step_ms": 1000 * st.decode_seconds / max(st.decode_steps, 1),
            "texts": [r.text for r in out]}


@torch.inference_mode()
def run_hf(lm, system_text, questions, max_tokens):
    from transformers import AutoModelForCausalLM, DynamicCache
    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    # Like relay's ignore_eos: keep the argmax even when it is EOS. (min_new_tokens alone
    # would mask EOS out and change the greedy choice.)
    model.generation_config.eos_token_id = None
    tok = lm.tokenizer
    start = time.perf_counter()
    prefix = torch.tensor([load_prefix_ids(lm, system_text)])
    cache = DynamicCache()
    model(prefix, past_key_values=cache, use_cache=True)
    n, s = len(questions), prefix.shape[1]
    full = [tok.render([{"role": "system", "content": system_text}, {"role": "user", "content": q}]) for q in questions]
    own = [ids[s:] for ids in full]
    width = max(len(o) for o in own)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    # System part, then left padding masked out, then the request's own tokens: the
    # positions generate derives from the mask stay those of the unpadded prompt.
    ids = torch.tensor([full[i][:s] + [pad] * (width - len(own[i])) + own[i] for i in range(n)])
    mask = torch.tensor([[1] * s + [0] * (width - len(own[i])) + [1] * len(own[i]) for i in range(n)])
    batch_cache = copy.deepcopy(cache)
    batch_cache.batch_repeat_interleave(n)
    out = model.generate(ids, attention_mask=mask, past_key_values=batch_cache, max_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    gen = out[:, ids.shape[1]:]
    texts = [tok.decode(row.tolist()) for row in gen]  # skip_special_tokens, as relay's text
    return {"seconds": elapsed, "generated_tokens": int(gen.numel()), "tokens_per_second": gen.numel() / elapsed,
            "requests_per_second": n / elapsed, "texts": texts}


def load_prefix_ids(lm, system_text):
    from relaycli.compile import shared_prefix_ids
    return shared_prefix_ids(lm.tokenizer, system_text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--systems", default="relay,no-relay,hf")
    ap.add_argument("--out", type=Path, default=Path("bench_cpu.json"))
    args = ap.parse_args()
    lm = load_model(None, dtype="float32", device="cpu")
    system_text = read_system_text(ROOT / "examples/system_prompt.txt")
    art_path = Path("bench_sys.relaykv")
    compiled = compile_prompt(lm, system_text, art_path)
    art = load_checked(art_path, lm)
    questions = user_questions(args.requests)
    results = {"machine": {"threads": torch.get_num_threads(), "torch": torch.__version__},
               "system_prompt_tokens": compiled.num_tokens, "compile_seconds": compiled.seconds,
               "requests": args.requests, "max_tokens": args.max_tokens, "systems": {}}
    for name in args.systems.split(","):
        if name == "hf":
            r = run_hf(lm, system_text, questions, args.max_tokens)
        else:
            r = run_engine(lm, art, questions, args.max_tokens, name == "relay", args.max_batch)
        results["systems"][name] = r
        print(f"{name:9s} {r['seconds']:8.1f} s  {r['tokens_per_second']:8.1f} tok/s", flush=True)
    systems = results["systems"]
    if "relay" in systems:
        for name, r in systems.items():
            r["relay_speedup"] = systems["relay"]["tokens_per_second"] / r["tokens_per_second"]
            if name != "relay":
                same = sum(a == b for a, b in zip(r["texts"], systems["relay"]["texts"]))
                r["identical_texts_vs_relay"] = f"{same}/{len(r['texts'])}"
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\n{'system':9s} {'seconds':>8s} {'tok/s':>8s} {'relay x':>8s} {'same text':>10s}")
    for name, r in systems.items():
        print(f"{name:9s} {r['seconds']:8.1f} {r['tokens_per_second']:8.1f} {r.get('relay_speedup', 0):8.2f} "
              f"{r.get('identical_texts_vs_relay', '-'):>10s}")


if __name__ == "__main__":
    main()

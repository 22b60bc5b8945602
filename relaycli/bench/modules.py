"""Prompt modules measured: time to first token against a full prefill of the same
tokens, and how often independent modules (Prompt Cache's way) keep full prefill's greedy
choice. Generated town reports serve as documents, so nothing is downloaded.

`ttft` compiles an exact library whose one path holds about `module_tokens` tokens and
times one short question through the engine (max_tokens 1): with the library (the first
row of a path builds its prefix: `cold`; later rows reuse it: `warm`) and without any
prefix, the same token sequence prefilled whole. `independent_agreement` compiles an
independent library of two unions of documents, asks questions of one document beside
another, takes full prefill's greedy answer, and teacher-forces it through the modules'
KV: the share of answer tokens whose greedy choice is the same (`control_agreement`: the
same teacher forcing over the whole sequence without modules, which should be 1).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from relaycli.compile import load_checked
from relaycli.config import EngineConfig
from relaycli.engine.engine import Engine, TokenRequest
from relaycli.engine.sequence import SamplingOptions
from relaycli.io.requests import RequestRow, SamplingParams
from relaycli.kernels.reference import attention_lse
from relaycli.module_compile import compile_library
from relaycli.module_rows import Library
from relaycli.modules import Module, Schema

SYSTEM = "You answer questions about town reports. Answer in one short sentence, using only the reports."
_SYL = ("bar", "len", "tor", "vik", "mar", "sol", "dun", "ash", "kel", "rim", "ost", "fal", "gor", "wen")
_RIVERS = ("Amber", "Silt", "Crane", "Otter", "Gray", "Willow", "Stone", "Reed", "Lark", "Birch")
_GOODS = ("wool", "salt", "glass", "timber", "cheese", "copper", "paper", "rope", "honey", "tin")
_PEOPLE = ("Ada Moss", "Ben Holt", "Cora Vale", "Dan Roe", "Eva Lind", "Finn Shaw", "Gia Pike", "Hal Brook")
_FILLER = ("The market opens on {day}s and draws traders from the valley.",
           "In {year} a flood damaged the old bridge, which was rebuilt in stone.",
           "The school teaches {n} children and keeps a small library of maps.",
           "Most houses are built of {good}-coloured brick with slate roofs.",
           "A festival of lanterns is held every autumn on the main square.",
           "The road to the coast passes {n} farms and an inn called The Heron.")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")


def make_docs(count: int, sentences: int, seed: int = 0) -> list[dict]:
    """Town reports: name, text, and the facts questions ask about."""
    rng = random.Random(seed)
    docs, names = [], set()
    while len(docs) < count:
        name = "".join(rng.choice(_SYL) for _ in range(2)).capitalize()
        if name in names:
            continue
        names.add(name)
        facts = {"river": rng.choice(_RIVERS), "mayor": rng.choice(_PEOPLE), "good": rng.choice(_GOODS),
                 "people": rng.randrange(800, 90000)}
        lines = [f"Report on {name}.", f"{name} lies on the river {facts['river']}.",
                 f"The mayor of {name} is {facts['mayor']}.", f"{name} has {facts['people']} inhabitants.",
                 f"The main export of {name} is {facts['good']}."]
        for _ in range(sentences):
            lines.append(rng.choice(_FILLER).format(day=rng.choice(_DAYS), year=rng.randrange(1700, 2000),
                                                    n=rng.randrange(3, 400), good=rng.choice(_GOODS)))
        docs.append({"name": name, "text": " ".join(lines), "facts": facts})
    return docs


QUESTIONS = ("Which river does {name} lie on?", "Who is the mayor of {name}?", "What does {name} export?")


@torch.inference_mode()
def forward_logits(loaded, ids: list[int], prefix=None, first_position: int = 0) -> torch.Tensor:
    """Logits [len(ids), vocab] of ids at first_position.., attending to prefix (per-layer
    K, V [P, Hkv, D], keys after RoPE) and causally to themselves: plain PyTorch, the
    reference the engine's module rows are checked against."""
    model, cfg = loaded.model, loaded.config
    n, ctx = len(ids), 0 if prefix is None else prefix[0][0].shape[0]
    mask = (torch.arange(ctx + n)[None, :] <= torch.arange(ctx, ctx + n)[:, None])[None]
    scale = cfg.head_dim ** -0.5

    def attend(layer, q, k, v):
        keys = k if prefix is None else torch.cat([prefix[0][layer], k])
        values = v if prefix is None else torch.cat([prefix[1][layer], v])
        return attention_lse(q[None], keys[None], values[None], scale, mask)[0][0]

    hidden = model(torch.tensor(ids), torch.arange(first_position, first_position + n), attend)
    return model.compute_logits(hidden)


def library_prefix(art, path: tuple[str, ...]):
    """The KV of the system prompt and a path's modules, as the engine builds it."""
    lib = Library(0, art.name, art.meta)
    rows = lib.rows(path)
    return ([torch.cat([k[a:b] for a, b in rows]) for k in art.keys],
            [torch.cat([v[a:b] for a, b in rows]) for v in art.values])


def sequence_ids(loaded, art, path: tuple[str, ...], question: str) -> list[int]:
    """The whole token sequence a module row stands for (system, modules, own tokens)."""
    full = loaded.tokenizer.render([{"role": "system", "content": art.system_text},
                                    {"role": "user", "content": question}])
    num = len(art.token_ids)
    segs = {s["name"]: s for s in art.meta["segments"][1:]}
    return full[:num] + [t for name in path for t in segs[name]["token_ids"]] + full[num:]


def ttft(loaded, module_tokens: int = 3000, depth: int = 3, repeats: int = 5, folder: Path | None = None) -> dict:
    """Seconds to the first token, module library vs full prefill of the same tokens."""
    per_doc = max(1, module_tokens // depth)
    docs = []
    for i, doc in enumerate(make_docs(depth, sentences=12, seed=1)):
        text, extra = doc["text"], make_docs(64, sentences=12, seed=100 + i)
        k = 0
        while len(loaded.tokenizer.encode(text)) < per_doc:
            text += " " + extra[k % 64]["text"]
            k += 1
        ids = loaded.tokenizer.encode(text)[:per_doc]
        docs.append(loaded.tokenizer.decode(ids))
    modules = [Module(f"doc{i}", 0, None if i == 0 else f"doc{i - 1}", None, [t]) for i, t in enumerate(docs)]
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = Path(tmp) / "bench.relaykv"
        compile_library(loaded, Schema("bench", "exact", SYSTEM, modules), path)
        art = load_checked(path, loaded)
        names = tuple(m.name for m in modules)
        questions = [f"Question {i}: what is the main export of the first town?" for i in range(repeats + 1)]
        cfg = EngineConfig(max_num_seqs=4, kv_cache_gb=0.25)
        relay = Engine(loaded, [art], cfg)
        times = []
        for q in questions:
            row = RequestRow(0, "0", [{"role": "user", "content": q}], modules=[{"name": n} for n in names],
                             sampling=SamplingParams(max_tokens=1, temperature=0))
            started = time.perf_counter()
            result = next(iter(relay.generate([row])))
            times.append(time.perf_counter() - started)
            assert result.finish_reason != "error", result.error
        full = Engine(loaded, [], cfg)
        full_times = []
        for q in questions[:max(3, repeats // 2 + 1)]:
            req = TokenRequest(0, "0", sequence_ids(loaded, art, names, q), SamplingOptions(1))
            started = time.perf_counter()
            next(iter(full.generate_tokens([req])))
            full_times.append(time.perf_counter() - started)
        tokens = len(sequence_ids(loaded, art, names, questions[0]))
    warm, base = statistics.median(times[1:]), statistics.median(full_times[1:])  # the first: a warm-up
    return {"module_tokens": art.meta["segments"][-1]["end"] - len(art.token_ids), "prompt_tokens": tokens,
            "relay_cold_s": times[0], "relay_warm_s": warm, "full_prefill_s": base,
            "speedup_warm": base / warm, "speedup_cold": base / times[0], "threads": torch.get_num_threads()}


def independent_agreement(loaded, docs_per_union: int = 6, answer_tokens: int = 16,
                          folder: Path | None = None) -> dict:
    """Greedy agreement of independent modules with full prefill, teacher-forced, over
    docs_per_union**2 * len(QUESTIONS) question/document pairs."""
    docs = make_docs(2 * docs_per_union, sentences=3, seed=7)
    modules = [Module(f"town{i}", 0, None, i // docs_per_union, [d["text"]]) for i, d in enumerate(docs)]
    pairs = []
    for a in range(docs_per_union):
        for b in range(docs_per_union, 2 * docs_per_union):
            for k, q in enumerate(QUESTIONS):
                asked = docs[a if k % 2 == 0 else b]
                pairs.append(((f"town{a}", f"town{b}"), q.format(name=asked["name"])))
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = Path(tmp) / "indep.relaykv"
        compile_library(loaded, Schema("indep", "independent", SYSTEM, modules), path)
        art = load_checked(path, loaded)
        lib = Library(0, art.name, art.meta)
        reqs = [TokenRequest(i, str(i), sequence_ids(loaded, art, p, q), SamplingOptions(answer_tokens))
                for i, (p, q) in enumerate(pairs)]
        full = Engine(loaded, [], EngineConfig(max_num_seqs=16, kv_cache_gb=0.25), record_token_ids=True)
        for _ in full.generate_tokens(reqs):
            pass
        same = total = first = control = 0
        num = len(art.token_ids)
        for i, (p, q) in enumerate(pairs):
            answer = full.token_ids_by_row[i]
            own = reqs[i].own_ids[num + sum(len(lib.segments[n]["token_ids"]) for n in p):]
            logits = forward_logits(loaded, own + answer[:-1], library_prefix(art, p), lib.next_position)
            picks = logits[len(own) - 1:].argmax(-1).tolist()
            hits = [a == b for a, b in zip(picks, answer)]
            same, total, first = same + sum(hits), total + len(hits), first + hits[0]
            # the control: the same teacher forcing over the whole sequence, no modules
            whole = forward_logits(loaded, reqs[i].own_ids + answer[:-1])[len(reqs[i].own_ids) - 1:].argmax(-1)
            control += sum(a == b for a, b in zip(whole.tolist(), answer))
    return {"pairs": len(pairs), "answer_tokens": total, "agreement": same / total, "first_token_agreement":
            first / len(pairs), "control_agreement": control / total, "threads": torch.get_num_threads()}

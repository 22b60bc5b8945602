"""Prompt-module libraries on the default model: the artifact (round trip, refusals), rows
that name modules (exact ones token-identical to transformers on the same token sequence,
independent ones to a plain PyTorch forward at the schema's positions), and bad rows."""

from __future__ import annotations

import json
import math
import struct
import weakref

import pytest
import torch
from typer.testing import CliRunner

from relaycli.artifact import ArtifactError, ChecksumError, read_artifact
from relaycli.bench.modules import forward_logits, library_prefix, sequence_ids
from relaycli.cli import app
from relaycli.compile import load_checked, prefill_kv
from relaycli.config import EngineConfig
from relaycli.engine import model_runner
from relaycli.engine.engine import Engine
from relaycli.engine.module_prefixes import path_tokens
from relaycli.io.requests import derive_seed, parse_request
from relaycli.kernels.metadata import LayerPrefixes
from relaycli.module_compile import compile_library
from relaycli.modules import parse_schema

transformers = pytest.importorskip("transformers")

EXACT = """<schema name="shop">
  <system>You answer questions about the Lumen shop in one sentence.</system>
  <module name="policy">Refunds need the receipt and are paid within 14 days.</module>
  <module name="contract" after="policy">Contract 17: Harbor Bakery rents two printers.</module>
  <module name="clause" after="contract">Clause A: a broken printer is replaced in two days.</module>
  <union>
    <module name="basic" after="policy">Basic plan for <parameter name="months" len="3"/> months, email only.</module>
    <module name="pro" after="policy">Pro plan, phone support every day.</module>
  </union>
</schema>"""

INDEPENDENT = """<schema name="towns" mode="independent">
  <system>You answer questions about towns in one sentence.</system>
  <union>
    <module name="ostby">Ostby lies on the river Amber. Its mayor is Ada Moss.</module>
    <module name="kelrim">Kelrim lies on the river Silt and exports salt to the coast.</module>
  </union>
  <module name="falgor">Falgor lies on the river Reed. Its mayor is Ben Holt.</module>
</schema>"""

TOKENS = 8


def _compile(default_model, tmp_path_factory, text: str, name: str):
    path = tmp_path_factory.mktemp("lib") / f"{name}.relaykv"
    compile_library(default_model, parse_schema(text, path.with_suffix(".pml")), path)
    return path


@pytest.fixture(scope="module")
def exact(default_model, tmp_path_factory):
    return _compile(default_model, tmp_path_factory, EXACT, "shop")


@pytest.fixture(scope="module")
def independent(default_model, tmp_path_factory):
    return _compile(default_model, tmp_path_factory, INDEPENDENT, "towns")


@pytest.fixture(scope="module")
def hf_model():
    from relaycli.models.registry import default_gguf_path
    gguf = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    return model.eval()


def _rows(raws):
    return [parse_request(dict(r, max_tokens=TOKENS, temperature=0), i) for i, r in enumerate(raws)]


def test_a_library_round_trips_with_segments_and_exact_kv(default_model, exact):
    art = read_artifact(exact)
    assert art.is_library and art.meta["format_version"] == 2
    segs = {s["name"]: s for s in art.meta["segments"]}
    assert list(segs) == ["system", "policy", "contract", "clause", "basic", "pro"]
    assert art.meta["schema"] == {"name": "shop", "mode": "exact", "next_position": None}
    assert segs["clause"]["after"] == ["system", "policy", "contract"]
    assert segs["basic"]["position"] == segs["pro"]["position"] == segs["contract"]["position"]
    assert [item.get("parameter") for item in segs["basic"]["rest"]] == ["months", None]
    # the clause's KV is that of the whole chain prefilled at once, at the clause's rows
    path = ("policy", "contract", "clause")
    ids = art.token_ids + [t for n in path for t in segs[n]["token_ids"]]
    keys, values = prefill_kv(default_model, ids)
    prefix = library_prefix(art, path)
    for i in range(default_model.config.num_hidden_layers):
        for got, want in ((prefix[0][i], keys[i]), (prefix[1][i], values[i])):
            assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5, i


def _hf_greedy(hf_model, ids):
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=TOKENS, do_sample=False, pad_token_id=2)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("relay", [True, False])
def test_exact_module_rows_match_transformers_on_the_same_tokens(default_model, exact, hf_model, relay):
    art = load_checked(exact, default_model)
    raws = [{"prompt": "How long do refunds take?", "modules": ["contract", "policy"]},
            {"prompt": "When is a broken printer replaced?", "modules": ["policy", "contract", "clause"]},
            {"prompt": "Can I phone you?", "modules": ["policy", "pro"]},
            {"prompt": "How long is my plan?", "modules": ["policy", {"name": "basic", "months": "6"}]},
            {"prompt": "Who are you?", "schema": "shop"}]
    engine = Engine(default_model, [art], EngineConfig(max_num_seqs=8, kv_cache_gb=0.1, relay=relay),
                    record_token_ids=True)
    results = {r.row_index: r for r in engine.generate(_rows(raws))}
    tok = default_model.tokenizer
    segs = {s["name"]: s for s in art.meta["segments"][1:]}
    paths = [("policy", "contract"), ("policy", "contract", "clause"), ("policy", "pro"), ("policy", "basic"), ()]
    for i, (raw, path) in enumerate(zip(raws, paths)):
        ids = sequence_ids(default_model, art, path, raw["prompt"])
        if i == 3:  # the parameter's value and the module's text after it come before the row's own tokens
            cut = len(art.token_ids) + len(segs["policy"]["token_ids"]) + len(segs["basic"]["token_ids"])
            ids = ids[:cut] + tok.encode("6") + segs["basic"]["rest"][1]["ids"] + ids[cut:]
        r = results[i]
        assert r.error is None and r.prompt_tokens == len(ids)
        assert r.cached_tokens == len(art.token_ids) + sum(len(segs[n]["token_ids"]) for n in path)
        want = _hf_greedy(hf_model, ids)
        assert engine.token_ids_by_row[i] == want[:len(engine.token_ids_by_row[i])], (i, r.text, tok.decode(want))
    assert engine.modules.built == 4  # one prefix per distinct path; the row without modules uses the library's


def test_completions_of_a_module_row_equal_its_one_answer_rows(default_model, exact):
    """n completions fork after the row's prefill and keep its module positions."""
    art = load_checked(exact, default_model)

    def answers(raws):
        engine = Engine(default_model, [art], EngineConfig(max_num_seqs=8, kv_cache_gb=0.1))
        rows = [parse_request(dict(r, max_tokens=TOKENS, temperature=0.9), i) for i, r in enumerate(raws)]
        return {r.row_index: r for r in engine.generate(rows)}

    raw = {"prompt": "Can I phone you?", "modules": ["policy", {"name": "basic", "months": "6"}], "seed": 5}
    got = answers([dict(raw, n=3)])[0]
    want = answers([dict(raw, seed=5 if i == 0 else derive_seed(5, i)) for i in range(3)])
    assert got.error is None and len(got.completions) == 3
    assert [c["text"] for c in got.completions] == [want[i].text for i in range(3)]


def test_bad_module_rows_are_error_rows_and_the_job_goes_on(default_model, exact):
    art = load_checked(exact, default_model)
    raws = [{"prompt": "q", "modules": ["nope"]},
            {"prompt": "q", "modules": ["policy", "basic", "pro"]},
            {"prompt": "q", "modules": ["policy", {"name": "basic", "months": "one two three four five six"}]},
            {"prompt": "q", "modules": ["policy", "basic"]},
            {"prompt": "q", "modules": ["policy", {"name": "pro", "months": "2"}]},
            {"prompt": "q", "modules": ["clause"]},
            {"prompt": "q", "modules": ["policy", "contract", "pro"]},
            {"prompt": "q", "modules": ["policy"], "schema": "other"},
            {"messages": [{"role": "system", "content": "Another system text."}, {"role": "user", "content": "q"}],
             "modules": ["policy"]},
            {"prompt": "fine", "modules": ["policy"]}]
    engine = Engine(default_model, [art], EngineConfig(max_num_seqs=8, kv_cache_gb=0.1))
    results = {r.row_index: r for r in engine.generate(_rows(raws))}
    errors = [results[i].error for i in range(len(raws) - 1)]
    expected = ["module 'nope' is not in library 'shop'", "'basic' and 'pro' are alternatives of one union",
                "parameter 'months' of module 'basic' is", "module 'basic' needs parameter 'months'",
                "module 'pro' has no parameter 'months' (it has none)", "add 'contract'",
                "'contract' and 'pro' are on different branches", "schema 'other' names no loaded module library",
                "system message is not the system text of library 'shop'"]
    for i, (got, want) in enumerate(zip(errors, expected)):
        assert got is not None and got.startswith(f"row {i}: ") and want in got, (i, got)
    assert results[len(raws) - 1].finish_reason in ("stop", "length")


def test_independent_rows_take_the_schema_positions(default_model, independent):
    art = load_checked(independent, default_model)
    meta = art.meta
    segs = {s["name"]: s for s in meta["segments"][1:]}
    assert segs["ostby"]["position"] == segs["kelrim"]["position"] == len(art.token_ids)
    assert segs["falgor"]["position"] == len(art.token_ids) + max(len(segs[n]["token_ids"]) for n in ("ostby", "kelrim"))
    nxt = meta["schema"]["next_position"]
    assert nxt == segs["falgor"]["position"] + len(segs["falgor"]["token_ids"])
    raws = [{"prompt": "Who is the mayor of Falgor?", "modules": ["falgor", "kelrim"]},
            {"prompt": "Which river does Ostby lie on?", "modules": ["ostby"]}]
    engine = Engine(default_model, [art], EngineConfig(max_num_seqs=8, kv_cache_gb=0.1), record_token_ids=True)
    results = {r.row_index: r for r in engine.generate(_rows(raws))}
    for i, path in enumerate([("kelrim", "falgor"), ("ostby",)]):
        prefix = library_prefix(art, path)
        own = sequence_ids(default_model, art, (), raws[i]["prompt"])[len(art.token_ids):]
        want = []
        for _ in range(TOKENS):  # greedy by plain PyTorch: the prefix's KV, own tokens from next_position
            want.append(int(forward_logits(default_model, own + want, prefix, nxt)[-1].argmax()))
        got = engine.token_ids_by_row[i]
        assert results[i].error is None and got == want[:len(got)], (i, got, want)


def _flip(path, tmp_path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    out = tmp_path / "bad.relaykv"
    out.write_bytes(bytes(data))
    return out


def _edit_meta(path, tmp_path, fn, reseal):
    from relaycli.artifact import _meta_digest
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = json.loads(header["__metadata__"]["relay"])
    fn(meta)
    if reseal:
        meta["meta_checksum"] = _meta_digest(meta)
    header["__metadata__"]["relay"] = json.dumps(meta)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    out = tmp_path / "edited.relaykv"
    out.write_bytes(struct.pack("<Q", len(head)) + head + data[8 + n:])
    return out


def test_a_corrupt_or_inconsistent_library_is_refused(exact, tmp_path):
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        read_artifact(_flip(exact, tmp_path, exact.stat().st_size - 100))

    def other_token(meta):
        meta["segments"][2]["token_ids"][0] += 1

    with pytest.raises(ChecksumError, match="metadata checksum mismatch"):
        read_artifact(_edit_meta(exact, tmp_path, other_token, reseal=False))

    def shift(meta):
        meta["segments"][2]["position"] += 1

    with pytest.raises(ArtifactError, match="segment 'contract' is not placed right after its parent chain"):
        read_artifact(_edit_meta(exact, tmp_path, shift, reseal=True))

    def drop_ids(meta):
        meta["segments"][1]["token_ids"].pop()

    with pytest.raises(ArtifactError, match="segment 'policy' has token_ids that do not match its rows"):
        read_artifact(_edit_meta(exact, tmp_path, drop_ids, reseal=True))

    def no_schema(meta):
        del meta["schema"]

    with pytest.raises(ArtifactError, match="metadata field schema is not"):
        read_artifact(_edit_meta(exact, tmp_path, no_schema, reseal=True))


def test_compile_prompt_refuses_a_malformed_schema_before_the_model_loads(tmp_path):
    bad = tmp_path / "bad.pml"
    bad.write_text('<schema name="x"><system>S</system>\n<module name="b" after="a">B</module></schema>')
    result = CliRunner().invoke(app, ["compile-prompt", str(bad), "--model", "/no/such/model"])
    assert result.exit_code == 2
    assert "line 2: module 'b' is after 'a'" in result.output and "define the parent module first" in result.output


def test_the_example_library_compiles_and_runs_through_the_cli(tmp_path):
    from pathlib import Path
    examples = Path(__file__).resolve().parent.parent / "examples"
    lib = tmp_path / "support.relaykv"
    runner = CliRunner()
    result = runner.invoke(app, ["compile-prompt", str(examples / "support.pml"), "--out", str(lib), "--quiet"])
    assert result.exit_code == 0, result.output
    shown = runner.invoke(app, ["inspect", str(lib)])  # the modules' table: tokens, positions, parents
    segments = read_artifact(lib).meta["segments"]
    module_tokens = sum(s["end"] - s["start"] for s in segments[1:])
    assert shown.exit_code == 0 and f"+ {module_tokens} in 5 modules" in shown.output, shown.output
    for seg in segments[1:]:
        assert f"{seg['position']}-{seg['position'] + seg['end'] - seg['start'] - 1}" in shown.output
    out = tmp_path / "answers.jsonl"
    result = runner.invoke(app, ["run", "--in", str(examples / "module_requests.jsonl"), "--out", str(out),
                                 "--prompt", str(lib), "--max-tokens", "4", "--temperature", "0", "--quiet"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["m1", "m2", "m3", "m4", "m5", "m6", "m7"]
    assert all(r["error"] is None and r["cached_tokens"] > 0 for r in rows[:5])
    assert "alternatives of one union" in rows[5]["error"]
    # m7 asks m4's question in Prompt Cache's PML form: the same tokens, so the same answer
    assert rows[6]["error"] is None and rows[6]["text"] == rows[3]["text"]
    assert (rows[6]["prompt_tokens"], rows[6]["cached_tokens"]) == (rows[3]["prompt_tokens"], rows[3]["cached_tokens"])
    # room for the longest path alone (fp32 on the CPU: 46,080 bytes a token): the same answers
    longest = max(r["cached_tokens"] for r in rows if r["error"] is None)
    tight, stats = tmp_path / "tight.jsonl", tmp_path / "stats.json"
    result = runner.invoke(app, ["run", "--in", str(examples / "module_requests.jsonl"), "--out", str(tight),
                                 "--prompt", str(lib), "--max-tokens", "4", "--temperature", "0",
                                 "--prefix-cache-gb", f"{(longest + 0.5) * 46080 / 1024**3:.9f}", "--stats-json",
                                 str(stats), "--max-batch", "2"])
    assert result.exit_code == 0, result.output
    assert "dropped for room" in result.output  # the summary says what the room cost
    assert [json.loads(line)["text"] for line in tight.read_text().splitlines()] == [r["text"] for r in rows]
    assert json.loads(stats.read_text())["stats"]["module_paths_dropped"] > 0
    refused = runner.invoke(app, ["run", "--in", str(examples / "module_requests.jsonl"), "--out", str(tight),
                                  "--prompt", str(lib), "--prefix-cache-gb", "0"])
    assert refused.exit_code == 2 and "--prefix-cache-gb must be a positive number" in refused.output


def test_the_prefix_store_takes_later_paths_in_its_room_and_grows_past_it():
    def pair(n, fill, dtype=torch.float32):
        return torch.full((n, 2, 4), float(fill), dtype=dtype), torch.full((n, 2, 4), -float(fill), dtype=dtype)
    layer = LayerPrefixes.stored([pair(3, 1)], capacity=10)
    store = layer.store[0]
    assert store.shape[0] == 10 and layer.used == 3 and len(layer) == 1
    # a path of two pieces in another dtype (an artifact's rows): one slot, written in place,
    # so graphs that name the store stay valid
    layer = layer.appended([pair(2, 2, torch.float16), pair(2, 4, torch.float16)])
    assert layer.store[0] is store and layer.used == 7
    assert [k.shape[0] for k, _ in layer] == [3, 4] and layer[1][0].dtype == torch.float32
    assert layer[1][0][:, 0, 0].tolist() == [2, 2, 4, 4] and layer[1][1][:, 0, 0].tolist() == [-2, -2, -4, -4]
    assert layer[0][0].data_ptr() == store.data_ptr() and torch.all(store[7:] == 0)
    grown = layer.appended([pair(4, 3)])  # past the room: one new store holding all three
    assert grown.store[0] is not store and grown.used == 11 and grown.store[0].shape[0] == 11
    assert [float(k[0, 0, 0]) for k, _ in grown] == [1.0, 2.0, 3.0]
    assert [k.shape[0] for k, _ in layer] == [3, 4]  # the old list is left as it was


def test_the_engine_keeps_room_for_every_module_path_of_its_libraries(default_model, exact):
    art = load_checked(exact, default_model)
    segs = {s["name"]: s["end"] - s["start"] for s in art.meta["segments"]}
    chains = {"policy": ["policy"], "contract": ["policy", "contract"], "clause": ["policy", "contract", "clause"],
              "basic": ["policy", "basic"], "pro": ["policy", "pro"]}
    assert path_tokens([art]) == sum(segs["system"] + sum(segs[m] for m in c) for c in chains.values())
    assert path_tokens([]) == 0


def test_a_module_path_the_device_cannot_hold_is_an_error_row(default_model, exact, monkeypatch):
    art = load_checked(exact, default_model)
    engine = Engine(default_model, [art], EngineConfig(max_num_seqs=4, kv_cache_gb=0.1))

    def full(pairs, store=None, used=0):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(model_runner, "LayerPrefixes", full)  # what the CPU's prefix list is made of
    results = {r.row_index: r for r in engine.generate(_rows([{"prompt": "q", "modules": ["policy"]},
                                                               {"prompt": "Hello there"}]))}
    assert results[0].error.startswith("row 0: a shared prefix of ") and "lower --kv-cache-gb" in results[0].error
    assert results[1].error is None


def test_the_prefix_store_frees_dropped_slots_by_moving_the_others_down():
    def pair(n, fill):
        return torch.full((n, 2, 4), float(fill)), torch.full((n, 2, 4), -float(fill))
    layer = LayerPrefixes.stored([pair(1, 1), pair(5, 2), pair(2, 3)], capacity=12)
    store = layer.store[0]
    layer = layer.without({0})  # slot 1 moves down by one row: onto rows it held itself
    assert layer.store[0] is store and layer.used == 7
    assert [k.shape[0] for k, _ in layer] == [0, 5, 2]
    assert [float(k[0, 0, 0]) for k, _ in layer[1:]] == [2.0, 3.0] and layer[2][1][:, 0, 0].tolist() == [-3, -3]
    assert layer[1][0].data_ptr() == store.data_ptr() and torch.all(store[5:7, 0, 0] == 3)
    layer = layer.appended([pair(5, 4)])  # into the rows freed: the same store
    assert layer.store[0] is store and [k.shape[0] for k, _ in layer] == [0, 5, 2, 5] and layer.used == 12
    assert torch.all(layer[3][0] == 4)
    listed = LayerPrefixes([pair(3, 1), pair(2, 2)]).without({0})  # no store (CPU): the slot is emptied
    assert [k.shape[0] for k, _ in listed] == [0, 2] and listed.store is None


def test_an_emptied_slot_takes_the_next_prefix_in_the_stores_free_rows():
    def pair(n, fill):
        return torch.full((n, 2, 4), float(fill)), torch.full((n, 2, 4), -float(fill))
    layer = LayerPrefixes.stored([pair(2, 1), pair(3, 2), pair(1, 3)], capacity=12).without({0})
    store = layer.store[0]
    assert layer.ranges() == [(0, 0), (0, 3), (3, 1)]
    layer = layer.appended([pair(4, 4)], slot=0)  # slot 0 again, its rows at the end of those in use
    assert layer.store[0] is store and layer.ranges() == [(4, 4), (0, 3), (3, 1)] and torch.all(layer[0][0] == 4)
    # a drop moves the others down in the order of their rows, whatever their slots
    layer = layer.without({1})
    assert layer.ranges() == [(1, 4), (0, 0), (0, 1)] and layer.used == 5
    assert torch.all(layer[0][0] == 4) and torch.all(layer[2][0] == 3) and torch.all(layer[0][1] == -4)
    # past the room, a new store of the capacity asked for, the slots in slot order
    grown = layer.appended([pair(9, 5)], slot=1, capacity=40)
    assert grown.store[0].shape[0] == 40 and grown.ranges() == [(0, 4), (4, 9), (13, 1)]
    assert [float(k[0, 0, 0]) for k, _ in grown] == [4.0, 5.0, 3.0]
    with pytest.raises(AssertionError, match="emptied slot"):
        grown.appended([pair(1, 6)], slot=2)


PATH_ROWS = [{"prompt": "How long do refunds take?", "modules": ["contract", "policy"]},
             {"prompt": "Can I phone you?", "modules": ["policy", "pro"]},
             {"prompt": "When is a broken printer replaced?", "modules": ["policy", "contract", "clause"]},
             {"prompt": "Who are you?", "schema": "shop"},
             {"prompt": "How long is my plan?", "modules": ["policy", {"name": "basic", "months": "6"}]},
             {"prompt": "Do you sell paper?", "modules": ["policy", "pro"]},
             {"prompt": "Is the printer fixed soon?", "modules": ["policy", "contract", "clause"]},
             {"prompt": "Are refunds quick?", "modules": ["policy", "contract"]}]


def _path_run(default_model, exact, raws, **config):
    engine = Engine(default_model, [load_checked(exact, default_model)],
                    EngineConfig(max_num_seqs=2, kv_cache_gb=0.1, **config), record_token_ids=True)
    results = {r.row_index: r for r in engine.generate(_rows(raws))}
    return engine, results


def _gib_for(engine, tokens: float) -> float:
    return tokens * (engine.runner.bytes_per_block() // engine.runner.block_size) / 1024**3


def test_module_paths_past_prefix_cache_gb_are_dropped_built_again_and_answer_alike(default_model, exact):
    free, want = _path_run(default_model, exact, PATH_ROWS)
    assert all(r.error is None for r in want.values()) and free.stats.module_paths_dropped == 0
    art = load_checked(exact, default_model)
    segs = {s["name"]: s["end"] - s["start"] for s in art.meta["segments"]}
    longest = segs["system"] + segs["policy"] + segs["contract"] + segs["clause"]
    # room for the longest path alone: a row of another path waits for the rows in flight;
    # two rows read ahead, so a path dropped is needed again by a later row
    tight, got = _path_run(default_model, exact, PATH_ROWS, prefix_cache_gb=_gib_for(free, longest + 0.5),
                           max_pending_rows=2)
    assert all(r.error is None for r in got.values()), [r.error for r in got.values()]
    assert [tight.token_ids_by_row[i] for i in range(len(PATH_ROWS))] == \
        [free.token_ids_by_row[i] for i in range(len(PATH_ROWS))]
    assert [got[i].text for i in range(len(PATH_ROWS))] == [want[i].text for i in range(len(PATH_ROWS))]
    st = tight.stats
    assert st.module_paths_dropped > 0 and st.module_paths_built > free.stats.module_paths_built
    assert st.module_paths_built - st.module_paths_dropped == len(tight.modules.slots) == 1
    assert tight.runner.prefix_tokens <= tight.runner.max_prefix_tokens
    # the slots a drop empties are taken again: the library's own and one path's, not one a build
    assert len(tight.runner.prefixes) == 2 < 1 + st.module_paths_built
    assert not tight._waiting_room


def test_a_module_path_longer_than_prefix_cache_gb_is_an_error_row_and_the_job_goes_on(default_model, exact):
    engine, results = _path_run(default_model, exact, PATH_ROWS[:4], prefix_cache_gb=_gib_for(
        Engine(default_model, [], EngineConfig(max_num_seqs=2, kv_cache_gb=0.1)), 2))
    assert "--prefix-cache-gb" in results[0].error and results[0].error.startswith("row 0: ")
    assert results[2].error is not None and results[3].error is None  # the library's system prompt alone
    assert engine.stats.module_paths_built == 0


def _order(engine, raws):
    rows = [parse_request(dict(r, temperature=0, ignore_eos=True), i) for i, r in enumerate(raws)]
    return [r.row_index for r in engine.generate(rows)], engine


def test_a_waiting_path_is_admitted_as_soon_as_a_finished_row_frees_its_room(default_model, exact):
    art = load_checked(exact, default_model)
    segs = {s["name"]: s["end"] - s["start"] for s in art.meta["segments"]}
    q, r, w = (segs["system"] + segs["policy"] + segs[m] for m in ("contract", "pro", "basic"))
    probe = Engine(default_model, [], EngineConfig(max_num_seqs=2, kv_cache_gb=0.1))
    # room for q and r, or r and w: w waits for q's two tokens, not for r's forty
    engine = Engine(default_model, [art], EngineConfig(max_num_seqs=3, kv_cache_gb=0.1, max_pending_rows=3,
                                                       prefix_cache_gb=_gib_for(probe, max(q + r, r + w) + 0.5)))
    order, _ = _order(engine, [{"prompt": "Refunds?", "modules": ["policy", "contract"], "max_tokens": 2},
                               {"prompt": "Phone?", "modules": ["policy", "pro"], "max_tokens": 40},
                               {"prompt": "Plan?", "modules": ["policy", {"name": "basic", "months": "6"}],
                                "max_tokens": 2}])
    assert order == [0, 2, 1] and engine.stats.module_paths_dropped == 1


def test_time_waiting_for_room_counts_toward_a_rows_time_to_first_token(default_model, exact, monkeypatch):
    from relaycli.engine import engine as engine_module
    from relaycli.engine.module_prefixes import PrefixRoomBusy
    art = load_checked(exact, default_model)
    engine = Engine(default_model, [art], EngineConfig(max_num_seqs=2, kv_cache_gb=0.1))
    req = engine._to_token_request(parse_request({"prompt": "Refunds?", "modules": ["policy"], "max_tokens": 2}, 0))
    now = [10.0]
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: now[0])
    slot = engine.modules.slot
    answers = iter([PrefixRoomBusy(), None])

    def busy_once(pick, in_use):
        answer = next(answers)
        if answer is not None:
            raise answer
        return slot(pick, in_use)

    monkeypatch.setattr(engine.modules, "slot", busy_once)
    assert engine._admit(req) is None and list(engine._waiting_room) == [req]  # at 10.0: no room
    now[0] = 50.0
    assert engine._admit_waiting() == [] and not engine._waiting_room  # at 50.0: admitted
    (seq,) = engine.scheduler.waiting
    assert seq.arrival_time == 10.0


def test_a_path_longer_than_prefix_cache_gb_fails_at_once_while_others_run(default_model, exact):
    art = load_checked(exact, default_model)
    segs = {s["name"]: s["end"] - s["start"] for s in art.meta["segments"]}
    probe = Engine(default_model, [], EngineConfig(max_num_seqs=2, kv_cache_gb=0.1))
    engine = Engine(default_model, [art], EngineConfig(max_num_seqs=2, kv_cache_gb=0.1, prefix_cache_gb=_gib_for(
        probe, segs["system"] + segs["policy"] + 0.5)))  # room for the policy path alone
    rows = [parse_request(dict(r, temperature=0, ignore_eos=True), i) for i, r in enumerate(
        [{"prompt": "Refunds?", "modules": ["policy"], "max_tokens": 30},
         {"prompt": "Printer?", "modules": ["policy", "contract"], "max_tokens": 2}])]
    results = list(engine.generate(rows))
    assert [r.row_index for r in results] == [1, 0]
    assert "longer than --prefix-cache-gb" in results[0].error and results[1].error is None


def test_without_prefix_cache_gb_a_full_store_grows_instead_of_making_rows_wait(default_model, independent):
    art = load_checked(independent, default_model)
    engine = Engine(default_model, [art], EngineConfig(max_num_seqs=4, kv_cache_gb=0.1))
    runner = engine.runner  # the CPU keeps a prefix list: give it the store a CUDA runner keeps
    room = runner.prefix_tokens + path_tokens([art])
    runner.attention_impl = "triton"
    runner._set_prefix_layers([LayerPrefixes.stored(list(layer), capacity=room)
                               for layer in runner.attention.prefix_layers])
    # two paths of two modules each fill the room that single-module paths were counted for
    order, _ = _order(engine, [{"prompt": "Ostby?", "modules": ["ostby", "falgor"], "max_tokens": 30},
                               {"prompt": "Kelrim?", "modules": ["kelrim", "falgor"], "max_tokens": 30},
                               {"prompt": "Mayor?", "modules": ["ostby"], "max_tokens": 2}])
    assert order[0] == 2 and not engine._waiting_room and engine.stats.module_paths_dropped == 0
    assert runner.attention.prefix_layers[0].store[0].shape[0] > room  # grown


def test_a_store_without_memory_for_its_headroom_grows_to_the_rows_needed(default_model, monkeypatch):
    """The store must grow and twice the rows do not fit, the rows needed do: the path is
    added in a store of just those rows (the first try's partial stores freed first)."""
    runner = Engine(default_model, [], EngineConfig(max_num_seqs=2, kv_cache_gb=0.05)).runner
    mc, item = runner.mc, runner.dtype.itemsize

    def kv(n):
        return [torch.randn(n, mc.num_key_value_heads, mc.head_dim) for _ in range(mc.num_hidden_layers)]
    runner.attention_impl = "triton"  # the CPU keeps a prefix list: give it the store a CUDA runner keeps
    runner._set_prefix_layers([LayerPrefixes.stored([(k, v)], capacity=12) for k, v in zip(kv(10), kv(10))])
    row = mc.num_key_value_heads * mc.head_dim * item
    limit = mc.num_hidden_layers * 2 * (10 + 6) * row + row  # every layer's k and v of 16 rows, not 32
    live, zeros = [0], torch.zeros

    def budget(shape, dtype=None, device=None):
        n = math.prod(shape) * item
        if live[0] + n > limit:
            raise torch.OutOfMemoryError("CUDA out of memory (the test's budget)")
        t = zeros(shape, dtype=dtype, device=device)
        live[0] += n
        weakref.finalize(t, live.__setitem__, 0, live[0] - n)
        return t
    monkeypatch.setattr(torch, "zeros", budget)
    slot = runner.add_prefix([model_runner.PrefixKV(kv(6), kv(6))])
    layer = runner.attention.prefix_layers[-1]
    assert slot == 1 and layer.store[0].shape[0] == 16 and layer.ranges() == [(0, 10), (10, 6)]

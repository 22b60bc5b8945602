"""`.relaykv`: compile, round-trip, equality with a full prefill, and every refusal."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import struct

import pytest
import torch
from typer.testing import CliRunner

from relaycli.kernels.reference import attention_lse
from relaycli.artifact import ArtifactError, read_artifact, save_artifact
from relaycli.cli import app
from relaycli.compile import (CompileError, check_artifact, compile_prompt, load_checked, prefill_kv,
                              read_system_text, shared_prefix_ids)

SYSTEM = ("You are Ledger, the bookkeeping assistant of a small bakery. Answer in at most two "
          "sentences, cite the rule you used, and never invent numbers. Rules: 1) VAT is 9% on bread. "
          "2) Invoices are due in 30 days. 3) Refunds need a receipt.")


@pytest.fixture(scope="module")
def compiled(default_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "sys.relaykv"
    result = compile_prompt(default_model, SYSTEM, path)
    return path, result


def _full_prefill_kv(loaded, ids):
    """K/V of every layer from one plain causal forward over the whole prompt."""
    keys, values = {}, {}
    scale = loaded.config.head_dim ** -0.5
    n = len(ids)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None]

    def attend(layer, q, k, v):
        keys[layer], values[layer] = k.clone(), v.clone()
        return attention_lse(q[None], k[None], v[None], scale, mask)[0][0]

    loaded.model(torch.tensor(ids), torch.arange(n), attend)
    return keys, values


def test_round_trip_is_bit_exact(default_model, compiled):
    path, result = compiled
    art = load_checked(path, default_model)
    ids = shared_prefix_ids(default_model.tokenizer, SYSTEM)
    assert art.token_ids == ids and result.num_tokens == len(ids)
    keys, values = prefill_kv(default_model, ids)
    for i in range(default_model.config.num_hidden_layers):
        assert torch.equal(art.keys[i], keys[i]) and torch.equal(art.values[i], values[i])
    assert art.system_text == SYSTEM
    meta = art.meta
    for field in ("model_fingerprint", "tokenizer_fingerprint", "chat_template_fingerprint", "rope",
                  "relay_version", "checksum", "dtype"):
        assert meta[field], field
    assert meta["segments"] == [{"name": "system", "start": 0, "end": len(ids)}]


def test_artifact_kv_equals_full_prefill_at_system_positions(default_model, compiled):
    path, _ = compiled
    art = read_artifact(path)
    user = random.choice(["How much VAT is on a loaf?", "When is invoice 17 due?", "Refund please!"])
    ids = default_model.tokenizer.render([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
    assert ids[:art.num_tokens] == art.token_ids  # a request starts with exactly the prefix
    keys, values = _full_prefill_kv(default_model, ids)
    s = art.num_tokens
    # fp32 to 1e-5 of each layer's largest entry: deep layers reach |k| ~ 10, where a
    # different matmul blocking (65 vs 2,000 rows) alone moves the last bits (2.9e-6 of the
    # largest entry, 2.6e-5 absolute, on one 2-core machine); a wrong position or token is O(1).
    for i in range(default_model.config.num_hidden_layers):
        for got, want in ((art.keys[i], keys[i][:s]), (art.values[i], values[i][:s])):
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 1e-5, f"layer {i}: max |diff| is {err:.1e} of the layer's largest entry"


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "x"}],
    [{"role": "user", "content": "\n\nleading newlines"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}],
])
def test_requests_start_with_the_shared_prefix(default_model, messages):
    ids = shared_prefix_ids(default_model.tokenizer, SYSTEM)
    full = default_model.tokenizer.render([{"role": "system", "content": SYSTEM}] + messages)
    assert full[:len(ids)] == ids and len(full) > len(ids)


def _copy(path, tmp_path, name="copy.relaykv"):
    out = tmp_path / name
    out.write_bytes(path.read_bytes())
    return out


def test_truncated_file_is_refused(compiled, tmp_path):
    path, _ = compiled
    bad = _copy(path, tmp_path)
    data = bad.read_bytes()
    bad.write_bytes(data[: random.randint(len(data) // 2, len(data) - 1)])
    with pytest.raises(ArtifactError, match="truncated"):
        read_artifact(bad)
    bad.write_bytes(data[:5])
    with pytest.raises(ArtifactError, match="truncated"):
        read_artifact(bad)


def test_flipped_byte_is_refused(compiled, tmp_path):
    path, _ = compiled
    bad = _copy(path, tmp_path)
    data = bytearray(bad.read_bytes())
    (head_len,) = struct.unpack("<Q", data[:8])
    pos = random.randint(8 + head_len, len(data) - 1)
    data[pos] ^= 0x10
    bad.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum"):
        read_artifact(bad)
    result = CliRunner().invoke(app, ["inspect", str(bad), "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["checksum_ok"] is False
    assert json.loads(result.stdout)["readable"] is True  # flagged, but what it holds is shown


_DROP = object()


def _seal(meta):
    rest = {k: v for k, v in meta.items() if k != "meta_checksum"}
    return "sha256:" + hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _rewrite(path, tmp_path, meta_fn=None, header_fn=None, reseal=True, raw_meta=None):
    """A copy of the artifact with its header rewritten, the tensor data kept. reseal: give it
    the metadata checksum of the new metadata, as if relay had written it that way."""
    data = path.read_bytes()
    (head_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + head_len])
    meta = json.loads(header["__metadata__"]["relay"])
    if meta_fn is not None:
        meta_fn(meta)
    if reseal:
        meta["meta_checksum"] = _seal(meta)
    header["__metadata__"]["relay"] = json.dumps(meta) if raw_meta is None else raw_meta
    if header_fn is not None:
        header_fn(header)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    out = tmp_path / "changed.relaykv"
    out.write_bytes(struct.pack("<Q", len(head)) + head + data[8 + head_len:])
    return out


def _rewrite_meta(path, tmp_path, reseal=True, **changes):
    """A copy of the artifact with metadata fields changed (or dropped: _DROP)."""
    def change(meta):
        for key, value in changes.items():
            if value is _DROP:
                meta.pop(key, None)
            else:
                meta[key] = value
    return _rewrite(path, tmp_path, change, reseal=reseal)


def test_other_format_version_is_refused(compiled, tmp_path):
    bad = _rewrite_meta(compiled[0], tmp_path, format_version=3)
    with pytest.raises(ArtifactError, match="format 3 is not a format this relay reads"):
        read_artifact(bad)


def test_other_model_is_refused(default_model, compiled):
    other = dataclasses.replace(default_model, reference="other/model", fingerprint="f" * 64)
    with pytest.raises(ArtifactError, match="compiled for model .* but this run uses other/model"):
        load_checked(compiled[0], other)


class _OtherTokenizer:
    def __init__(self, tok, fingerprint=None, template=None):
        self._tok, self._fp, self._tp = tok, fingerprint, template

    def fingerprint(self):
        return self._fp or self._tok.fingerprint()

    def template_fingerprint(self):
        return self._tp or self._tok.template_fingerprint()


def test_other_tokenizer_or_template_is_refused(default_model, compiled):
    art = read_artifact(compiled[0])
    other_tok = dataclasses.replace(default_model, tokenizer=_OtherTokenizer(default_model.tokenizer, fingerprint="0" * 64))
    with pytest.raises(ArtifactError, match="tokenizer"):
        check_artifact(art, other_tok)
    other_tpl = dataclasses.replace(default_model, tokenizer=_OtherTokenizer(default_model.tokenizer, template="1" * 64))
    with pytest.raises(ArtifactError, match="chat template"):
        check_artifact(art, other_tpl)


def test_rope_mismatch_is_refused(default_model, compiled, tmp_path):
    bad = _rewrite_meta(compiled[0], tmp_path, rope={"rope_theta": 10000.0, "head_dim": 64, "rope_scaling": None})
    with pytest.raises(ArtifactError, match="RoPE"):
        load_checked(bad, default_model)


def test_dtype_mismatch_needs_allow_cast(default_model, compiled):
    art = read_artifact(compiled[0])
    bf16 = dataclasses.replace(default_model, model=default_model.model)
    bf16.model = type("M", (), {"dtype": torch.bfloat16})()
    with pytest.raises(ArtifactError, match="--allow-cast"):
        check_artifact(art, bf16)
    cast = check_artifact(art, bf16, allow_cast=True)
    assert cast.keys[0].dtype == torch.bfloat16
    assert torch.equal(cast.keys[3], art.keys[3].to(torch.bfloat16))


def test_read_system_text_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(CompileError, match="empty"):
        read_system_text(empty)
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(CompileError, match="not UTF-8"):
        read_system_text(latin)
    with pytest.raises(CompileError, match="no such file"):
        read_system_text(tmp_path / "missing.txt")


def test_prompt_longer_than_context_is_refused(default_model, tmp_path):
    small = dataclasses.replace(default_model, config=dataclasses.replace(default_model.config,
                                                                        max_position_embeddings=32))
    with pytest.raises(CompileError, match="context is 32"):
        compile_prompt(small, SYSTEM, tmp_path / "x.relaykv")
    assert not (tmp_path / "x.relaykv").exists()


def test_cli_compile_and_inspect(tmp_path):
    sys_txt = tmp_path / "sys.txt"
    sys_txt.write_text(SYSTEM + "\n")
    runner = CliRunner()
    result = runner.invoke(app, ["compile-prompt", str(sys_txt), "--quiet"])
    assert result.exit_code == 0, result.output
    art_path = tmp_path / "sys.relaykv"
    assert art_path.is_file() and not list(tmp_path.glob(".*tmp"))
    info = json.loads(runner.invoke(app, ["inspect", str(art_path), "--json"]).stdout)
    assert info["checksum_ok"] and info["tokens"] > 40 and info["dtype"] == "float32"
    assert info["text_start"].startswith("You are Ledger")
    table = runner.invoke(app, ["inspect", str(art_path)])
    assert table.exit_code == 0 and "SmolLM2" in table.stdout


def test_cli_unwritable_output_is_one_line(tmp_path):
    sys_txt = tmp_path / "sys.txt"
    sys_txt.write_text(SYSTEM)
    result = CliRunner().invoke(app, ["compile-prompt", str(sys_txt), "--out", str(tmp_path / "nope" / "a.relaykv")])
    assert result.exit_code == 2
    assert "does not exist" in result.output and "Traceback" not in result.output


def test_meta_checksum_covers_the_canonical_metadata(compiled):
    meta = read_artifact(compiled[0]).meta
    assert meta["meta_checksum"].startswith("sha256:") and meta["meta_checksum"] == _seal(meta)


def _edit_system_text(data):
    pos = data.index(b"Ledger")
    return data[:pos] + b"Ledgar" + data[pos + 6:]


def _edit_token_id(data):
    m = re.search(rb'token_ids\\": \[(\d)', data)
    digit = m.group(1)
    return data[:m.start(1)] + (b"2" if digit != b"2" else b"3") + data[m.end(1):]


@pytest.mark.parametrize("edit", [_edit_system_text, _edit_token_id])
def test_edited_metadata_is_refused_and_inspect_shows_the_mismatch(default_model, compiled, tmp_path, edit):
    path, _ = compiled
    bad = tmp_path / "edited.relaykv"
    data = path.read_bytes()
    bad.write_bytes(edit(data))
    assert len(bad.read_bytes()) == len(data)  # same length: only a checksum can tell
    with pytest.raises(ArtifactError, match="checksum"):
        read_artifact(bad)
    with pytest.raises(ArtifactError, match="checksum"):
        load_checked(bad, default_model)  # what `relay run` loads an artifact with
    read_artifact(bad, verify_checksum=False)  # still readable for inspect
    runner = CliRunner()
    result = runner.invoke(app, ["inspect", str(bad), "--json"])
    assert result.exit_code == 1, result.output
    info = json.loads(result.stdout)
    assert info["checksum_ok"] is False and "metadata checksum" in info["checksum_problem"]
    table = runner.invoke(app, ["inspect", str(bad)])
    assert table.exit_code == 1 and "MISMATCH" in table.stdout


def test_artifact_without_meta_checksum_is_refused(compiled, tmp_path):
    old = _rewrite_meta(compiled[0], tmp_path, reseal=False, meta_checksum=_DROP)
    with pytest.raises(ArtifactError, match="no metadata checksum.*recompile it"):
        read_artifact(old)
    assert read_artifact(old, verify_checksum=False).token_ids
    result = CliRunner().invoke(app, ["inspect", str(old), "--json"])
    assert result.exit_code == 1 and json.loads(result.stdout)["checksum_ok"] is False


_REQUIRED = ("model_reference", "model_fingerprint", "tokenizer_fingerprint", "chat_template_fingerprint",
             "relay_version", "checksum", "system_text", "num_layers", "num_kv_heads", "head_dim", "dtype",
             "rope", "token_ids", "segments", "format_version")


def _meta(**changes):
    return lambda meta: meta.update(changes)


def _entry(name, **changes):
    return lambda header: header[name].update(changes)


def _swap_kv_offsets(header):
    k, v = header["layers.0.k"], header["layers.0.v"]
    k["data_offsets"], v["data_offsets"] = v["data_offsets"], k["data_offsets"]


def _set_shape(header, fn):
    for name, info in header.items():
        if name != "__metadata__":
            info["shape"] = fn(info["shape"])


_MALFORMED = [(f"missing-{key}", dict(meta_fn=lambda m, key=key: m.pop(key)), key) for key in _REQUIRED] + [
    ("num_layers-str", dict(meta_fn=_meta(num_layers="30")), "num_layers"),
    ("num_layers-zero", dict(meta_fn=_meta(num_layers=0)), "num_layers"),
    ("num_layers-fewer", dict(meta_fn=lambda m: m.update(num_layers=m["num_layers"] - 1)), "num_layers"),
    ("num_layers-huge", dict(meta_fn=_meta(num_layers=10**6)), "num_layers"),
    ("num_kv_heads-float", dict(meta_fn=_meta(num_kv_heads=3.0)), "num_kv_heads"),
    ("head_dim-bool", dict(meta_fn=_meta(head_dim=True)), "head_dim"),
    ("format_version-str", dict(meta_fn=_meta(format_version="1")), "format"),
    ("token_ids-str", dict(meta_fn=_meta(token_ids="1 2 3")), "token_ids"),
    ("token_ids-mixed", dict(meta_fn=lambda m: m.update(token_ids=m["token_ids"][:-1] + ["x"])), "token_ids"),
    ("token_ids-float", dict(meta_fn=lambda m: m.update(token_ids=[float(t) for t in m["token_ids"]])), "token_ids"),
    ("token_ids-object", dict(meta_fn=_meta(token_ids={"a": 1})), "token_ids"),
    ("token_ids-shorter", dict(meta_fn=lambda m: m.update(token_ids=m["token_ids"][:-1])), "segments"),
    ("system_text-int", dict(meta_fn=_meta(system_text=5)), "system_text"),
    ("checksum-int", dict(meta_fn=_meta(checksum=5)), "checksum"),
    ("meta_checksum-int", dict(meta_fn=_meta(meta_checksum=5), reseal=False), "meta_checksum"),
    ("model_fingerprint-null", dict(meta_fn=_meta(model_fingerprint=None)), "model_fingerprint"),
    ("rope-str", dict(meta_fn=_meta(rope="theta=1e4")), "rope"),
    ("dtype-int8", dict(meta_fn=_meta(dtype="int8")), "dtype"),
    ("dtype-list", dict(meta_fn=_meta(dtype=["float32"])), "dtype"),
    ("segments-empty", dict(meta_fn=_meta(segments=[])), "segments"),
    ("segments-str", dict(meta_fn=_meta(segments="system")), "segments"),
    ("relay-list", dict(raw_meta="[1, 2]"), "relay metadata"),
    ("relay-string", dict(raw_meta='"hello"'), "relay metadata"),
    ("relay-null", dict(raw_meta="null"), "relay metadata"),
    ("metadata-not-object", dict(header_fn=lambda h: h.update(__metadata__=["relay"])), "relay metadata"),
    ("entry-str", dict(header_fn=lambda h: h.update({"layers.0.k": "F32"})), "layers.0.k"),
    ("entry-offsets-str", dict(header_fn=_entry("layers.1.v", data_offsets="0,10")), "data_offsets"),
    ("entry-offsets-short", dict(header_fn=_entry("layers.1.v", data_offsets=[0])), "data_offsets"),
    ("entry-offsets-missing", dict(header_fn=lambda h: h["layers.2.k"].pop("data_offsets")), "data_offsets"),
    ("entry-kv-swapped", dict(header_fn=_swap_kv_offsets), "data_offsets"),
    ("entry-shape-2d", dict(header_fn=lambda h: _set_shape(h, lambda s: [s[0], s[1] * s[2]])), "shape"),
    ("entry-shape-longer", dict(header_fn=lambda h: _set_shape(h, lambda s: [s[0] + 1, s[1], s[2]])), "shape"),
    ("entry-shape-int", dict(header_fn=_entry("layers.0.v", shape=7)), "shape"),
    ("entry-dtype-f16", dict(header_fn=_entry("layers.0.k", dtype="F16")), "dtype"),
    ("entry-dtype-missing", dict(header_fn=lambda h: h["layers.0.k"].pop("dtype")), "dtype"),
]


@pytest.mark.parametrize("kwargs, field", [c[1:] for c in _MALFORMED], ids=[c[0] for c in _MALFORMED])
def test_malformed_metadata_is_one_sentence(compiled, tmp_path, kwargs, field):
    bad = _rewrite(compiled[0], tmp_path, **kwargs)
    for verify in (True, False):  # inspect reads without the checksums: still no traceback
        with pytest.raises(ArtifactError) as err:
            read_artifact(bad, verify_checksum=verify)
        msg = str(err.value)
        assert bad.name in msg and field in msg and "recompile it" in msg, msg
    result = CliRunner().invoke(app, ["inspect", str(bad)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "recompile it" in result.output and len(result.output.strip().splitlines()) == 1, result.output
    # with --json the refusal is on stdout too, as an object a script can read (exit 2)
    result = CliRunner().invoke(app, ["inspect", str(bad), "--json"])
    assert result.exit_code == 2, result.output
    info = json.loads(result.stdout)
    assert info["readable"] is False and info["path"] == str(bad) and field in info["error"], info


@pytest.mark.parametrize("head", [b'"abc"', b"[1]", b"5", b'{"__metadata__": "relay"}', b"[" * 100000])
def test_header_that_is_no_object_is_refused(tmp_path, head):
    bad = tmp_path / "head.relaykv"
    bad.write_bytes(struct.pack("<Q", len(head)) + head)
    for verify in (True, False):
        with pytest.raises(ArtifactError, match="not a .relaykv artifact.*recompile it"):
            read_artifact(bad, verify_checksum=verify)


def _no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the output path was checked")
    monkeypatch.setattr("relaycli.models.registry.load_model", refuse)


def test_cli_compile_to_a_folder_is_refused_first(tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    sys_txt = tmp_path / "sys.txt"
    sys_txt.write_text(SYSTEM)
    folder = tmp_path / "out"
    folder.mkdir()
    (tmp_path / "sys.relaykv").mkdir()  # the default output name, taken by a folder
    for args in (["--out", str(folder)], []):
        result = CliRunner().invoke(app, ["compile-prompt", str(sys_txt), "--quiet", *args])
        assert result.exit_code == 2, result.output
        want = folder if args else tmp_path / "sys.relaykv"
        assert f"the output path {want} is a folder; give a file name" in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert list(folder.iterdir()) == []


def test_cli_compile_over_a_file_that_is_no_artifact_is_refused(tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    sys_txt = tmp_path / "sys.txt"
    sys_txt.write_text(SYSTEM)
    victim = tmp_path / "reqs.jsonl"
    victim.write_text('{"prompt": "keep me"}\n')
    result = CliRunner().invoke(app, ["compile-prompt", str(sys_txt), "--quiet", "--out", str(victim)])
    assert result.exit_code == 2 and "exists and is not a .relaykv artifact" in result.output, result.output
    assert victim.read_text() == '{"prompt": "keep me"}\n'


def test_cli_compile_onto_its_own_source_is_refused(tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    monkeypatch.chdir(tmp_path)
    sys_txt = tmp_path / "sys.txt"
    sys_txt.write_text(SYSTEM)
    (tmp_path / "link.relaykv").symlink_to(sys_txt)
    os.link(sys_txt, tmp_path / "hard.relaykv")
    own = tmp_path / "own.relaykv"  # a text file named like an artifact, compiled to the default --out
    own.write_text(SYSTEM)
    cases = [[str(sys_txt), "--out", str(sys_txt)], ["sys.txt", "--out", str(sys_txt)],
             [str(sys_txt), "--out", "./sys.txt"], [str(sys_txt), "--out", "link.relaykv"],
             ["link.relaykv", "--out", "sys.txt"], [str(sys_txt), "--out", "hard.relaykv"], [str(own)]]
    for args in cases:
        result = CliRunner().invoke(app, ["compile-prompt", *args, "--quiet"])
        assert result.exit_code == 2 and "itself" in result.output, (args, result.output)
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert sys_txt.read_text() == SYSTEM and own.read_text() == SYSTEM
    assert (tmp_path / "link.relaykv").is_symlink()


def test_read_system_text_drops_a_bom(tmp_path):
    plain, bom = tmp_path / "plain.txt", tmp_path / "bom.txt"
    plain.write_text(SYSTEM + "\n", encoding="utf-8")
    bom.write_bytes(b"\xef\xbb\xbf" + (SYSTEM + "\n").encode())
    assert read_system_text(bom) == read_system_text(plain) == SYSTEM
    bom.write_bytes(b"\xef\xbb\xbf\n\n  " + SYSTEM.encode())
    assert read_system_text(bom) == SYSTEM
    bom.write_bytes(b"\xef\xbb\xbf \n")
    with pytest.raises(CompileError, match="empty"):
        read_system_text(bom)


def _tiny_meta(num_tokens, num_layers, heads, dim):
    return {"model_reference": "dummy:tiny", "model_fingerprint": "a" * 64, "tokenizer_fingerprint": "b" * 64,
            "chat_template_fingerprint": "c" * 64, "dtype": "float32",
            "rope": {"rope_theta": 10000.0, "head_dim": dim, "rope_scaling": None}, "num_layers": num_layers,
            "num_kv_heads": heads, "head_dim": dim, "token_ids": list(range(1, num_tokens + 1)),
            "system_text": "tiny", "created_unix": 0}


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_artifact_gets_the_mode_of_a_normal_file(tmp_path, mask):
    keys = [torch.randn(5, 2, 4) for _ in range(3)]
    values = [torch.randn(5, 2, 4) for _ in range(3)]
    old = os.umask(mask)
    try:
        path = tmp_path / "tiny.relaykv"
        save_artifact(path, keys, values, _tiny_meta(5, 3, 2, 4))
        (tmp_path / "plain").write_bytes(b"")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask == (tmp_path / "plain").stat().st_mode & 0o777
    art = read_artifact(path)
    assert all(torch.equal(a, b) for a, b in zip(art.keys + art.values, keys + values))


def test_inspect_shows_brackets_in_paths_and_text_as_text(compiled, tmp_path):
    # "[/INST]" is Llama-2 prompt syntax and rich markup to a console that is not told otherwise.
    text = "Use [INST] q [/INST] a. [bold]Be brief.[/bold]"
    copy = _rewrite_meta(compiled[0], tmp_path, system_text=text)
    odd = tmp_path / "[bold]odd[red].relaykv"
    copy.rename(odd)
    result = CliRunner().invoke(app, ["inspect", str(odd)])
    assert result.exit_code == 0, result.output
    assert "]odd[red].relaykv" in result.output and "[INST] q [/INST] a. [bold]Be brief.[/bold]" in result.output
    missing = CliRunner().invoke(app, ["inspect", str(tmp_path / "[/INST].relaykv")])
    assert missing.exit_code == 2 and "[/INST].relaykv: no such artifact" in missing.output


def test_cli_recompiles_over_an_artifact_of_any_name(compiled, tmp_path, monkeypatch):
    # The content decides, not the suffix: an artifact named sys.kv is replaced, a request file is not.
    import relaycli.ui as ui
    calls = []
    monkeypatch.setattr("relaycli.models.registry.load_model", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(
        RuntimeError("stop after the path checks")))
    sys_txt = tmp_path / "sys.txt"
    sys_txt.write_text(SYSTEM)
    kv = tmp_path / "sys.kv"
    kv.write_bytes(compiled[0].read_bytes())
    assert ui._is_artifact(kv) and not ui._is_artifact(sys_txt)
    result = CliRunner().invoke(app, ["compile-prompt", str(sys_txt), "--quiet", "--out", str(kv)])
    assert calls and "is not a .relaykv artifact" not in result.output  # got past the checks to the model

"""`.relaykv`: compile, round-trip, equality with a full prefill, and every refusal."""

from __future__ import annotations

import dataclasses
import json
import random
import struct

import pytest
import torch
from typer.testing import CliRunner

from kernels.reference import attention_lse
from relaycli.artifact import ArtifactError, read_artifact
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


def _rewrite_meta(path, tmp_path, **changes):
    """A copy of the artifact with metadata fields changed (header rewritten, data kept)."""
    data = path.read_bytes()
    (head_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + head_len])
    meta = json.loads(header["__metadata__"]["relay"])
    meta.update(changes)
    header["__metadata__"]["relay"] = json.dumps(meta)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    out = tmp_path / "changed.relaykv"
    out.write_bytes(struct.pack("<Q", len(head)) + head + data[8 + head_len:])
    return out


def test_other_format_version_is_refused(compiled, tmp_path):
    bad = _rewrite_meta(compiled[0], tmp_path, format_version=2)
    with pytest.raises(ArtifactError, match="format 2"):
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

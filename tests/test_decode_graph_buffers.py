"""The static buffers behind decode CUDA graphs compute the same logits as the eager
step: padding rows, scratch block, context bucket. (Capture itself needs CUDA; the
device script checks graphed against eager generation on the GPU.)"""

import random

import numpy as np
import pytest
import torch

from models.registry import load_model
from relaycli.compile import prefix_from_ids
from relaycli.config import EngineConfig
from relaycli.engine.cuda_graph import DecodeGraphs, pack_block_tables
from relaycli.engine.engine import Engine, TokenRequest
from relaycli.engine.sequence import SamplingOptions


def test_static_buffers_match_the_eager_decode_step():
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(1000))
    rng = random.Random()
    ids = [rng.randrange(lm.config.vocab_size) for _ in range(rng.randint(1, 100))]
    engine = Engine(lm, [prefix_from_ids(lm, ids)], EngineConfig(max_num_seqs=8, kv_cache_gb=0.01))
    for i in range(5):
        own = [rng.randrange(lm.config.vocab_size) for _ in range(rng.randint(1, 40))]
        engine._admit(TokenRequest(i, str(i), ids + own, SamplingOptions(max_tokens=50), prefix_slot=0))
    runner = engine.runner
    graphs = DecodeGraphs(runner, 8, scratch_block=runner.num_blocks)
    seqs, is_prefill = engine.scheduler.schedule()
    runner.run(seqs, True)  # appends each sequence's first token
    for step in range(4):
        seqs, is_prefill = engine.scheduler.schedule()
        assert not is_prefill
        if step == 2:
            seqs = seqs[:3]  # a smaller batch after a larger one: stale rows must be reset
        bs, ctx, slot = graphs.key(seqs)
        assert bs >= len(seqs) and ctx >= max(s.num_own_tokens for s in seqs) and slot == 0
        graphs._fill(seqs, bs, ctx, runner.decode_input_ids(seqs, None))
        graphed = graphs._forward(bs, graphs._meta(bs, ctx, slot))[:len(seqs)]
        input_ids, positions, meta, last_rows = runner.prepare(seqs, False)
        eager = lm.model.compute_logits(lm.model(input_ids, positions, runner.attention.attend_fn(meta))[last_rows])
        torch.testing.assert_close(graphed, eager, atol=1e-5, rtol=1e-5)
        for s, t in zip(seqs, eager.argmax(-1).tolist()):
            s.num_cached_own = s.num_own_tokens
            s.output_ids.append(t)


def test_pack_block_tables_equals_padded_lists():
    rng = random.Random()
    out = np.empty((16, 40), dtype=np.int32)
    for _ in range(20):
        width = rng.randint(1, 40)
        tables = [[rng.randrange(10**6) for _ in range(rng.randint(0, width))] for _ in range(rng.randint(0, 16))]
        fill = rng.randrange(10**6)
        got = pack_block_tables(tables, width, fill, out)
        want = [t + [fill] * (width - len(t)) for t in tables]
        assert got.shape == (len(tables), width) and got.tolist() == want
    with pytest.raises(ValueError, match="more than the 3 columns"):
        pack_block_tables([[1, 2, 3, 4]], 3, 0, out)

"""Token-id requests (benchmarks, dummy models): bad ones become error rows, never a crash."""

import random

from models.registry import load_model
from relaycli.compile import prefix_from_ids
from relaycli.config import EngineConfig
from relaycli.engine.engine import Engine, TokenRequest
from relaycli.engine.sequence import SamplingOptions


def test_empty_or_prefix_only_prompts_are_error_rows_and_the_job_goes_on():
    lm = load_model("dummy:tiny", dtype="float32", device="cpu", seed=random.randrange(100))
    ids = [random.randrange(lm.config.vocab_size) for _ in range(5)]
    prefix = prefix_from_ids(lm, ids)
    engine = Engine(lm, [prefix], EngineConfig(max_num_seqs=4), record_token_ids=True)
    reqs = [TokenRequest(0, "prefix-only", list(ids), SamplingOptions(max_tokens=3), prefix_slot=0),
            TokenRequest(1, "ok", ids + [1, 2], SamplingOptions(max_tokens=3, ignore_eos=True), prefix_slot=0),
            TokenRequest(2, "empty", [], SamplingOptions(max_tokens=3)),
            TokenRequest(3, "no-prefix", [3, 4], SamplingOptions(max_tokens=3, ignore_eos=True))]
    out = {r.row_index: r for r in engine.generate_tokens(reqs)}
    assert sorted(out) == [0, 1, 2, 3]
    assert out[0].finish_reason == "error" and "no token after its 5-token shared prefix" in out[0].error
    assert out[2].finish_reason == "error" and "the prompt is empty" in out[2].error
    assert out[1].completion_tokens == 3 and out[3].completion_tokens == 3
    assert out[1].cached_tokens == 5 and out[3].cached_tokens == 0
    assert len(engine.token_ids_by_row[1]) == 3 and engine.stats.errors == 2

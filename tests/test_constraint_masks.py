"""apply_masks against a token-by-token reference: the bit order of the packed masks, rows
without a grammar, rows whose grammar ended, a vocabulary that is no multiple of 32."""

from __future__ import annotations

import random

import pytest
import torch

from relaycli.engine.constraints import RowMatcher, apply_masks


class _Grammar:  # what RowMatcher reads of an xgrammar matcher
    def __init__(self, allowed: set[int], done: bool = False) -> None:
        self.allowed, self.done = allowed, done

    def is_terminated(self) -> bool:
        return self.done


class _Batch:  # xgrammar's BatchGrammarMatcher: row i of the bitmask from matchers[i]
    def batch_fill_next_token_bitmask(self, grammars, bitmask: torch.Tensor) -> None:
        bitmask.zero_()
        for i, g in enumerate(grammars):
            for t in g.allowed:
                word, bit = divmod(t, 32)
                bitmask[i, word] = torch.tensor(int(bitmask[i, word]) | (1 << bit), dtype=torch.int64).to(torch.int32)


def test_masks_forbid_exactly_the_tokens_each_grammar_forbids():
    rng = random.Random(0)
    vocab, batch = 70, 6
    logits = torch.randn(batch, vocab)
    allowed = [set(rng.sample(range(vocab), rng.randint(1, vocab))) for _ in range(batch)]
    allowed[1] = {31, 32, 63, 64, 69}  # word edges and the last token
    batcher = _Batch()
    matchers = [RowMatcher(_Grammar(a), batcher) for a in allowed]
    matchers[2] = None  # a row without a constraint
    matchers[4] = RowMatcher(_Grammar(allowed[4], done=True), batcher)  # its grammar ended
    got = apply_masks(logits, matchers)
    for b in range(batch):
        for t in range(vocab):
            masked = matchers[b] is not None and b != 4 and t not in allowed[b]
            assert got[b, t].item() == (float("-inf") if masked else logits[b, t].item()), (b, t)
    assert not torch.isinf(logits).any()  # the input is left as it was
    every = [RowMatcher(_Grammar(a), batcher) for a in allowed]  # every row masked
    full = apply_masks(logits, every)
    assert all(torch.isinf(full[b]).sum().item() == vocab - len(allowed[b]) for b in range(batch))
    assert apply_masks(logits, [None] * batch) is logits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masks_on_cuda_equal_the_cpu_masks():
    torch.manual_seed(0)
    vocab, batch = 49152, 64  # the default model's vocabulary
    words = (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31 - 1, (batch, words), dtype=torch.int32)

    class Batch:
        def batch_fill_next_token_bitmask(self, grammars, bitmask):
            bitmask.copy_(bits[: bitmask.shape[0]])

    matchers = [RowMatcher(_Grammar(set()), Batch()) for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    assert torch.equal(apply_masks(logits.cuda(), matchers).cpu(), apply_masks(logits, matchers))

"""The merge kernel (kernels/triton_merge.py merge_partials: split partials folded
by their log-sum-exps) against float64, and the planner's choice of its launch."""

import pytest
import torch

from tests.helpers_kernels import CUDA, DEVICE, interpret_on_cpu

interpret_on_cpu()

from relaycli.kernels import planner  # noqa: E402
from relaycli.kernels.pdl import pdl_supported  # noqa: E402
from relaycli.kernels.tiles import MergeTile  # noqa: E402
from relaycli.kernels.triton_merge import merge_partials  # noqa: E402


@pytest.mark.parametrize("splits", [1, 3, 4, 9])
def test_merge_partials_weights_each_split_by_its_lse_whatever_the_tile(splits):
    """The merge is the softmax over all splits' keys: o = sum_s exp(lse_s - lse) o_s with
    lse = logsumexp_s lse_s; a split with lse = -inf adds nothing even if its o is NaN, a
    row whose splits are all empty gives (0, -inf); loading 1, 3 or 4 splits at a time, any
    heads a program, or the planner's tile for the grid, gives the same bits."""
    n, heads, d = 5, 6, 32
    o_part = torch.randn(splits, n, heads, d, device=DEVICE)
    lse_part = torch.randn(splits, n, heads, device=DEVICE) * 4
    empty = torch.rand(splits, n, heads, device=DEVICE) < 0.3
    lse_part[empty] = float("-inf")
    o_part[empty] = float("nan")
    lse_part[:, 0, 0] = float("-inf")  # a row with no keys at all
    planned = planner.merge_tile(n, heads, d, torch.device(DEVICE))
    got = {u: merge_partials(o_part, lse_part, torch.float32, MergeTile(planned.block_h, u)) for u in (1, 3, 4)}
    got[None] = merge_partials(o_part, lse_part, torch.float32, planned)
    for u in (3, 4, None):
        assert torch.equal(got[u][0], got[1][0]) and torch.equal(got[u][1], got[1][1])
    # any number of heads a program (the last block part empty at 4 of 6): the same bits
    for block_h in (1, 2, 4, 8):
        o_b, lse_b = merge_partials(o_part, lse_part, torch.float32, MergeTile(block_h, 1))
        assert torch.equal(o_b, got[1][0]) and torch.equal(lse_b, got[1][1]), block_h
    one = [merge_partials(o_part[:, :1], lse_part[:, :1], torch.float32, tile)
           for tile in (MergeTile(planned.block_h, 1), planner.merge_tile(1, heads, d, torch.device(DEVICE)))]
    assert torch.equal(one[0][0], one[1][0]) and torch.equal(one[0][1], one[1][1])
    assert torch.equal(one[1][0], got[1][0][:1]) and torch.equal(one[1][1], got[1][1][:1])
    o, lse = got[1]
    lse64 = lse_part.double().cpu()
    want_lse = torch.logsumexp(lse64, dim=0)
    w = torch.exp(lse64 - torch.where(torch.isneginf(want_lse), 0.0, want_lse)).nan_to_num(0.0)
    want_o = (w[..., None] * o_part.double().cpu().nan_to_num(0.0)).sum(0)
    assert torch.equal(lse[0, 0].cpu(), torch.tensor(float("-inf"))) and torch.all(o[0, 0] == 0)
    assert torch.allclose(lse.cpu().double(), want_lse, atol=1e-5, rtol=1e-5)
    assert torch.allclose(o.cpu().double(), want_o, atol=1e-5, rtol=1e-5)
    # as a programmatic dependent (sm_90): the same bits; elsewhere refused, not run plainly
    pdl = MergeTile(planned.block_h, planned.unroll, pdl=True)
    if CUDA and pdl_supported(torch.device(DEVICE)):
        o_w, lse_w = merge_partials(o_part, lse_part, torch.float32, pdl)
        assert torch.equal(o_w, o) and torch.equal(lse_w, lse)
    else:
        with pytest.raises(AssertionError, match="pdl needs"):
            merge_partials(o_part, lse_part, torch.float32, pdl)


def test_merge_rejects_a_bad_tile():
    o, lse = torch.zeros(2, 1, 6, 16, device=DEVICE), torch.zeros(2, 1, 6, device=DEVICE)
    with pytest.raises(AssertionError, match="a power of two"):
        merge_partials(o, lse, torch.float32, MergeTile(3, 1))
    with pytest.raises(AssertionError, match="unroll must be at least 1"):
        merge_partials(o, lse, torch.float32, MergeTile(2, 0))


def test_merge_unroll_keeps_loads_in_flight_only_for_grids_that_leave_the_chip_idle():
    from relaycli.kernels.triton_plan import merge_unroll, num_sms
    dev = torch.device("cpu")
    slots = 2 * num_sms(dev)
    assert merge_unroll(1, dev) == 4 and merge_unroll(slots, dev) == 4
    assert merge_unroll(slots + 1, dev) == 1 and merge_unroll(100 * slots, dev) == 1


def test_merge_block_h_splits_heads_only_while_the_grid_is_small(monkeypatch):
    import relaycli.kernels.triton_plan as plan
    monkeypatch.setattr(plan, "num_sms", lambda device: 132)  # an H200's
    dev = torch.device("cpu")
    # llama3-8b's 32 heads of 128: a row's 32 heads are 4,096 values, so 16 at most a program;
    # fewer until the grid has 3 programs an SM (396), never fewer than 2
    assert [plan.merge_block_h(n, 32, 128, dev) for n in (1, 16, 32, 64, 128, 256, 4096)] == [2, 2, 2, 4, 8, 16, 16]
    assert plan.merge_block_h(256, 32, 64, dev) == 16 and plan.merge_block_h(64, 32, 64, dev) == 4
    assert plan.merge_block_h(512, 9, 64, dev) == 16 and plan.merge_block_h(8, 1, 128, dev) == 1
    # the block of a large grid, all of a row's heads up to 2,048 values, whatever the rows
    assert [plan.merge_row_block_h(h, d) for h, d in ((32, 128), (9, 64), (1, 128), (64, 16))] == [16, 16, 1, 64]
    # the planner's merge launch: that block, and the unroll of its grid
    tile = planner.merge_tile(16, 32, 128, dev)
    assert tile == MergeTile(2, plan.merge_unroll(16 * 16, dev)) and not tile.pdl

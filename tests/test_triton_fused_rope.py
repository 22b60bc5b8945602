"""A decode step's RoPE and KV write inside the attention kernels (kernels/triton_rope.DecodeRope).

Every path that takes a DecodeRope must give the bits of rope_into_cache followed by the
same attention call: the same rotated q in every kernel, the same cache contents, the same
output. Without CUDA the kernels run under TRITON_INTERPRET=1 in fp16 (the fused path is
16-bit only); with CUDA in fp16 and bf16. Inputs are fresh random draws on every run.
"""

import importlib
import math
import os
import random
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

for _name in ["kernels.triton_rope", "kernels.triton_system_attention", "kernels.triton_context_attention",
              "kernels.triton_paged_decode", "kernels.triton_relay_grid", "kernels.triton_ops"]:
    if _name in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
        importlib.reload(sys.modules[_name])

from kernels.triton_ops import DecodeRope, prefix_paged_attention, relay_attention_with  # noqa: E402
from kernels.triton_paged_decode import prefix_paged_attention as baseline_with  # noqa: E402
from kernels.triton_rope import decode_rope_ok, rope_into_cache  # noqa: E402
from tests.helpers_attention import random_problem  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="bf16 needs the GPU"))]
SMALL_CTX = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2)  # many tiles, so splits really cut
SMALL_SYS = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2)

# mode -> (relay or baseline, keyword arguments)
MODES = {
    "relay": ("relay", {}),
    "relay-split": ("relay", dict(sys_splits=3, ctx_splits=2, ctx_config=SMALL_CTX, sys_config=SMALL_SYS)),
    "relay-overlap": ("relay", dict(overlap=True, system_side=True, resident=True)),
    "relay-one-grid": ("relay", dict(one_grid=True)),
    "baseline": ("baseline", {}),
    "baseline-split": ("baseline", dict(num_splits=3, config=SMALL_CTX)),
}


def decode_problem(rng: random.Random, dtype: torch.dtype, head_dim: int):
    num_kv, group = rng.choice([1, 2]), rng.choice([1, 3, 4])
    num_seqs = rng.randint(1, 6)
    shape = dict(q_lens=[1] * num_seqs, ctx_lens=[rng.randint(1, 70) for _ in range(num_seqs)],
                 prefix_of=[rng.choice([0, 0, 1, 2]) for _ in range(num_seqs)],
                 prefix_lens=[rng.randint(1, 120), rng.randint(1, 40)], num_q_heads=num_kv * group,
                 num_kv_heads=num_kv, head_dim=head_dim, block_size=rng.choice([4, 16]))
    _, kc, vc, prefixes, meta = random_problem(**shape, dtype=dtype, device=DEVICE)
    n, hq = num_seqs, num_kv * group
    # q, k, v as views of one qkv product, as the model hands them over
    qkv = torch.randn(n, (hq + 2 * num_kv) * head_dim, device=DEVICE).to(dtype)
    q, k, v = qkv.split([hq * head_dim, num_kv * head_dim, num_kv * head_dim], dim=-1)
    q, k, v = q.view(n, hq, head_dim), k.view(n, num_kv, head_dim), v.view(n, num_kv, head_dim)
    pos = torch.tensor([rng.randint(0, 9000) for _ in range(n)], device=DEVICE)
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim)
    emb = torch.cat([pos.float()[:, None] * inv[None, :]] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    return q, k, v, cos, sin, kc, vc, prefixes, meta, 1.0 / math.sqrt(head_dim)


def attend(kind: str, q, kc, vc, meta, prefixes, scale, rope=None, **kwargs):
    if kind == "relay":
        return relay_attention_with(q, kc, vc, meta, prefixes, scale, rope=rope, **kwargs)
    if kwargs:
        return baseline_with(q, kc, vc, meta, prefixes, scale, rope=rope, **kwargs)
    return prefix_paged_attention(q, kc, vc, meta, prefixes, scale, rope=rope)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(MODES))
def test_fused_rope_gives_the_bits_of_rope_then_attention(dtype, mode):
    rng = random.Random()
    kind, kwargs = MODES[mode]
    q, k, v, cos, sin, kc, vc, prefixes, meta, scale = decode_problem(rng, dtype, rng.choice([16, 32]) if not CUDA
                                                                      else rng.choice([64, 128]))
    want_kc, want_vc = kc.clone(), vc.clone()
    q_rot = rope_into_cache(q, k, v, cos, sin, want_kc, want_vc, meta.slot_mapping)
    want = attend(kind, q_rot, want_kc, want_vc, meta, prefixes, scale, **kwargs)
    assert not torch.equal(kc, want_kc)  # the new tokens' slots held other values
    got = attend(kind, q, kc, vc, meta, prefixes, scale, rope=DecodeRope(cos, sin, k, v), **kwargs)
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["relay", "baseline"])
def test_fused_rope_leaves_padding_rows_slots_alone(kind):
    """A padding row (no own context: a graph's rows past the batch) stores nothing."""
    rng = random.Random()
    q, k, v, cos, sin, kc, vc, prefixes, meta, scale = decode_problem(rng, torch.float16, 16)
    pad = rng.randrange(meta.num_seqs)
    meta.context_lens[pad] = 0
    before = kc.clone(), vc.clone()
    got = attend(kind, q, kc, vc, meta, prefixes, scale, rope=DecodeRope(cos, sin, k, v))
    slot = int(meta.slot_mapping[pad])
    flat = [t.view(-1, kc.shape[2], kc.shape[3]) for t in (kc, vc, *before)]
    assert torch.equal(flat[0][slot], flat[2][slot]) and torch.equal(flat[1][slot], flat[3][slot])
    want_kc, want_vc = before[0].clone(), before[1].clone()
    q_rot = rope_into_cache(q, k, v, cos, sin, want_kc, want_vc, meta.slot_mapping)
    want = attend(kind, q_rot, want_kc, want_vc, meta, prefixes, scale)
    keep = torch.ones(flat[0].shape[0], dtype=torch.bool, device=kc.device)
    keep[slot] = False  # rope_into_cache stores a padding row's k/v; the fused kernels do not
    assert torch.equal(flat[0][keep], want_kc.view_as(flat[0])[keep])
    assert torch.equal(got, want)


def test_fused_rope_is_refused_where_it_would_change_results():
    rng = random.Random()
    q, k, v, cos, sin, kc, vc, prefixes, meta, scale = decode_problem(rng, torch.float16, 16)
    assert decode_rope_ok(kc) and not decode_rope_ok(kc.float())  # fp32 would contract into FMAs
    with pytest.raises(AssertionError, match="16-bit"):
        relay_attention_with(q.float(), kc.float(), vc.float(), meta, prefixes, scale,
                             rope=DecodeRope(cos.float(), sin.float(), k.float(), v.float()))
    meta.is_decode = False
    with pytest.raises(AssertionError, match="decode step"):
        relay_attention_with(q, kc, vc, meta, prefixes, scale, rope=DecodeRope(cos, sin, k, v))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [8, 256])
@pytest.mark.parametrize("kind", ["relay", "baseline"])
def test_gpu_graphed_decode_step_with_fused_rope_gives_the_same_bits(dtype, batch, kind):
    """llama3-8b heads under CUDA-graph capture, as the engine runs a decode step (relay:
    the overlap and the Gluon system kernel): the fused step replays to the bits of
    rope_into_cache, then attention, on fresh inputs."""
    rng = random.Random()
    ctx = [rng.randint(1, 900) for _ in range(batch)]
    _, kc, vc, prefixes, meta = random_problem(q_lens=[1] * batch, ctx_lens=ctx, prefix_of=[0] * batch,
                                               prefix_lens=[rng.randint(1024, 4096)], num_q_heads=32,
                                               num_kv_heads=8, head_dim=128, dtype=dtype, device="cuda")
    scale = 128 ** -0.5
    qkv = torch.empty(batch, 48 * 128, device="cuda", dtype=dtype)
    q, k, v = (t.view(batch, -1, 128) for t in qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
    cos, sin = (torch.empty(batch, 1, 128, device="cuda", dtype=dtype) for _ in range(2))
    kc_f, vc_f = kc.clone(), vc.clone()
    out, out_f = torch.empty_like(q), torch.empty_like(q)

    def unfused():
        q_rot = rope_into_cache(q, k, v, cos, sin, kc, vc, meta.slot_mapping)
        out.copy_(attend(kind, q_rot, kc, vc, meta, prefixes, scale))

    def fused():
        out_f.copy_(attend(kind, q, kc_f, vc_f, meta, prefixes, scale, rope=DecodeRope(cos, sin, k, v)))
    graphs = []
    for step in (unfused, fused):
        for _ in range(2):  # the first capture compiles what runs only under capture (the Gluon kernel)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        graphs.append(graph)
    for _ in range(2):
        qkv.copy_(torch.randn_like(qkv))
        emb = torch.rand(batch, 1, 128, device="cuda") * 6.3
        cos.copy_(emb.cos())
        sin.copy_(emb.sin())
        kc.copy_(torch.randn_like(kc))
        vc.copy_(torch.randn_like(vc))
        kc_f.copy_(kc)
        vc_f.copy_(vc)
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kc_f, kc) and torch.equal(vc_f, vc)
        assert torch.equal(out_f, out)

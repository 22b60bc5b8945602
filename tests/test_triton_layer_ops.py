"""Fused Triton layer ops (add + RMSNorm, RoPE, silu * up) against relaycli.models.llama.EagerOps.

The fused ops round the way transformers does, so they must equal the eager ops to about
one unit in the last place: the residual sum exactly, the rest within the differences of
a reduction order, of exp, or of a product the GPU compiler contracts into the following
sum (seen on the H200 for RoPE in fp16/bf16: 1 ulp on a quarter of the elements). Without
CUDA they run under TRITON_INTERPRET=1.
"""

import importlib
import os
import random
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

for _name in ["relaycli.kernels.triton_rms_norm", "relaycli.kernels.triton_rope", "relaycli.kernels.triton_silu_mul"]:
    if _name in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
        importlib.reload(sys.modules[_name])

from relaycli.kernels.backend import TritonLayerOps  # noqa: E402
from relaycli.models.llama import EAGER_OPS, RMSNorm  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# The interpreter rounds to bf16 differently from the GPU (and from PyTorch): bf16 on CUDA only.
DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not CUDA, reason="bf16 rounding needs the GPU"))]
ULP = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # relative: about one unit in the last place


@pytest.fixture
def rng():
    """Fresh draws every run; the seed is printed, so a failure can be replayed."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    return random.Random(seed)


def _norm(hidden: int, dtype, rng: random.Random) -> RMSNorm:
    norm = RMSNorm(hidden, rng.choice([1e-5, 1e-6]), dtype, DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, device=DEVICE) * 2)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_equals_eager(dtype, with_residual, rng):
    n, hidden = rng.randint(1, 9), rng.choice([48, 64, 96, 576, 4096])
    x = (torch.randn(n, hidden, device=DEVICE) * rng.uniform(0.1, 20)).to(dtype)
    residual = torch.randn(n, hidden, device=DEVICE).to(dtype) if with_residual else None
    norm = _norm(hidden, dtype, rng)
    want, want_res = EAGER_OPS.add_rms_norm(x, residual, norm)
    got, got_res = TritonLayerOps().add_rms_norm(x, residual, norm)
    assert torch.equal(got_res, want_res)  # the residual sum is rounded once, the same way
    assert got.dtype == dtype and got.shape == want.shape
    rel = ((got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-3)).max().item()
    assert rel <= 2 * ULP[dtype], rel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [None, (32, 8)])
def test_rope_equals_eager(dtype, heads, rng):
    n, d = rng.randint(1, 7), rng.choice([16, 32, 64] if heads is None else [128])
    kv = rng.choice([1, 2, 3]) if heads is None else heads[1]
    hq = kv * rng.choice([1, 3, 4]) if heads is None else heads[0]
    # q, k as column slices of one qkv matmul output, as the model passes them
    qkv = torch.randn(n, (hq + 2 * kv) * d, device=DEVICE).to(dtype)
    q, k, _ = qkv.split([hq * d, kv * d, kv * d], dim=-1)
    q, k = q.view(n, hq, d), k.view(n, kv, d)
    pos = torch.tensor([rng.randint(0, 5000) for _ in range(n)], device=DEVICE)
    freqs = pos.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    want_q, want_k = EAGER_OPS.rope(q, k, cos, sin)
    got_q, got_k = TritonLayerOps().rope(q, k, cos, sin)
    # one unit in the last place at the largest magnitude (cancellation makes relative error useless)
    for got, want, x in ((got_q, want_q, q), (got_k, want_k, k)):
        ulp = torch.finfo(dtype).eps * 2 * x.abs().max().item()
        assert (got.double() - want.double()).abs().max().item() <= ulp
        assert (got != want).float().mean().item() < 0.5  # mostly bit-identical


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_into_cache_equals_rope_then_write_kv(dtype, rng):
    """The fused launch stores exactly what rope + write_kv store, and nothing else."""
    from relaycli.kernels.triton_ops import write_kv
    n, d, kv = rng.randint(1, 9), rng.choice([16, 64]), rng.choice([1, 2, 3])
    hq = kv * rng.choice([1, 4])
    qkv = torch.randn(n, (hq + 2 * kv) * d, device=DEVICE).to(dtype)
    q, k, v = qkv.split([hq * d, kv * d, kv * d], dim=-1)
    q, k, v = q.view(n, hq, d), k.view(n, kv, d), v.view(n, kv, d)
    pos = torch.tensor([rng.randint(0, 5000) for _ in range(n)], device=DEVICE)
    freqs = pos.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]
    num_blocks, block_size = rng.randint(n // 4 + 1, 6), 4
    k_cache = torch.randn(num_blocks, block_size, kv, d, device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.tensor(rng.sample(range(num_blocks * block_size), n), device=DEVICE)
    ops = TritonLayerOps()
    want_q, want_k = ops.rope(q, k, cos, sin)
    want_kc, want_vc = k_cache.clone(), v_cache.clone()
    write_kv(want_kc, want_vc, want_k, v, slots)
    got_q = ops.rope_into_cache(q, k, v, cos, sin, k_cache, v_cache, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(k_cache, want_kc) and torch.equal(v_cache, want_vc)


def test_engine_step_with_fused_rope_equals_the_unfused_step():
    """Through the model: the Triton back end rotating k into its cache gives the logits of
    rope, then write_kv, then attention (the same kernels, so bit for bit)."""
    from relaycli.models.registry import load_model
    from relaycli.compile import prefix_from_ids
    from relaycli.config import EngineConfig
    from relaycli.engine.engine import Engine, TokenRequest
    from relaycli.engine.sequence import SamplingOptions
    gen = random.Random()
    lm = load_model("dummy:tiny", dtype="float32", device=DEVICE, seed=gen.randrange(1000))
    ids = [gen.randrange(lm.config.vocab_size) for _ in range(gen.randint(1, 40))]
    engine = Engine(lm, [prefix_from_ids(lm, ids)], EngineConfig(max_num_seqs=4, kv_cache_gb=0.01,
                                                                 attention_impl="triton"))
    for i in range(3):
        own = [gen.randrange(lm.config.vocab_size) for _ in range(gen.randint(1, 20))]
        engine._admit(TokenRequest(i, str(i), own, SamplingOptions(max_tokens=8), prefix_slot=0))
    runner = engine.runner
    for step in range(2):  # a prefill step, then a decode step
        seqs, is_prefill = engine.scheduler.schedule()
        assert is_prefill == (step == 0)
        input_ids, positions, meta, last_rows = runner.prepare(seqs, is_prefill)
        attend = runner.attention.attend_fn(meta)
        assert attend.takes_rope
        fused = lm.model(input_ids, positions, attend, runner.layer_ops)  # first: it must store k, v itself
        unfused = lm.model(input_ids, positions, lambda *a: attend(*a), runner.layer_ops)  # no takes_rope
        assert torch.equal(fused, unfused)
        runner.run(seqs, is_prefill)  # the real step: caches, token, bookkeeping


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_eager(dtype, rng):
    n, width = rng.randint(1, 6), rng.choice([40, 128, 1536])
    gate_up = (torch.randn(n, 2 * width, device=DEVICE) * 4).to(dtype)
    want = EAGER_OPS.silu_mul(gate_up)
    got = TritonLayerOps().silu_mul(gate_up)
    rel = ((got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-2)).max().item()
    assert rel <= 2 * ULP[dtype], rel


def test_model_forward_with_fused_ops_equals_eager(rng):
    """The tiny dummy model, fp32: the whole forward pass with fused ops equals the eager one."""
    from relaycli.kernels import reference
    from relaycli.models.registry import load_model
    lm = load_model("dummy:tiny", dtype="float32", device=DEVICE, seed=rng.randrange(1000))
    n = 11
    ids = torch.randint(0, lm.config.vocab_size, (n,), device=DEVICE)
    pos = torch.arange(n, device=DEVICE)

    causal = torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril()[None]

    def attend(layer, q, k, v):  # plain causal attention over this one sequence
        return reference.attention_lse(q[None], k[None], v[None], lm.config.head_dim ** -0.5, causal)[0][0]

    want = lm.model(ids, pos, attend)
    got = lm.model(ids, pos, attend, TritonLayerOps())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (9, 0), reason="PDL needs sm_90")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_layer_ops_launched_as_programmatic_dependents_give_the_same_bits(dtype, rng):
    """Each op right behind the matmul that feeds it (as in a layer), launched with PDL and
    without, eagerly and replayed from one CUDA graph on fresh inputs: the same bits, so
    every op waited for its producer (relaycli.kernels.pdl)."""
    from relaycli.kernels.backend import layer_ops
    assert layer_ops("triton", torch.device("cuda")).pdl and not layer_ops("triton", torch.device("cpu")).pdl
    n, hidden, kv, d = rng.choice([8, 256]), 4096, 8, 128
    x = torch.empty(n, hidden, device="cuda", dtype=dtype)
    residual = torch.empty_like(x)
    w_qkv = torch.randn(48 * d, hidden, device="cuda", dtype=dtype) * 0.02
    w_gu = torch.randn(2 * 14336, hidden, device="cuda", dtype=dtype) * 0.02
    cos, sin = (torch.empty(n, 1, d, device="cuda", dtype=dtype) for _ in range(2))
    norm = _norm(hidden, dtype, rng)
    caches = {pdl: [torch.zeros(n, 1, kv, d, device="cuda", dtype=dtype) for _ in range(2)] for pdl in (False, True)}
    slots = torch.randperm(n, device="cuda")

    def step(ops, pdl):
        y, res = ops.add_rms_norm(x @ w_gu[:hidden].T, residual, norm)  # behind a product, as after o_proj
        qkv = y @ w_qkv.T
        q, k, v = (t.view(n, -1, d) for t in qkv.split([32 * d, kv * d, kv * d], dim=-1))
        q_rot = ops.rope_into_cache(q, k, v, cos, sin, *caches[pdl], slots)
        act = ops.silu_mul(y @ w_gu.T)
        return torch.cat([y.flatten(), res.flatten(), q_rot.flatten(), act.flatten()])

    def fresh():
        x.copy_(torch.randn_like(x))
        residual.copy_(torch.randn_like(residual))
        emb = torch.rand(n, 1, d, device="cuda") * 6.3
        cos.copy_(emb.cos())
        sin.copy_(emb.sin())
    plain, pdl_ops = TritonLayerOps(pdl=False), TritonLayerOps(pdl=True)
    fresh()
    assert torch.equal(step(pdl_ops, True), step(plain, False))
    outs = {}
    graphs = {}
    for pdl, ops in ((False, plain), (True, pdl_ops)):
        step(ops, pdl)  # compile outside capture
        graphs[pdl] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[pdl]):
            outs[pdl] = step(ops, pdl)
    for _ in range(3):
        fresh()
        graphs[True].replay()
        graphs[False].replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[True], outs[False])
        assert all(torch.equal(a, b) for a, b in zip(caches[True], caches[False]))

"""Temporary: where the in-kernel merge's time goes (globaltimer stamps a program)."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch, triton  # noqa: E401
import device_kernels as dk
from device_ws_regs import splits_for
from kernels.gluon_fused_relay import _launch
from kernels.triton_plan import fused_tile

dev = torch.device("cuda")
names = {0: "start", 6: "join", 1: "merge in", 2: "released", 3: "spin out", 4: "merged", 5: "end"}
for batch in (64, 256):
    hq, hkv, d = dk.HEADS["llama3-8b"]
    q, kc, vc, pre, meta = dk.build(hq, hkv, d, batch, 8192, 128, dev, page=64)
    k_sys, v_sys = pre[0]
    splits = splits_for(triton.cdiv(batch * 4, 128) * hkv, dev)
    tile = fused_tile(batch, hq, hkv)
    args = (q, k_sys, v_sys, kc, vc, meta.block_tables, meta.context_lens, d ** -0.5, splits)
    cnt = torch.zeros(256, dtype=torch.int32, device=dev)
    for merge, unroll in ((False, 1), (True, None)):
        progs = triton.cdiv(batch * 4, 128) * hkv * splits
        dbg = torch.zeros(progs, 8, dtype=torch.int64, device=dev)
        kw = dict(out=torch.empty_like(q), counters=cnt, merge_rows=unroll) if merge else {}
        for _ in range(5):
            flush = torch.empty(64 << 20, dtype=torch.int8, device=dev).zero_()
            _launch(*args, dbg=dbg, **kw, **tile)
            torch.cuda.synchronize()
        t = dbg.cpu().double()
        t0 = t[:, 0].min()
        rel = (t - t0) / 1e3
        print(f"B={batch} splits={splits} merge={merge} unroll={unroll} programs={progs}")
        for k in (0, 6, 1, 2, 3, 4, 5):
            if not merge and k in (1, 2, 3, 4):
                continue
            col = rel[:, k]
            print(f"   {names[k]:10s} min {col.min():7.2f} median {col.median():7.2f} max {col.max():7.2f} us")
        if merge:
            print(f"   per program: spin {((t[:, 3]-t[:, 2])/1e3).median():.2f} us median, "
                  f"merge {((t[:, 4]-t[:, 3])/1e3).median():.2f}, release {((t[:, 2]-t[:, 1])/1e3).median():.2f}, "
                  f"join->merge {((t[:, 1]-t[:, 6])/1e3).median():.2f}, tail {((t[:, 5]-t[:, 4])/1e3).median():.2f}")

"""The monokernel's attention task alone (GPU only): where its ~20 us per qwen3 layer go.

    python benchmarks/attention_task_micro.py --out $OUT/attention_task_micro.json [--contexts 36 8192] [--more]

The monokernel's trace gives a qwen3-30b-a3b attention task ~20 us of work at ~36 cached positions (NOTES.md,
sessions 6, 7 and 29), ~10x its instruction count; neither prefetching its K/V rows into L2 nor hoisting its loads
changed that. This runs `ops.attention_task` itself, with the monokernel's block sizes and warps, in a small wrapper
kernel, REPS times back to back per kv head (4 programs), under three surroundings:

- alone: a grid of only the attention programs;
- spin: 128 more programs that poll a counter the way the monokernel's waiting programs do (kccl.sync.wait: every
  thread an acquire load + a volatile load of the stop word + globaltimer per poll), signalled once per rep;
- prefetch+spin: the same, each first bulk-prefetching its share (64 KB) of an 8 MB weight range into L2, as the
  o_proj tasks do while attention runs (a fresh range per rep);
and with the task's dots in fp32 FMAs ("ieee", the monokernel's default) or on the tensor cores ("tf32x3", ~fp32
accuracy; "tf32", one product, for timing; "bf16x2": q / p as two bf16 halves against the bf16 cache, 2 products;
"bf16": one product, the graph backend's precision), at several K/V block sizes, splits and warps. (Session 30, H100: the
task alone is as slow as beside the spinners, ~10,000 cycles per ieee block of 16 positions.)

us per task = the attention program's globaltimer span / REPS (the median over the kv heads); the last rep is also
stamped in clock64 cycles, whole and up to its K/V loop (attention_task's STAMP: the trace's `pre us`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics

import torch
import triton
import triton.language as tl

from kie_moe.kccl.sync import clock64, globaltimer, red_release, wait
from kie_moe.kernels.monokernel.ops import attention_task, kv_split_range
from kie_moe.kernels.monokernel.prefetch import l2_prefetch

QWEN3 = dict(HQ=32, HKV=4, DH=128)


@triton.jit
def _attn_micro(qkv, kv, cos, sin, qn, kn, ao, am, al, acnt, ctr, stop, span, wbuf, pos, reps, n_attn, n_splits,
                tmax, wstride, eps, sm_scale, HQ: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_QG: tl.constexpr, NT: tl.constexpr, OTHERS: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    if pid < n_attn:
        g = pid // n_splits
        sp = pid % n_splits
        k_head = kv + (g * tmax * DH).to(tl.int64)
        v_head = k_head + HKV * tmax * DH
        lo, hi = kv_split_range(pos, 0, n_splits, sp)
        tr = span + n_attn + pid * 8          # [8] per program: clock64 at the last rep's start, task's loop stamp
        t0 = globaltimer()
        for r in range(reps):
            tl.store(tr, clock64())
            attention_task(g, sp, n_splits, pos, lo, hi, qkv, k_head, v_head, cos, sin, qn, kn, ao, am, al,
                           acnt + g, qn, eps, sm_scale, 0.0, tr, True, HQ, HKV, DH, DH, False, 1, False, False,
                           BLOCK_R, BLOCK_H, 16, BLOCK_D, BLOCK_T, 1024, BLOCK_QG, NT, True, PREC)
            tl.store(tr + 1, clock64())
            tl.debug_barrier()
            red_release(ctr, 1)
        tl.store(span + pid, globaltimer() - t0)
    elif OTHERS > 0:
        q = pid - n_attn
        for r in range(reps):
            if OTHERS == 2:   # this rep's 64 KB share of a fresh 8 MB range (wbuf: reps x 8 MB bytes)
                l2_prefetch(wbuf + r.to(tl.int64) * wstride + q * 65536, q * 0 + 65536, 1, True, 1024, 64)
            wait(ctr, n_attn * (r + 1), stop, 10_000_000_000, True, False, NT)


def run_case(pos: int, others: int, prec: str = "ieee", n_splits: int = 1, reps: int = 200, block_t: int = 16,
             num_warps: int = 8, sm: int | None = None, shape=QWEN3) -> dict:
    dev = "cuda"
    HQ, HKV, DH = shape["HQ"], shape["HKV"], shape["DH"]
    tmax = pos + 64
    g = torch.Generator(device="cpu").manual_seed(0)
    qkv = torch.randn((HQ + 2 * HKV) * DH, generator=g).to(dev)
    kv = (torch.randn(2, HKV, tmax, DH, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    ang = torch.arange(tmax)[:, None] * (1e6 ** (-torch.arange(DH // 2) / (DH // 2)))[None, :]
    cos, sin = ang.cos().float().to(dev).contiguous(), ang.sin().float().to(dev).contiguous()
    qn = torch.ones(DH, device=dev, dtype=torch.bfloat16)
    ao = torch.zeros(n_splits, HQ * DH, device=dev)
    am = torch.zeros(n_splits, HQ, device=dev)
    al = torch.zeros(n_splits, HQ, device=dev)
    acnt = torch.zeros(HKV, dtype=torch.int32, device=dev)
    ctr = torch.zeros(1, dtype=torch.int32, device=dev)
    stop = torch.zeros(1, dtype=torch.int32, device=dev)
    n_attn = HKV * n_splits
    span = torch.zeros(n_attn * 9, dtype=torch.int64, device=dev)   # spans, then [n_attn, 8] stamps
    sm = sm or torch.cuda.get_device_properties(0).multi_processor_count
    grid = n_attn + (sm - n_attn if others else 0)
    wstride = 8 << 20
    n_pf_reps = reps if others == 2 else 1
    wbuf = torch.empty(n_pf_reps * wstride + (1 << 20), dtype=torch.uint8, device=dev)
    p2 = triton.next_power_of_2      # the monokernel's attention block sizes (runtime.kernel_args)
    meta = dict(HQ=HQ, HKV=HKV, DH=DH, BLOCK_R=max(16, p2(HQ // HKV)), BLOCK_H=max(16, DH // 2),
                BLOCK_D=max(16, p2(DH)), BLOCK_T=block_t, BLOCK_QG=p2(HQ // HKV * DH), NT=32 * num_warps,
                OTHERS=others, PREC=prec)
    args = (qkv, kv, cos, sin, qn, qn, ao, am, al, acnt, ctr, stop, span, wbuf, pos, reps, n_attn, n_splits, tmax,
            wstride, 1e-6, 1.0 / math.sqrt(DH))
    out = []
    for _ in range(4):   # the first is the compile + warm-up
        ctr.zero_()
        acnt.zero_()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _attn_micro[(grid,)](*args, **meta, num_warps=num_warps)
        b.record()
        b.synchronize()
        st = span[n_attn:].view(n_attn, 8).cpu()
        pre, tot = (st[:, 7] - st[:, 0]).tolist(), (st[:, 1] - st[:, 0]).tolist()
        out.append((a.elapsed_time(b) * 1e3 / reps, statistics.median(span[:n_attn].tolist()) / 1e3 / reps,
                    statistics.median(pre), statistics.median(tot)))
    ev, sp = statistics.median(o[0] for o in out[1:]), statistics.median(o[1] for o in out[1:])
    pre_cyc, task_cyc = statistics.median(o[2] for o in out[1:]), statistics.median(o[3] for o in out[1:])
    return dict(pos=pos, others=("none", "spin", "prefetch+spin")[others], prec=prec, n_splits=n_splits,
                block_t=block_t, num_warps=num_warps, reps=reps, grid=grid, us_per_task=round(sp, 3),
                us_per_rep_events=round(ev, 3), kv_blocks=-(-pos // (n_splits * block_t)),
                last_rep_cycles=task_cyc, last_rep_pre_loop_cycles=pre_cyc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--contexts", type=int, nargs="+", default=[36, 8192])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--more", action="store_true", help="also tf32x3 at block_t 32, beside prefetching "
                    "programs, at 4 warps, and the ieee dots in those settings")
    a = ap.parse_args(argv)
    rows = []
    # (others, dot precision, block_t, warps, splits): the monokernel's qwen3 task is bf16x2 (session 34), block_t
    # 16 at 8 warps, 64 in launches past KIE_ATTN_LONG_FROM
    cases = [(0, "ieee", 16, 8, 1), (0, "tf32x3", 16, 8, 1), (0, "tf32", 16, 8, 1), (0, "tf32x3", 64, 8, 1),
             (0, "tf32x3", 16, 8, 3), (0, "bf16x2", 16, 8, 1), (0, "bf16", 16, 8, 1), (0, "bf16x2", 64, 8, 1)]
    if a.more:
        cases += [(0, "tf32x3", 32, 8, 1), (2, "tf32x3", 16, 8, 1), (0, "tf32x3", 16, 4, 1), (1, "ieee", 16, 8, 1),
                  (2, "ieee", 16, 8, 1), (0, "ieee", 64, 8, 1), (0, "ieee", 16, 8, 3), (0, "ieee", 32, 8, 1),
                  (0, "ieee", 16, 4, 1)]
    for pos in a.contexts:
        for others, prec, bt, nw, ns in cases:
            try:
                r = run_case(pos, others, prec, n_splits=ns,
                             reps=a.reps if pos < 4096 else max(10, a.reps // 10), block_t=bt, num_warps=nw)
            except Exception as e:   # noqa: BLE001 -- one failing variant must not lose the others' numbers
                r = dict(pos=pos, others=others, prec=prec, block_t=bt, num_warps=nw, n_splits=ns,
                         error=repr(e)[:300])
            print(json.dumps(r), flush=True)
            rows.append(r)
    res = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(0),
               torch=torch.__version__, triton=triton.__version__, shape=QWEN3, rows=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

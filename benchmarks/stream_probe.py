"""How fast ONE persistent program per SM streams a monokernel task, with no dependencies and no opcode switch:
the monokernel's own stream functions (kernels/monokernel/stream.py) in a tiny kernel, one task after another
per program, each task's first tile loaded right before the call (as after a wait: no overlap between tasks).
Beside them, `copy`: the same task bytes read by a plain tl.range loop of 16-byte vector loads (the ceiling of
this structure: one program, one task at a time) and the read-bandwidth probe of the same process. `tileglu`
runs the same gate/up tasks through the graph backend's tile loop (kernels/tiles.py `_tile`: 3.6 SASS instructions
per fp8 weight offline at 16 x 512 / 4 warps, where the monokernel's stream_glu loop body is ~7.7 with its
once-per-row-chunk epilogue inside): the loop's cost at monokernel occupancy, against stream_glu's.

It isolates the streaming loop's cost from everything else the monokernel does, so a tile shape / pipeline /
x-layout choice can be measured in seconds instead of through whole decode steps. GPU only.

    python benchmarks/stream_probe.py --out probe.json
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import triton
import triton.language as tl

from kie_moe.kccl.sync import signal, wait
from kie_moe.kernels.monokernel.prefetch import prefetch_rows
from kie_moe.kernels.monokernel.stream import stream_gemv, stream_glu, tile
from kie_moe.kernels.tiles import _glu, _rstd, _tile
from kie_moe.kernels.fp4_mma import _lane_warp, _mine, _quad_sum
from kie_moe.kernels.fp8_mma import fp8_rows_dot, fp8_rows_first
from kie_moe.kernels.monokernel.mma8 import mma8_glu_task, scratch_words


@triton.jit
def _glu_probe(wg, wu, s_ptr, f_ptr, x_ptr, nw_ptr, h_ptr, n_iter, ROWS: tl.constexpr, K: tl.constexpr,
               FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, XB: tl.constexpr, NS: tl.constexpr,
               ctr_ptr=None, PHASED: tl.constexpr = False, USE_ASM: tl.constexpr = False, NT: tl.constexpr = 256,
               HOT: tl.constexpr = False, PF: tl.constexpr = False):
    """Task (it, pid): rows [task * ROWS, +ROWS) of a gate / up pair (an expert's slice: expert_gate_up).
    PHASED: iteration `it` is a phase, as in the monokernel: a program loads its task's first tiles, waits until
    every program finished phase it - 1 (kccl.sync on one counter), streams, signals.
    HOT: every iteration re-reads the program's first task (L2-resident after the first: the loop's own rate
    when its weights come from L2). PF: the next task's rows are bulk-prefetched into L2 before this task runs
    (the monokernel's prefetch-before-wait, one task ahead)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    nr = pid * 0 + ROWS   # a tensor row count, as the monokernel's
    if PF:
        prefetch_rows(wg, pid * ROWS, nr, K, FMT, True)
        prefetch_rows(wu, pid * ROWS, nr, K, FMT, True)
    for it in range(n_iter):
        if HOT:
            r0 = pid * ROWS
        else:
            r0 = (it * n_prog + pid) * ROWS
        if PF:
            if it + 1 < n_iter:
                prefetch_rows(wg, r0 + n_prog * ROWS, nr, K, FMT, True)
                prefetch_rows(wu, r0 + n_prog * ROWS, nr, K, FMT, True)
        g0, gs0 = tile(wg, s_ptr, K, r0, r0 + ROWS, 0, 1, FMT, BN, BK)
        u0, us0 = tile(wu, s_ptr, K, r0, r0 + ROWS, 0, 1, FMT, BN, BK)
        if PHASED:
            wait(ctr_ptr, it * n_prog, ctr_ptr + 1, 2_000_000_000, USE_ASM, False, NT)
        stream_glu(wg, wu, s_ptr, s_ptr, f_ptr, f_ptr, g0, u0, gs0, us0, K, r0, r0 + ROWS, x_ptr, nw_ptr, 1e-6,
                   f_ptr, f_ptr, h_ptr, 0.0, 0.0, False, 0, FMT, BN, BK, XB, NS)
        if PHASED:
            signal(ctr_ptr, 1, USE_ASM)


@triton.jit
def _gemv_probe(w, s_ptr, f_ptr, x_ptr, nw_ptr, y_ptr, n_iter, ROWS: tl.constexpr, K: tl.constexpr,
                FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, XB: tl.constexpr, NS: tl.constexpr):
    """Task (it, pid): rows [task * ROWS, +ROWS) of one matrix with the input RMSNorm (qkv_proj)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    for it in range(n_iter):
        r0 = (it * n_prog + pid) * ROWS
        w0, s0 = tile(w, s_ptr, K, r0, r0 + ROWS, 0, 1, FMT, BN, BK)
        stream_gemv(w, s_ptr, f_ptr, w0, s0, K, r0, r0 + ROWS, x_ptr, nw_ptr, 1e-6, f_ptr, y_ptr, y_ptr, 0,
                    f_ptr, y_ptr, 0, 1.0, 0, 0, True, False, False, False, FMT, BN, BK, XB, NS)


@triton.jit
def _tile_glu_probe(wg, wu, s_ptr, f_ptr, x_ptr, nw_ptr, h_ptr, n_iter, ROWS: tl.constexpr, K: tl.constexpr,
                    FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PIPE: tl.constexpr,
                    HOT: tl.constexpr = False):
    """The same tasks through the graph backend's tile loop (kernels/tiles.py `_tile`, what `_glu_kernel` runs per
    program) instead of the monokernel's stream_glu: per BN-row chunk the gate rows over all of K, then the up rows,
    x read as a broadcast tile in the weights' layout, one reduction per chunk. fp8 rows' scales: f_ptr. Float and
    fp8 formats (FMT 0 / 1)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    r = _rstd(x_ptr, K, 1e-6, 1024)
    for it in range(n_iter):
        if HOT:   # as _glu_probe's HOT
            r0 = pid * ROWS
        else:
            r0 = (it * n_prog + pid) * ROWS
        for c in range(0, ROWS, BN):
            n0 = r0 + c
            g = _tile(FMT, wg, K, f_ptr, 1, 0, f_ptr, x_ptr, nw_ptr, 0, n0, r0 + ROWS, 0, K, True, BN, BK, PIPE)
            u = _tile(FMT, wu, K, f_ptr, 1, 0, f_ptr, x_ptr, nw_ptr, 0, n0, r0 + ROWS, 0, K, True, BN, BK, PIPE)
            rows = n0 + tl.arange(0, BN)
            tl.store(h_ptr + rows, _glu(g * r, u * r, 0.0, 0.0, 0), mask=rows < r0 + ROWS)


@triton.jit
def _mma_probe(w_ptr, xh_ptr, y_ptr, n_iter, ctr_ptr, K: tl.constexpr, RB: tl.constexpr, NW: tl.constexpr,
               PIECES: tl.constexpr, PHASED: tl.constexpr, USE_ASM: tl.constexpr, NT: tl.constexpr):
    """Task (it, pid): rows [task * 16 RB NW, +16 RB NW) of an fp8 matrix [R, K] through kernels/fp8_mma.py's loop
    (each warp 16 RB whole rows), quad sums stored unscaled. PHASED: as _glu_probe's (the task's first step of loads
    issued before the wait, as a monokernel task would)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    lane, warp = _lane_warp(NW)
    r = lane >> 2
    q = lane & 3
    wq = w_ptr.to(tl.pointer_type(tl.uint32))
    xq = xh_ptr.to(tl.pointer_type(tl.uint32))
    KW: tl.constexpr = K // 4
    for it in range(n_iter):
        base = (it * n_prog + pid) * (16 * RB * NW) + warp * (16 * RB)
        ra0 = (base + r).to(tl.int64)
        first = fp8_rows_first(wq, ra0, ra0 + 8, wq, ra0 + 16, ra0 + 24, KW, q, KW, 0, RB, PIECES)
        if PHASED:
            wait(ctr_ptr, it * n_prog, ctr_ptr + 1, 2_000_000_000, USE_ASM, False, NT)
        y0, y1, y2, y3 = fp8_rows_dot(xq, wq, ra0, ra0 + 8, wq, ra0 + 16, ra0 + 24, KW, q, KW, _mine(r, q), 0,
                                      (KW + 16 * PIECES - 1) // (16 * PIECES), RB, PIECES, first)
        lead = q == 0
        tl.store(y_ptr + ra0, _quad_sum(y0, NW), mask=lead)
        tl.store(y_ptr + ra0 + 8, _quad_sum(y1, NW), mask=lead)
        if RB == 2:
            tl.store(y_ptr + ra0 + 16, _quad_sum(y2, NW), mask=lead)
            tl.store(y_ptr + ra0 + 24, _quad_sum(y3, NW), mask=lead)
        if PHASED:
            signal(ctr_ptr, 1, USE_ASM)


@triton.jit
def _mma_glu_probe(wg_ptr, wu_ptr, f_ptr, x_ptr, nw_ptr, h_ptr, scr_ptr, n_iter, ctr_ptr, ROWS: tl.constexpr,
                   K: tl.constexpr, SCR: tl.constexpr, NW: tl.constexpr, BLOCK_X: tl.constexpr, PHASED: tl.constexpr,
                   PF: tl.constexpr, USE_ASM: tl.constexpr, NT: tl.constexpr):
    """The monokernel's own expert gate / up task (mma8.mma8_glu_task: x staged with its RMSNorm into the program's
    scratch, NW warps on ROWS / 16 row blocks of gate and up, silu(g) u with row factors f) one task after another per
    program: free-running, or PHASED as _glu_probe's (the task issues nothing before its wait: its expert is known
    only after it). PF: the task's bulk L2 prefetch of its gate and up rows after the wait, as the kernel's."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    wg = wg_ptr.to(tl.pointer_type(tl.uint32))
    wu = wu_ptr.to(tl.pointer_type(tl.uint32))
    for it in range(n_iter):
        r0 = (it * n_prog + pid) * ROWS
        if PHASED:
            wait(ctr_ptr, it * n_prog, ctr_ptr + 1, 2_000_000_000, USE_ASM, False, NT)
        if PF:
            prefetch_rows(wg_ptr, r0, r0 * 0 + ROWS, K, 1, USE_ASM)
            prefetch_rows(wu_ptr, r0, r0 * 0 + ROWS, K, 1, USE_ASM)
        mma8_glu_task(wg, wu, f_ptr, f_ptr, K, r0, r0 + ROWS, x_ptr, nw_ptr, 1e-6, f_ptr, f_ptr, h_ptr, 0.0, 0.0,
                      scr_ptr + pid * SCR, False, 0, NW, BLOCK_X)
        if PHASED:
            signal(ctr_ptr, 1, USE_ASM)


@triton.jit
def _tma_consume(acc, w, x, CONSUME: tl.constexpr):
    """One [BN, BK] weight tile into the chunk's accumulator: 0 fp32 products with x on the CUDA cores ([BN, BK]
    partials), 1 the codes' integer sum (uint8 tiles: what streaming costs with next to no work), 2 the tensor cores
    (the tile as fp16 against x in 16 equal columns: tl.dot, [BN, 16])."""
    if CONSUME == 0:
        acc += w.to(tl.float32) * x[None, :]
    elif CONSUME == 1:
        acc += w.to(tl.int32)
    else:
        xb = tl.broadcast_to(x.to(tl.float16)[:, None], (x.shape[0], 16))
        acc = tl.dot(w.to(tl.float16), xb, acc)
    return acc


@triton.jit
def _tma_glu_probe(wg_ptr, wu_ptr, f_ptr, x_ptr, h_ptr, n_iter, R, ctr_ptr, ROWS: tl.constexpr, K: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr, PHASED: tl.constexpr,
                   USE_ASM: tl.constexpr, NT: tl.constexpr, HOT: tl.constexpr = False, CONSUME: tl.constexpr = 0):
    """The expert gate / up task (rows [task * ROWS, +ROWS) of an fp8 gate / up pair, h = silu(g) * u with row
    factors f) with its weight tiles brought in by the TMA: [BN, BK] tiles through tensor descriptors, in one flat
    loop over (row chunk, K step) that Triton's pipeliner runs NS stages deep (shared-memory buffers and mbarriers,
    no registers held by loads in flight: NS x 2 x BN x BK bytes per program). CONSUME (_tma_consume): 0 CUDA-core
    products, 2 tensor cores (both h = the GLU), 1 the codes' sums only (uint8 weights; h = the row's gate + up code
    sum): the TMA's own streaming rate. ROWS % BN == 0. The question it answers (NOTES session 37): can one 8-warp
    program per SM keep HBM busy once its loads stop living in registers (kernels/fp8_mma.py's loop: ~17-20 GB/s
    per program free-running, 24 KB in flight)? PHASED / HOT as _glu_probe's."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    dg = tl.make_tensor_descriptor(wg_ptr, shape=[R, K], strides=[K, 1], block_shape=[BN, BK])
    du = tl.make_tensor_descriptor(wu_ptr, shape=[R, K], strides=[K, 1], block_shape=[BN, BK])
    NK: tl.constexpr = K // BK
    NCH: tl.constexpr = ROWS // BN
    AW: tl.constexpr = 16 if CONSUME == 2 else BK
    ADT: tl.constexpr = tl.int32 if CONSUME == 1 else tl.float32
    offs_k = tl.arange(0, BK)
    offs_n = tl.arange(0, BN)
    for it in range(n_iter):
        if HOT:
            r0 = pid * ROWS
        else:
            r0 = (it * n_prog + pid) * ROWS
        if PHASED:
            wait(ctr_ptr, it * n_prog, ctr_ptr + 1, 2_000_000_000, USE_ASM, False, NT)
        ag = tl.zeros((BN, AW), dtype=ADT)
        au = tl.zeros((BN, AW), dtype=ADT)
        for i in tl.range(0, NCH * NK, num_stages=NS):
            c = i // NK
            k = (i - c * NK) * BK
            x = tl.load(x_ptr + k + offs_k)
            ag = _tma_consume(ag, dg.load([r0 + c * BN, k]), x, CONSUME)
            au = _tma_consume(au, du.load([r0 + c * BN, k]), x, CONSUME)
            if k == K - BK:   # the chunk's last K step: its BN rows' sums, the GLU, one store
                rows = r0 + c * BN + offs_n
                if CONSUME == 1:
                    tl.store(h_ptr + rows, (tl.sum(ag, axis=1) + tl.sum(au, axis=1)).to(tl.float32))
                else:
                    g = tl.sum(ag, axis=1) * (tl.load(f_ptr + rows) / (AW if CONSUME == 2 else 1))
                    u = tl.sum(au, axis=1) * (tl.load(f_ptr + rows) / (AW if CONSUME == 2 else 1))
                    tl.store(h_ptr + rows, g * tl.sigmoid(g) * u)
                ag = tl.zeros((BN, AW), dtype=ADT)
                au = tl.zeros((BN, AW), dtype=ADT)
        if PHASED:
            signal(ctr_ptr, 1, USE_ASM)


@triton.jit
def _copy_probe(w, out_ptr, n_iter, TASK: tl.constexpr, BLOCK: tl.constexpr, NS: tl.constexpr,
                HOT: tl.constexpr = False):
    """Task (it, pid): TASK int32 words read in [BLOCK] steps through a pipelined loop, summed (kept alive)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for it in range(n_iter):
        if HOT:
            base = pid.to(tl.int64) * TASK
        else:
            base = (it * n_prog + pid).to(tl.int64) * TASK
        for k in tl.range(0, TASK, BLOCK, num_stages=NS):
            acc += tl.load(w + base + k + tl.arange(0, BLOCK))
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


def read_probe_gbps() -> float:
    from monokernel_bench import read_probe_gbps as probe
    return probe()


def _fp8_gate_up(rows: int, k: int, dev):
    """An fp8 gate / up pair [rows, k] of random codes, unit row factors, x [k], the output h and a phase counter."""
    import torch
    wg, wu = (torch.randn(rows, k, device=dev).to(torch.float8_e4m3fn) for _ in range(2))
    return (wg, wu, torch.ones(rows, device=dev), torch.randn(k, device=dev), torch.empty(rows, device=dev),
            torch.zeros(2, dtype=torch.int32, device=dev))


def run_point(kind: str, fmt: int, rows: int, k: int, bn: int, bk: int, xb: int, ns: int, warps: int,
              per_sm: int, n_sms: int, n_iter: int) -> dict:
    import torch
    import triton.testing as tt
    dev = "cuda"
    # "-hot": every iteration re-reads the program's first task (from L2; glu, copy, tma); "-pf": the next task is
    # bulk-prefetched into L2 before the current one runs (glu only). gbps then counts bytes the loop consumed, not
    # HBM traffic.
    kind, _, mode = kind.partition("-")
    hot, pf = mode == "hot", mode == "pf"
    n_prog = n_sms * per_sm
    r_total = n_prog * n_iter * rows
    if kind in ("mma", "mmaphased"):   # fp8 through kernels/fp8_mma.py: bn = row blocks per warp, bk = pieces
        if rows != 16 * bn * warps:
            raise ValueError(f"{kind}: rows per task must be 16 x {bn} x {warps}, got {rows}")
        w = torch.randint(0, 126, (r_total, k), dtype=torch.uint8, device=dev)   # finite e4m3 codes
        xh = torch.randn(k, device=dev).half()
        y = torch.empty(r_total, device=dev)
        ctr = torch.zeros(2, dtype=torch.int32, device=dev)
        phased = kind == "mmaphased"
        opts = dict(num_warps=warps, launch_cooperative_grid=phased)

        def fn():
            ctr.zero_()
            _mma_probe[(n_prog,)](w, xh, y, n_iter, ctr, k, bn, warps, bk, phased, True, 32 * warps, **opts)
        nbytes = r_total * k
    elif kind in ("mmaglu", "mmagluphased"):   # the monokernel's gate / up task; bk = 1: its L2 prefetch (PF)
        wg, wu, f, x, h, ctr = _fp8_gate_up(r_total, k, dev)
        nw = torch.ones(k, device=dev, dtype=torch.bfloat16)
        scr_w = scratch_words(k, warps)
        scr = torch.empty(n_prog * scr_w, device=dev)
        phased = kind == "mmagluphased"

        def fn():
            ctr.zero_()
            _mma_glu_probe[(n_prog,)](wg, wu, f, x, nw, h, scr, n_iter, ctr, rows, k, scr_w, warps,
                                      triton.next_power_of_2(k), phased, bool(bk), True, 32 * warps,
                                      num_warps=warps, launch_cooperative_grid=phased)
        nbytes = 2 * r_total * k
    elif kind.startswith("tma"):   # fp8 gate / up through TMA tiles: bn x bk tiles, ns pipeline stages; tma* free,
        # tma*phased phased; "sum" / "dot": _tma_consume's codes-only / tensor-core consumers (else CUDA-core products)
        if rows % bn:
            raise ValueError(f"{kind}: rows per task ({rows}) must be a multiple of bn ({bn})")
        consume = 1 if "sum" in kind else 2 if "dot" in kind else 0
        wg, wu, f, x, h, ctr = _fp8_gate_up(r_total, k, dev)
        if consume == 1:
            wg, wu = wg.view(torch.uint8), wu.view(torch.uint8)
        # device-side tensor descriptors need a global scratch (128 bytes per program)
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
        phased = kind.endswith("phased")

        def fn():
            ctr.zero_()
            _tma_glu_probe[(n_prog,)](wg, wu, f, x, h, n_iter, r_total, ctr, rows, k, bn, bk, ns, phased, True,
                                      32 * warps, hot, consume, num_warps=warps, launch_cooperative_grid=phased)
        nbytes = 2 * r_total * k
    elif kind == "copy":
        words = rows * k // 4   # rows x k bytes per task, as int32 words
        w = torch.randint(0, 100, (n_prog * n_iter * words,), dtype=torch.int32, device=dev)
        out = torch.empty(n_prog * bk, dtype=torch.int32, device=dev)
        fn = lambda: _copy_probe[(n_prog,)](w, out, n_iter, words, bk // 4, ns, hot, num_warps=warps)  # noqa: E731
        nbytes = w.numel() * 4
    else:
        n_mats = 1 if kind == "gemv" else 2
        if fmt == 0:
            mats = [torch.randn(r_total, k, device=dev, dtype=torch.bfloat16) for _ in range(n_mats)]
            s = torch.zeros(16, device=dev)
            per_row = 2 * k
        elif fmt == 1:
            mats = [torch.randn(r_total, k, device=dev).to(torch.float8_e4m3fn) for _ in range(n_mats)]
            s = torch.zeros(16, device=dev)
            per_row = k
        else:   # nvfp4: packed words [R, K/8] u32, e4m3 group-16 scales [R, K/16]
            mats = [torch.randint(0, 2 ** 31, (r_total, k // 8), dtype=torch.int32, device=dev).view(torch.uint32)
                    for _ in range(n_mats)]
            s = (torch.rand(r_total * k // 16, device=dev) + 0.5).to(torch.float8_e4m3fn)
            per_row = k // 2 + k // 16
        f = torch.ones(r_total, device=dev)
        x = torch.randn(k, device=dev)
        nw = torch.ones(k, device=dev, dtype=torch.bfloat16)
        h = torch.empty(r_total, device=dev)
        kern = {"gemv": _gemv_probe, "tileglu": _tile_glu_probe}.get(kind, _glu_probe)
        extra, opts = (), dict(num_warps=warps)
        ctr = torch.zeros(2, dtype=torch.int32, device=dev)
        if kind == "phased":   # one task per program per phase, phases chained by a counter
            extra, opts["launch_cooperative_grid"] = (ctr, True, True, 32 * warps), True
        elif hot or pf:
            extra = (ctr, False, False, 32 * warps, hot, pf)

        def fn():
            if extra:
                ctr.zero_()
            if kind == "tileglu":   # ns: the tile's PIPE (prefetch one K step); xb unused
                kern[(n_prog,)](*mats, s, f, x, nw, h, n_iter, rows, k, fmt, bn, bk, bool(ns), hot, **opts)
            else:
                kern[(n_prog,)](*mats, s, f, x, nw, h, n_iter, rows, k, fmt, bn, bk, xb, ns, *extra, **opts)
        nbytes = n_mats * r_total * per_row
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    ms = tt.do_bench(fn, warmup=20, rep=200, return_mode="median")
    task_bytes = nbytes / (n_prog * n_iter)
    return dict(gbps=nbytes / ms / 1e6, us_per_task=1e3 * ms / n_iter, task_kb=task_bytes / 1024,
                gbps_per_program=task_bytes / (1e3 * ms / n_iter) / 1e3, compile_s=compile_s, nbytes=nbytes)


# (kind, fmt, rows per task, K, BN, BK, XB, NS, warps, programs per SM); fmt: 0 bf16, 1 fp8, 3 nvfp4.
# Defaults of today's plan: expert_gate_up fp8 BN 8 / BK 1024 / NS 3 / XB 0 / 8 warps (qwen3: 48 rows x 2048).
POINTS = [
    ("copy", 1, 96, 2048, 0, 16384, 0, 3, 8, 1), ("copy", 1, 96, 2048, 0, 16384, 0, 6, 8, 1),
    ("copy", 1, 96, 2048, 0, 4096, 0, 4, 8, 1), ("copy", 1, 96, 2048, 0, 8192, 0, 4, 4, 2),
    ("glu", 1, 48, 2048, 8, 1024, 0, 3, 8, 1),     # the plan's expert_gate_up today
    ("glu", 1, 48, 2048, 8, 1024, 0, 0, 8, 1), ("glu", 1, 48, 2048, 8, 1024, 0, 2, 8, 1),
    ("glu", 1, 48, 2048, 8, 1024, 0, 4, 8, 1),
    ("glu", 1, 48, 2048, 16, 1024, 0, 3, 8, 1), ("glu", 1, 48, 2048, 16, 1024, 0, 0, 8, 1),
    ("glu", 1, 48, 2048, 32, 512, 0, 3, 8, 1), ("glu", 1, 48, 2048, 4, 2048, 0, 3, 8, 1),
    ("glu", 1, 48, 2048, 8, 1024, 1, 3, 8, 1), ("glu", 1, 48, 2048, 8, 1024, 1, 0, 8, 1),
    ("glu", 1, 48, 2048, 16, 512, 1, 3, 8, 1), ("glu", 1, 48, 2048, 4, 1024, 1, 0, 8, 1),
    ("glu", 1, 48, 2048, 8, 1024, 0, 3, 4, 2), ("glu", 1, 48, 2048, 8, 1024, 1, 0, 4, 2),
    ("glu", 1, 48, 2048, 8, 1024, 0, 3, 4, 1),
    ("glu", 0, 48, 2048, 8, 1024, 0, 3, 8, 1), ("glu", 0, 48, 2048, 8, 1024, 1, 0, 8, 1),
    ("glu", 3, 48, 2048, 4, 1024, 0, 3, 8, 1), ("glu", 3, 48, 2048, 8, 1024, 0, 3, 8, 1),
    ("glu", 3, 48, 2048, 8, 512, 0, 0, 8, 1),
    ("gemv", 0, 32, 2048, 16, 1024, 0, 3, 8, 1), ("gemv", 0, 32, 2048, 16, 1024, 1, 0, 8, 1),
    ("gemv", 0, 32, 2048, 8, 1024, 1, 0, 8, 1), ("gemv", 1, 64, 2048, 16, 1024, 0, 3, 8, 1),
    # more warps per SM: 2 programs of 8, 4 of 4, one of 16
    ("glu", 1, 48, 2048, 8, 1024, 0, 3, 8, 2), ("glu", 1, 48, 2048, 8, 1024, 0, 3, 4, 4),
    ("glu", 1, 48, 2048, 8, 1024, 0, 3, 16, 1), ("glu", 1, 48, 2048, 16, 1024, 0, 3, 8, 2),
    ("glu", 1, 48, 2048, 16, 1024, 0, 3, 16, 1), ("glu", 1, 48, 2048, 8, 512, 0, 3, 4, 4),
    ("gemv", 0, 32, 2048, 16, 1024, 0, 3, 8, 2), ("gemv", 0, 32, 2048, 16, 1024, 0, 3, 4, 4),
    ("gemv", 1, 64, 2048, 16, 1024, 0, 3, 8, 2), ("glu", 3, 48, 2048, 4, 1024, 0, 3, 8, 2),
    ("glu", 3, 48, 2048, 4, 1024, 0, 3, 4, 4),
    # phases (one task per program, then every program waits for all): a monokernel layer's expert gate/up phase
    # split over 1, 2 or 4 programs per SM (same bytes per phase)
    ("phased", 1, 48, 2048, 8, 1024, 0, 3, 8, 1), ("phased", 1, 24, 2048, 8, 1024, 0, 3, 4, 2),
    ("phased", 1, 12, 2048, 8, 1024, 0, 3, 4, 4), ("phased", 0, 48, 2048, 8, 1024, 0, 3, 8, 1),
    ("phased", 0, 24, 2048, 8, 1024, 0, 3, 4, 2),
    # the graph backend's tile loop (tiles._tile) on the same tasks, at monokernel occupancy (1 x 8, 1 x 4, 2 x 4)
    # and at the graph's (4 x 4); ns = PIPE
    ("tileglu", 1, 48, 2048, 16, 512, 0, 0, 4, 1), ("tileglu", 1, 48, 2048, 16, 512, 0, 0, 8, 1),
    ("tileglu", 1, 48, 2048, 16, 512, 0, 0, 4, 2), ("tileglu", 1, 48, 2048, 16, 512, 0, 0, 4, 4),
    ("tileglu", 1, 48, 2048, 8, 512, 0, 0, 4, 1), ("tileglu", 0, 48, 2048, 8, 512, 0, 1, 4, 1),
    ("tileglu", 0, 48, 2048, 8, 512, 0, 1, 4, 2),
    # session 7: the same loops with their weights in L2 (-hot) or bulk-prefetched one task ahead (-pf): is the
    # monokernel's loop slow because of HBM latency (then prefetch fixes it) or in itself (then -hot is slow too)?
    ("copy-hot", 1, 96, 2048, 0, 16384, 0, 3, 8, 1),
    ("glu-hot", 1, 48, 2048, 8, 1024, 0, 3, 8, 1), ("glu-hot", 1, 48, 2048, 16, 512, 1, 0, 8, 1),
    ("glu-hot", 1, 48, 2048, 16, 1024, 0, 3, 8, 1), ("glu-hot", 0, 48, 2048, 8, 1024, 0, 3, 8, 1),
    ("glu-hot", 1, 48, 2048, 8, 1024, 0, 3, 4, 4),
    ("tileglu-hot", 1, 48, 2048, 16, 512, 0, 0, 4, 1), ("tileglu-hot", 1, 48, 2048, 16, 512, 0, 0, 8, 1),
    ("tileglu-hot", 1, 48, 2048, 16, 512, 0, 1, 8, 1),
    ("glu-pf", 1, 48, 2048, 8, 1024, 0, 3, 8, 1), ("glu-pf", 1, 48, 2048, 16, 512, 1, 0, 8, 1),
    ("glu-pf", 0, 48, 2048, 8, 1024, 0, 3, 8, 1),
    ("glu-hot", 1, 48, 2048, 8, 512, 1, 0, 8, 1), ("glu", 1, 48, 2048, 8, 512, 1, 0, 8, 1),
    # session 28: kernels/fp8_mma.py's loop (bn = row blocks per warp, bk = 16-byte pieces per row and step; rows =
    # 16 x bn x warps per task), free-running and phased as the monokernel would run it: 128 / 256 KB tasks at
    # 1 x 8 (17 / 34 MB phases on 132 SMs), 2 x 4
    ("mma", 1, 128, 1024, 1, 2, 0, 0, 8, 1), ("mma", 1, 128, 2048, 1, 2, 0, 0, 8, 1),
    ("mma", 1, 128, 2048, 1, 4, 0, 0, 8, 1), ("mma", 1, 64, 2048, 1, 2, 0, 0, 4, 2),
    ("mmaphased", 1, 128, 1024, 1, 2, 0, 0, 8, 1), ("mmaphased", 1, 128, 2048, 1, 2, 0, 0, 8, 1),
    ("mmaphased", 1, 128, 2048, 1, 4, 0, 0, 8, 1), ("mmaphased", 1, 64, 2048, 1, 2, 0, 0, 4, 2),
    ("mmaphased", 1, 256, 2048, 2, 2, 0, 0, 8, 1),
    # session 37: the gate / up task's weight tiles through the TMA (tensor descriptors, Triton's pipeliner: ns
    # stages of 2 x bn x bk bytes in shared memory, nothing in registers), qwen3's 48-row x 2048 tasks at 1 x 8:
    # free-running, from L2 (-hot: the loop's own rate), phased (a 25 MB phase per iteration, as the monokernel's)
    ("tma", 1, 48, 2048, 16, 256, 0, 4, 8, 1), ("tma", 1, 48, 2048, 16, 256, 0, 8, 8, 1),
    ("tma", 1, 48, 2048, 16, 128, 0, 8, 8, 1),
    ("tma-hot", 1, 48, 2048, 16, 256, 0, 8, 8, 1),
    ("tmaphased", 1, 48, 2048, 16, 256, 0, 4, 8, 1), ("tmaphased", 1, 48, 2048, 16, 256, 0, 8, 8, 1),
    ("tmaphased", 1, 48, 2048, 16, 128, 0, 8, 8, 1),
    # session 37 (after the first run: the CUDA-core consumer is the limit, tma-hot 12.7 GB/s per program): the TMA
    # with next to no work (sum) and with the tensor cores (dot), free and phased
    ("tmasum", 1, 48, 2048, 16, 256, 0, 4, 8, 1), ("tmasum", 1, 48, 2048, 16, 256, 0, 8, 8, 1),
    ("tmasum-hot", 1, 48, 2048, 16, 256, 0, 8, 8, 1),
    ("tmasumphased", 1, 48, 2048, 16, 256, 0, 4, 8, 1), ("tmasumphased", 1, 48, 2048, 16, 256, 0, 8, 8, 1),
    ("tmadot", 1, 48, 2048, 16, 256, 0, 4, 8, 1), ("tmadot", 1, 48, 2048, 16, 256, 0, 8, 8, 1),
    ("tmadot-hot", 1, 48, 2048, 16, 256, 0, 8, 8, 1),
    ("tmadotphased", 1, 48, 2048, 16, 256, 0, 4, 8, 1), ("tmadotphased", 1, 48, 2048, 16, 256, 0, 8, 8, 1),
    # session 37: the monokernel's own gate / up task (mma8_glu_task, 48 rows: 3 blocks on 6 of 8 warps) free and
    # phased, with (bk 1) and without (bk 0) its bulk L2 prefetch: the phase as the monokernel runs it, without the
    # rest of the monokernel (its trace: ~17.3 us of work per task)
    ("mmaglu", 1, 48, 2048, 0, 1, 0, 0, 8, 1), ("mmagluphased", 1, 48, 2048, 0, 1, 0, 0, 8, 1),
    ("mmagluphased", 1, 48, 2048, 0, 0, 0, 0, 8, 1),
]
KEYS = ("kind", "fmt", "rows", "k", "bn", "bk", "xb", "ns", "warps", "per_sm")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--iters", type=int, default=16, help="tasks per program per launch")
    ap.add_argument("--only", default=None, help="comma-separated point indices")
    a = ap.parse_args(argv)
    import torch
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    probe = read_probe_gbps()
    print(f"probe {probe:.0f} GB/s ({probe / n_sms:.1f} per SM), {n_sms} SMs", flush=True)
    res = []
    pts = POINTS if a.only is None else [POINTS[int(i)] for i in a.only.split(",")]

    def save():   # after every point: a run cut by its time limit keeps what it measured
        if a.out:
            import torch as _t
            with open(a.out, "w") as fh:
                json.dump(dict(probe_gbps=probe, n_sms=n_sms, device=_t.cuda.get_device_name(0), torch=_t.__version__,
                               triton=triton.__version__, iters=a.iters, points=res), fh, indent=1)
    for p in pts:
        r = dict(zip(KEYS, p))
        try:
            r.update(run_point(*p, n_sms, a.iters))
            r["pct_of_probe"] = 100 * r["gbps"] / probe
        except Exception as ex:
            r["error"] = f"{type(ex).__name__}: {ex}"[:600]
            r["tb"] = traceback.format_exc()[-1500:]
        res.append(r)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if k != "tb"}),
              flush=True)
        save()


if __name__ == "__main__":
    main()

"""The monokernel's fp8 (and fp4, 16-bit: WK below) q|k|v, o_proj, dense MLP and routed-expert gate / up and
down tasks on the tensor cores (kernels/fp8_mma.py's loop); on by default since session 32, KIE_MONO_FP8_MMA=0 for
the CUDA-core tasks (NOTES.md sessions 28-29, 32). The down task needs I_MOE and the shared expert's width to be
multiples of 16 (fp4: 32; else it stays on the CUDA cores, stream.py).

Why: at one 8-warp program per SM the CUDA-core fp8 stream loops run 37-65% of the read probe, fp8_mma's loop
79-84% (H100, session 28). A task here is rows [r0, r_end) of an fp8 matrix [N, K] (row stride K bytes, u32 view
wq) with per-row factors f (the fp8 row scales): the program's NW warps take 16-row blocks; when the task has fewer
blocks than warps, KS = a power of two <= NW / blocks warps share a block, each over its own K range, and their
quad sums meet in a per-program scratch, added in warp order (the same bits every run). x reaches the mma as fp16
through the same scratch: x * nw * rstd (NORM: the RMSNorm scale applied before the fp16 rounding, which could not
hold every un-normed residual) or x, written by every thread after the task's wait, one barrier before the rows.

The routed experts' gate / up task (mma8_glu_task) is the same with two row blocks per warp: the gate rows and the
up rows of one 16-row block of the expert, h = glu(g, u). The down task (mma8_down_task) cuts its K into segments
(each routed slot, then the shared expert in I_MOE chunks) that a block's warps share; its x is h as fp16, each
slot's values times its routing weight first (h is not normed: fp16's range, 65504, bounds it).

WK, the weights' kind: 0 e4m3 (fp8_rows_dot). 1 / 2 (KIE_MONO_W16_MMA=1: the tasks whose weights are the bf16 /
fp16 arena's): the same tasks over 16-bit weight pairs (fp8_rows_dot's W16), no row factors (HAS_F False), x
staged as hi + lo pairs (kernels/fp8_mma.py's x16 layout, K words instead of K / 2). 3 / 4 (nvfp4 / mxfp4,
KIE_MONO_FP4_MMA, on: H100 qwen3-30b-a3b nvfp4 197.7 -> 296.7 tok/s, mxfp4 260.7 -> 316.7, NOTES.md session 40):
the qarena's e2m1 codes (in packing "mma" where plan.fp4_packed says, RP) through kernels/fp4_mma.py's loop
(fp4_rows_dot: 256 codes per step, the group scales from the qarena's u8 scale rows, one FFMA per group), x staged
in prepare_xh's order (xh_pos); nvfp4's row factors are the qarena's 2^14 / global scale, mxfp4 has none (its
2^-14 is in the E8M0 decode). The fp4 tasks need every K a multiple of 32 (whole 16-byte pieces and scale pairs;
fp4_mma._piece_load).

Scratch per program (fp32 words): [K / 2: x as fp16 | K: x16] [NW x 32: one quad sum per warp and row of each
block]; scratch_words. Reference: y[r] = f[r] * (W[r] . fp16(x')) (+ b[r]) (+ res[r]) with x' the normed input,
kernels/fp8_mma.py's rounding of x; the monokernel tests compare whole decode steps against the reference decoder.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kie_moe.kccl.sync import clock64

from ..fp4_mma import _lane_warp, _mine, _quad_sum, fp4_rows_dot, fp4_rows_first, xh_pos
from ..fp8_mma import fp8_rows_dot, fp8_rows_first
from .stream import glu

# 16-byte pieces per row and step: 2 = 128 contiguous bytes of a row (4, the graph backend's fp8_mma choice, was
# KIE_MMA8_PIECES=4 here: -7.8% on qwen3-30b-a3b fp8, NOTES.md session 31; the flag was removed in session 36; on
# the expert gate / up task alone -7.3% with its loop no faster, session 37)
PIECES = tl.constexpr(2)


def scratch_words(k_max: int, num_warps: int, w16: bool = False) -> int:
    """fp32 words of one program's scratch for tasks of input length <= k_max (a multiple of 4: 16-byte rows; the
    down task's input is TOPK * I_MOE + I_SH long); w16: 16-bit weight tasks (x as hi / lo pairs, twice the words)."""
    return -(-(k_max // (1 if w16 else 2) + 32 * num_warps) // 4) * 4


@triton.jit
def _kw(K: tl.constexpr, WK: tl.constexpr):
    """u32 words per weight row of length K: 4 e4m3 codes (WK 0), 2 bf16 / fp16 weights (1 / 2) or 8 e2m1 codes
    (3 nvfp4, 4 mxfp4) per word."""
    if WK == 0:
        n: tl.constexpr = K // 4
    elif WK <= 2:
        n: tl.constexpr = K // 2
    else:
        n: tl.constexpr = K // 8
    return n


@triton.jit
def _xw(K: tl.constexpr, WK: tl.constexpr):
    """Scratch words x of length K takes: fp16 pairs (WK 0, 3, 4) or hi and lo pairs (the x16 layout, WK 1 / 2)."""
    if WK == 1 or WK == 2:
        n: tl.constexpr = K
    else:
        n: tl.constexpr = K // 2
    return n


@triton.jit
def _kg(K: tl.constexpr, WK: tl.constexpr):
    """fp4 group scales (bytes) per weight row of length K: 16-code e4m3 groups (nvfp4), 32-code E8M0 (mxfp4)."""
    if WK == 3:
        n: tl.constexpr = K // 16
    elif WK == 4:
        n: tl.constexpr = K // 32
    else:
        n: tl.constexpr = 1
    return n


@triton.jit
def _first(wq0, sq0, wq1, sq1, ra, rb, swn, ssn, q, kw, kg, st, RB: tl.constexpr, WK: tl.constexpr):
    """The first step of loads of rows ra / rb of wq0 (and wq1 when RB == 2) from step st: fp8_rows_first's, or
    fp4_rows_first's with the fp4 scales (sq0 / sq1, ssn bytes per scale row, kg groups)."""
    if WK >= 3:
        f = fp4_rows_first(wq0, sq0, ra, rb, wq1, sq1, ra, rb, swn, ssn, q, kw, kg, st, RB, WK == 4)
    else:
        f = fp8_rows_first(wq0, ra, rb, wq1, ra, rb, swn, q, kw, st, RB, PIECES)
    return f


@triton.jit
def _dot(xq, wq0, sq0, wq1, sq1, ra, rb, swn, ssn, q, kw, kg, mine, st_lo, st_hi, RB: tl.constexpr, first, st_base,
         WK: tl.constexpr, E4B: tl.constexpr, RP: tl.constexpr = False):
    """fp8_rows_dot (WK 0-2) or fp4_rows_dot (3 / 4; E4B: e4m3 scales decoded from their bits; RP: codes in
    packing "mma") over steps [st_lo, st_hi) from st_base: 32 u32 words of each row per step either way (128 e4m3
    codes, 64 16-bit weights, 256 e2m1 codes)."""
    if WK >= 3:
        y = fp4_rows_dot(xq, wq0, sq0, ra, rb, wq1, sq1, ra, rb, swn, ssn, q, kw, kg, mine, st_lo, st_hi, RB,
                         WK == 4, RP, E4B, first, st_base)
    else:
        y = fp8_rows_dot(xq, wq0, ra, rb, wq1, ra, rb, swn, q, kw, mine, st_lo, st_hi, RB, PIECES, first, st_base,
                         WK)
    return y


@triton.jit
def _blocks_ks(r0, r_end, NW: tl.constexpr):
    """(16-row blocks of a task, warps per block KS): the largest power of two with KS * blocks <= NW. (All NW warps on
    each block, one block per round, for qwen3's 3-block tasks where 2 of 8 warps idle: -7.3%, NOTES session 37.)"""
    nblk = (r_end - r0 + 15) // 16
    ks = nblk * 0 + 1
    for _ in tl.static_range(4):      # NW <= 16: doubled while 2 ks blocks' worth of warps fit
        ks = ks * (1 + (ks * 2 * nblk <= NW).to(tl.int32))
    return nblk, tl.minimum(ks, NW)   # (an empty task: no block, ks stops at NW)


@triton.jit
def _geometry(r0, r_end, K: tl.constexpr, NW: tl.constexpr, WK: tl.constexpr):
    """(blocks, warps per block KS, steps per warp's K range) of a task."""
    nblk, ks = _blocks_ks(r0, r_end, NW)
    n_steps = nblk * 0 + (_kw(K, WK) + 16 * PIECES - 1) // (16 * PIECES)   # 128-byte steps over K
    return nblk, ks, (n_steps + ks - 1) // ks


@triton.jit
def _rows(r0, r_end, blk, r):
    base = r0 + blk * 16
    return tl.minimum(base + r, r_end - 1).to(tl.int64), tl.minimum(base + r + 8, r_end - 1).to(tl.int64)


@triton.jit
def mma8_first(wq, K: tl.constexpr, r0, r_end, NW: tl.constexpr, WK: tl.constexpr = 0, sq=0):
    """The task's first step of weight loads for this warp's first block and K range (before the wait); sq: the
    fp4 scales (u8, WK 3 / 4)."""
    lane, warp = _lane_warp(NW)
    nblk, ks, sks = _geometry(r0, r_end, K, NW, WK)
    ra, rb = _rows(r0, r_end, warp // ks, lane >> 2)
    return _first(wq, sq, wq, sq, ra, rb, _kw(K, WK), _kg(K, WK), lane & 3, _kw(K, WK), _kg(K, WK),
                  (warp % ks) * sks, 1, WK)


@triton.jit
def _store_x(scr_ptr, k, x, m, WK: tl.constexpr):
    """x[k] (fp32) into the scratch: fp16 (WK 0; 3 / 4 at xh_pos(k)), or the x16 layout's hi and lo halves of bf16
    (1) / fp16 (2): hi at element 16 (k // 8) + k % 8, lo 8 further."""
    if WK == 0:
        tl.store(scr_ptr.to(tl.pointer_type(tl.float16)) + k, x.to(tl.float16), mask=m)
    elif WK >= 3:   # fp4: fp4_mma.prepare_xh's order (each 8 as 0, 2, 1, 3, 4, 6, 5, 7)
        tl.store(scr_ptr.to(tl.pointer_type(tl.float16)) + xh_pos(k), x.to(tl.float16), mask=m)
    else:
        if WK == 1:
            xs = scr_ptr.to(tl.pointer_type(tl.bfloat16))
        else:
            xs = scr_ptr.to(tl.pointer_type(tl.float16))
        hi = x.to(xs.dtype.element_ty)
        i = k + (k // 8) * 8
        tl.store(xs + i, hi, mask=m)
        tl.store(xs + i + 8, (x - hi.to(tl.float32)).to(xs.dtype.element_ty), mask=m)


@triton.jit
def _stamp_loop(tr, trace_on, STAMP: tl.constexpr):
    """Trace mode (kernel MODE 3): clock64 into the task's trace row field 7 when its weight rows loop starts (after
    its input is staged), so trace.summarize can split the task's work into `pre` and the stream."""
    if STAMP:
        if trace_on:
            tl.store(tr + 7, clock64())


@triton.jit
def _stage_x(x_ptr, nw_ptr, eps, scr_ptr, K: tl.constexpr, NORM: tl.constexpr, BLOCK_X: tl.constexpr,
             WK: tl.constexpr = 0):
    """x (fp32, written by other programs: .cg) -> the scratch's start (_store_x), times nw and the RMSNorm scale
    first when NORM; a barrier after (every warp reads all of it), and one before (a previous task of this program
    may still be reading the last x from the same words). K <= BLOCK_X: one block, x and nw loaded once, together
    (one round trip where the blocked passes take one per block and pass; runtime KIE_MMA8_STAGE)."""
    tl.debug_barrier()
    offs = tl.arange(0, BLOCK_X)
    rstd = 1.0
    if K <= BLOCK_X:
        m = offs < K
        x = tl.load(x_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
        if NORM:
            w = tl.load(nw_ptr + offs, mask=m, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
            x = x * w * rstd
        _store_x(scr_ptr, offs, x, m, WK)
    else:
        if NORM:
            ss = tl.zeros((BLOCK_X,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_X):
                x = tl.load(x_ptr + k0 + offs, mask=k0 + offs < K, other=0.0, cache_modifier=".cg")
                ss += x * x
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
        for k0 in range(0, K, BLOCK_X):
            m = k0 + offs < K
            x = tl.load(x_ptr + k0 + offs, mask=m, other=0.0, cache_modifier=".cg")
            if NORM:
                x = x * tl.load(nw_ptr + k0 + offs, mask=m, other=0.0).to(tl.float32) * rstd
            _store_x(scr_ptr, k0 + offs, x, m, WK)
    tl.debug_barrier()


@triton.jit
def _ks_sum(s, red, warp, r, q, ks, lead, NW: tl.constexpr):
    """The block's KS K-range sums of one row, gathered by the block's first warp (lead) in warp order."""
    tl.store(red + warp * 16 + r, s, mask=q == 0)
    tl.debug_barrier()
    t = tl.zeros(s.shape, tl.float32)
    for j in tl.static_range(NW):
        t += tl.load(red + (warp + j) * 16 + r, mask=lead & (j < ks), other=0.0)
    return t


@triton.jit
def _block_sums(first, wq0, wq1, sq0, sq1, K: tl.constexpr, r0, r_end, blk, st0, sks, ks, scr_ptr, warp, r, q,
                RB: tl.constexpr, NW: tl.constexpr, WK: tl.constexpr, E4B: tl.constexpr, RP: tl.constexpr = False):
    """Rows r, r + 8 of block blk (of wq0, and of wq1 when RB == 2; fp4 scales sq0 / sq1) over this warp's K range,
    summed over the quad and, when KS > 1, over the block's warps: (rows of wq0 a / b, rows of wq1 a / b), valid
    in lead lanes."""
    ra, rb = _rows(r0, r_end, blk, r)
    y0, y1, y2, y3 = _dot(scr_ptr.to(tl.pointer_type(tl.uint32)), wq0, sq0, wq1, sq1, ra, rb, _kw(K, WK), _kg(K, WK),
                          q, _kw(K, WK), _kg(K, WK), _mine(r, q), 0, sks, RB, first, st0, WK, E4B, RP)
    return _warp_sums(y0, y1, y2, y3, ks, scr_ptr + _xw(K, WK), warp, r, q, RB, NW)


@triton.jit
def _warp_sums(y0, y1, y2, y3, ks, red, warp, r, q, RB: tl.constexpr, NW: tl.constexpr):
    """Lane partials (rows a / b of one or two row blocks) summed over the quad and, when KS > 1, over the block's
    KS warps through the scratch's words at red (after x): valid in lead lanes."""
    s0 = _quad_sum(y0, NW)
    s1 = _quad_sum(y1, NW)
    s2 = s0
    s3 = s1
    if RB == 2:
        s2 = _quad_sum(y2, NW)
        s3 = _quad_sum(y3, NW)
    if ks > 1:    # the block's K ranges meet in the scratch (after x's K / 2 words), added in warp order
        # Two halves used in turn: a half is written again only after the next _ks_sum's barrier, which every lead
        # reaches after its reads of it; with ks > 1 the task has one round, and the next task's writes to red
        # come after _stage_x's barriers.
        lead = (q == 0) & (warp % ks == 0)
        s0 = _ks_sum(s0, red, warp, r, q, ks, lead, NW)
        s1 = _ks_sum(s1, red + 16 * NW, warp, r, q, ks, lead, NW)
        if RB == 2:
            s2 = _ks_sum(s2, red, warp, r, q, ks, lead, NW)
            s3 = _ks_sum(s3, red + 16 * NW, warp, r, q, ks, lead, NW)
    return s0, s1, s2, s3


@triton.jit
def mma8_task(first, wq, f_ptr, K: tl.constexpr, r0, r_end, x_ptr, nw_ptr, eps, b_ptr, y_ptr, res_ptr, scr_ptr,
              NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NW: tl.constexpr,
              BLOCK_X: tl.constexpr, HAS_F: tl.constexpr = True, WK: tl.constexpr = 0, tr=0, trace_on=False,
              STAMP: tl.constexpr = False, sq=0, E4B: tl.constexpr = False, RP: tl.constexpr = False):
    """y[r] for r in [r0, r_end) (module docstring), after the task's wait; first = mma8_first(...). y may alias
    res (each task owns its rows). WK 1 / 2: bf16 / fp16 weights (no row factors: HAS_F False); 3 / 4: nvfp4 /
    mxfp4 codes with their group scales at sq (a byte pointer: the qarena's u8 view, or its e4m3 one for nvfp4;
    nvfp4's row factors 2^14 / global scale, mxfp4 none: HAS_F False; RP: the codes in packing "mma").
    STAMP: _stamp_loop."""
    _stage_x(x_ptr, nw_ptr, eps, scr_ptr, K, NORM, BLOCK_X, WK)
    _stamp_loop(tr, trace_on, STAMP)
    lane, warp = _lane_warp(NW)
    r = lane >> 2
    q = lane & 3
    nblk, ks, sks = _geometry(r0, r_end, K, NW, WK)
    G = NW // ks                       # blocks in flight per round
    lead = (q == 0) & (warp % ks == 0)
    st0 = (warp % ks) * sks
    for rd in range(0, (nblk + G - 1) // G):
        blk = rd * G + warp // ks
        if rd > 0:
            ra, rb = _rows(r0, r_end, blk, r)
            first = _first(wq, sq, wq, sq, ra, rb, _kw(K, WK), _kg(K, WK), q, _kw(K, WK), _kg(K, WK), st0, 1, WK)
        s0, s1, _, _ = _block_sums(first, wq, wq, sq, sq, K, r0, r_end, blk, st0, sks, ks, scr_ptr, warp, r, q, 1,
                                   NW, WK, E4B, RP)
        row = r0 + blk * 16 + r
        _epilogue(s0, row, lead & (blk < nblk) & (row < r_end), f_ptr, b_ptr, y_ptr, res_ptr, HAS_BIAS, HAS_RES,
                  HAS_F)
        _epilogue(s1, row + 8, lead & (blk < nblk) & (row + 8 < r_end), f_ptr, b_ptr, y_ptr, res_ptr, HAS_BIAS,
                  HAS_RES, HAS_F)


@triton.jit
def mma8_glu_task(wg, wu, fg_ptr, fu_ptr, K: tl.constexpr, r0, r_end, x_ptr, nw_ptr, eps, bg_ptr, bu_ptr, h_ptr,
                  limit, alpha, scr_ptr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, NW: tl.constexpr,
                  BLOCK_X: tl.constexpr, HAS_F: tl.constexpr = True, WK: tl.constexpr = 0, tr=0, trace_on=False,
                  STAMP: tl.constexpr = False, sg=0, su=0, E4B: tl.constexpr = False, RP: tl.constexpr = False):
    """h[r] = glu(fg[r] (Wg[r] . x') (+ bg[r]), fu[r] (Wu[r] . x') (+ bu[r])) for r in [r0, r_end), x' = fp16 of the
    RMS-normed x (stream_glu's task on the tensor cores: a routed expert's gate / up rows, known only after the
    wait, so no loads go before it; also the dense MLP's gate / up; WK as mma8_task's, sg / su the gate / up rows'
    fp4 scales). The first block's first
    step of loads goes out before the input staging, so the staging's round trip runs under the weights' latency."""
    lane, warp = _lane_warp(NW)
    r = lane >> 2
    q = lane & 3
    nblk, ks, sks = _geometry(r0, r_end, K, NW, WK)
    G = NW // ks
    lead = (q == 0) & (warp % ks == 0)
    st0 = (warp % ks) * sks
    ra, rb = _rows(r0, r_end, warp // ks, r)
    first = _first(wg, sg, wu, su, ra, rb, _kw(K, WK), _kg(K, WK), q, _kw(K, WK), _kg(K, WK), st0, 2, WK)
    _stage_x(x_ptr, nw_ptr, eps, scr_ptr, K, True, BLOCK_X, WK)
    _stamp_loop(tr, trace_on, STAMP)
    for rd in range(0, (nblk + G - 1) // G):
        blk = rd * G + warp // ks
        if rd > 0:
            ra, rb = _rows(r0, r_end, blk, r)
            first = _first(wg, sg, wu, su, ra, rb, _kw(K, WK), _kg(K, WK), q, _kw(K, WK), _kg(K, WK), st0, 2, WK)
        g0, g1, u0, u1 = _block_sums(first, wg, wu, sg, su, K, r0, r_end, blk, st0, sks, ks, scr_ptr, warp, r, q, 2,
                                     NW, WK, E4B, RP)
        row = r0 + blk * 16 + r
        _glu_out(g0, u0, row, lead & (blk < nblk) & (row < r_end), fg_ptr, fu_ptr, bg_ptr, bu_ptr, h_ptr, limit,
                 alpha, HAS_BIAS, ACT, HAS_F)
        _glu_out(g1, u1, row + 8, lead & (blk < nblk) & (row + 8 < r_end), fg_ptr, fu_ptr, bg_ptr, bu_ptr, h_ptr,
                 limit, alpha, HAS_BIAS, ACT, HAS_F)


@triton.jit
def _stage_h(h_ptr, wts_ptr, sg_ptr, scr_ptr, TOPK: tl.constexpr, I_MOE: tl.constexpr, I_SH: tl.constexpr,
             HAS_SH_GATE: tl.constexpr, BLOCK_X: tl.constexpr, WK: tl.constexpr):
    """h [TOPK * I_MOE + I_SH] (fp32, written by other programs: .cg) -> the scratch's start (_store_x), slot j's
    values times its routing weight and the shared expert's times its gate (stream_expert_down folds them into the
    activations the same way); barriers as _stage_x's."""
    tl.debug_barrier()
    KR: tl.constexpr = TOPK * I_MOE
    offs = tl.arange(0, BLOCK_X)
    sg = 1.0
    if HAS_SH_GATE:
        sg = tl.load(sg_ptr, cache_modifier=".cg")
    for k0 in range(0, KR + I_SH, BLOCK_X):
        k = k0 + offs
        m = k < KR + I_SH
        h = tl.load(h_ptr + k, mask=m, other=0.0, cache_modifier=".cg")
        wj = tl.load(wts_ptr + tl.minimum(k // I_MOE, TOPK - 1), mask=m & (k < KR), other=0.0, cache_modifier=".cg")
        _store_x(scr_ptr, k, h * tl.where(k < KR, wj, sg), m, WK)
    tl.debug_barrier()


@triton.jit
def _down_seg(g, ed_w, sd_w, eds, sds, ids_ptr, ed_f, sd_f, D: tl.constexpr, I_MOE: tl.constexpr,
              I_SH: tl.constexpr, TOPK: tl.constexpr, NSEG: tl.constexpr, WK: tl.constexpr):
    """Segment g (clamped to NSEG - 1) of a down task's K: routed slot g < TOPK, else chunk g - TOPK of the shared
    expert's row (I_MOE wide, the last one shorter). (weights' first word, row stride and K in u32 words, the row
    factors' offset, and for fp4 its scales' first byte, bytes per scale row and groups; else zeros); its x starts
    at _xw(g * I_MOE) words either way. ed_w / sd_w in the arena's elements (WK 1 / 2) or bytes (e4m3, e2m1), eds /
    sds the fp4 scales' bytes."""
    PW: tl.constexpr = 4 if WK == 0 else (2 if WK <= 2 else 8)   # weights per u32 word
    OU: tl.constexpr = 2 if (WK == 1 or WK == 2) else 4          # ed_w / sd_w units per word
    g = tl.minimum(g, NSEG - 1)
    is_exp = g < TOPK
    e = tl.load(ids_ptr + tl.minimum(g, TOPK - 1), cache_modifier=".cg").to(tl.int64)
    c = tl.maximum(g - TOPK, 0).to(tl.int64)
    w0 = tl.where(is_exp, ed_w // OU + e * (D * I_MOE // PW), sd_w // OU + c * (I_MOE // PW))
    swn = tl.where(is_exp, I_MOE // PW, I_SH // PW)
    kn = tl.where(is_exp, I_MOE, tl.minimum(I_MOE, I_SH - c * I_MOE))   # the segment's K
    s0 = w0 * 0
    ssn = swn * 0
    kg = swn * 0
    if WK >= 3:
        GS: tl.constexpr = 16 if WK == 3 else 32                    # codes per scale byte
        s0 = tl.where(is_exp, eds + e * (D * I_MOE // GS), sds + c * (I_MOE // GS))
        ssn = tl.where(is_exp, I_MOE // GS, I_SH // GS)
        kg = kn // GS
    return w0, swn, kn // PW, tl.where(is_exp, ed_f + e * D, sd_f), s0, ssn, kg


@triton.jit
def mma8_down_task(wq, ed_w, sd_w, f_ptr, ed_f, sd_f, b_ptr, r0, r_end, h_ptr, ids_ptr, wts_ptr, sg_ptr, x_ptr,
                   scr_ptr, D: tl.constexpr, I_MOE: tl.constexpr, I_SH: tl.constexpr, TOPK: tl.constexpr,
                   HAS_EBIAS: tl.constexpr, HAS_SH_GATE: tl.constexpr, NW: tl.constexpr, BLOCK_X: tl.constexpr,
                   HAS_F: tl.constexpr = True, WK: tl.constexpr = 0, tr=0, trace_on=False,
                   STAMP: tl.constexpr = False, sq=0, eds=0, sds=0, E4B: tl.constexpr = False,
                   RP: tl.constexpr = False):
    """x[r] += sum_j f_j[r] (Wdown[e_j][r] . fp16(w_j h_j)) + w_j bdown[e_j][r] + f_sh[r] (Wsh[r] . fp16(sg h_sh)),
    r in [r0, r_end) (stream_expert_down's task on the tensor cores; wq: the fp8 arena as u32, ed_w / sd_w the
    routed / shared down weights' byte offsets in it, ed_f / sd_f their row factors' in f_ptr). K is cut into
    NSEG segments (the TOPK slots, then the shared expert's row in I_MOE chunks); a block's KS warps take
    consecutive runs of segments, each warp scaling its lanes' partials by the segment's row factor before the
    quad and warp sums (in warp order: the same bits every run). The next segment's first loads are issued before
    the current one's loop. WK as mma8_task's (bf16 / fp16 experts, no row factors: HAS_F False; nvfp4 / mxfp4
    experts, their scales at sq + eds / sq + sds, bytes). fp4 needs I_MOE and I_SH multiples of 32."""
    NSEG: tl.constexpr = TOPK + (I_SH + I_MOE - 1) // I_MOE
    ST: tl.constexpr = (_kw(I_MOE, WK) + 16 * PIECES - 1) // (16 * PIECES)   # 32-word steps per segment
    lane, warp = _lane_warp(NW)
    r = lane >> 2
    q = lane & 3
    nblk, ks = _blocks_ks(r0, r_end, NW)
    spw = (NSEG + ks - 1) // ks       # segments per warp
    G = NW // ks
    lead = (q == 0) & (warp % ks == 0)
    g_lo = (warp % ks) * spw
    xq = scr_ptr.to(tl.pointer_type(tl.uint32))
    mine = _mine(r, q)
    n_st = nblk * 0 + ST                # (a tensor: fp8_rows_dot's bound does arithmetic on it)
    # the first block's first segment: its loads go out before h is staged (the staging under their latency)
    ra, rb = _rows(r0, r_end, warp // ks, r)
    w0, swn, kw, fo, so, ssn, kg = _down_seg(g_lo, ed_w, sd_w, eds, sds, ids_ptr, ed_f, sd_f, D, I_MOE, I_SH,
                                             TOPK, NSEG, WK)
    first = _first(wq + w0, sq + so, wq + w0, sq + so, ra, rb, swn, ssn, q, kw, kg, 0, 1, WK)
    _stage_h(h_ptr, wts_ptr, sg_ptr, scr_ptr, TOPK, I_MOE, I_SH, HAS_SH_GATE, BLOCK_X, WK)
    _stamp_loop(tr, trace_on, STAMP)
    for rd in range(0, (nblk + G - 1) // G):
        blk = rd * G + warp // ks
        if rd > 0:
            ra, rb = _rows(r0, r_end, blk, r)
            w0, swn, kw, fo, so, ssn, kg = _down_seg(g_lo, ed_w, sd_w, eds, sds, ids_ptr, ed_f, sd_f, D, I_MOE,
                                                     I_SH, TOPK, NSEG, WK)
            first = _first(wq + w0, sq + so, wq + w0, sq + so, ra, rb, swn, ssn, q, kw, kg, 0, 1, WK)
        acc_a = tl.zeros(q.shape, tl.float32)
        acc_b = tl.zeros(q.shape, tl.float32)
        for i in range(0, spw):
            g = g_lo + i
            wn, swn_n, kw_n, fo_n, so_n, ssn_n, kg_n = _down_seg(tl.minimum(g + 1, g_lo + spw - 1), ed_w, sd_w, eds,
                                                               sds, ids_ptr, ed_f, sd_f, D, I_MOE, I_SH, TOPK, NSEG,
                                                               WK)
            nxt = _first(wq + wn, sq + so_n, wq + wn, sq + so_n, ra, rb, swn_n, ssn_n, q, kw_n, kg_n, 0, 1, WK)
            # (a warp past the last segment, g >= NSEG when NSEG < KS: its sums are dropped below; its x is the
            # last segment's, not words past the staged h -- another program's scratch, or past the buffer)
            ya, yb, _, _ = _dot(xq + tl.minimum(g, NSEG - 1) * _xw(I_MOE, WK), wq + w0, sq + so, wq + w0, sq + so, ra,
                                rb, swn, ssn, q, kw, kg, mine, 0, n_st, 1, first, 0, WK, E4B, RP)
            ok = g < NSEG
            if HAS_F:
                ya = ya * tl.load(f_ptr + fo + ra)
                yb = yb * tl.load(f_ptr + fo + rb)
            acc_a += tl.where(ok, ya, 0.0)
            acc_b += tl.where(ok, yb, 0.0)
            first = nxt
            w0, swn, kw, fo, so, ssn, kg = wn, swn_n, kw_n, fo_n, so_n, ssn_n, kg_n
        s0, s1, _, _ = _warp_sums(acc_a, acc_b, acc_a, acc_b, ks, scr_ptr + _xw(TOPK * I_MOE + I_SH, WK), warp,
                                  r, q, 1, NW)
        row = r0 + blk * 16 + r
        _down_out(s0, row, lead & (blk < nblk) & (row < r_end), ids_ptr, wts_ptr, b_ptr, x_ptr, D, TOPK,
                  HAS_EBIAS)
        _down_out(s1, row + 8, lead & (blk < nblk) & (row + 8 < r_end), ids_ptr, wts_ptr, b_ptr, x_ptr, D, TOPK,
                  HAS_EBIAS)


@triton.jit
def _down_out(s, rr, ok, ids_ptr, wts_ptr, b_ptr, x_ptr, D: tl.constexpr, TOPK: tl.constexpr,
              HAS_EBIAS: tl.constexpr):
    """stream_expert_down's epilogue: the routed biases times their weights, the residual, one store."""
    if HAS_EBIAS:
        for j in tl.static_range(TOPK):
            e = tl.load(ids_ptr + j, cache_modifier=".cg").to(tl.int64)
            s += tl.load(wts_ptr + j, cache_modifier=".cg") * tl.load(b_ptr + e * D + rr, mask=ok,
                                                                      other=0.0).to(tl.float32)
    s += tl.load(x_ptr + rr, mask=ok, other=0.0, cache_modifier=".cg")
    tl.store(x_ptr + rr, s, mask=ok)


@triton.jit
def _epilogue(s, rr, ok, f_ptr, b_ptr, y_ptr, res_ptr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
              HAS_F: tl.constexpr = True):
    """stream_gemv's order: the row factor, the bias, the residual, one fp32 store."""
    y = s
    if HAS_F:
        y = y * tl.load(f_ptr + rr, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rr, mask=ok, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(res_ptr + rr, mask=ok, other=0.0, cache_modifier=".cg")
    tl.store(y_ptr + rr, y, mask=ok)


@triton.jit
def _glu_out(g, u, rr, ok, fg_ptr, fu_ptr, bg_ptr, bu_ptr, h_ptr, limit, alpha, HAS_BIAS: tl.constexpr,
             ACT: tl.constexpr, HAS_F: tl.constexpr = True):
    """stream_glu's epilogue: row factors, biases, the GLU, one store."""
    if HAS_F:
        g = g * tl.load(fg_ptr + rr, mask=ok, other=0.0)
        u = u * tl.load(fu_ptr + rr, mask=ok, other=0.0)
    if HAS_BIAS:
        g += tl.load(bg_ptr + rr, mask=ok, other=0.0).to(tl.float32)
        u += tl.load(bu_ptr + rr, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + rr, glu(g, u, limit, alpha, ACT), mask=ok)

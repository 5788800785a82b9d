"""Routed experts of one token on the tensor cores, for nvfp4 / mxfp4 expert stacks (kernels/fp4_mma.py's inner loop).

Why: moe.moe_experts decodes fp4 on the CUDA cores, issue-bound at ~62% of the read probe in one big GEMV and
32-49% over >= 256 MB of active experts (H200, NOTES.md session 16). Here both expert launches run fp4_mma's loop
(_rows_dot): e2m1 decoded into mma.sync fragments, one fp32 FFMA per group for the scale.

- GLU launch, grid (cdiv(I, 16 NW), top_k): each warp takes 16 rows of expert ids[slot]'s gate as row block 0 and
  the same 16 rows of its up as row block 1, so one lane ends with gate and up of its rows: the GLU (+ biases) is
  its epilogue. h[slot] is stored as fp16 in the xh layout (prepare_xh's order), the down launch's input.
- down launch, grid (cdiv(H, 16 RB NW), SPLIT): each program sums its share of the slots, weights[slot] x
  Wd[e] h[slot] (+ weights[slot] x bd[e]) in its lanes' partial sums (one quad sum at the end); SPLIT > 1 programs
  per row tile store partials and the last one to finish adds them in split order (deterministic, as moe.py does).

Numerics differ from moe_experts' CUDA-core path in two roundings: x (RMS-normed) and h go to fp16 once (exact
products and fp32 sums otherwise; fp16 keeps 11 bits, but |h| > 65504 overflows: the CUDA-core path keeps h in fp32).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from .device_caps import e4m3_native
from .fp4_mma import (MMA_MAXNREG, _global_factor, _lane_warp, _mine, _quad_sum, _rows_dot,
                      mma_experts_unreadable, xh_input, xh_pos)
from .gemv import counters as _counters
from .gemv import num_sms
from .moe import expert_down_split, split_slots
from .pdl import launch_kw, pdl_begin, reg_cap
from .tiles import _glu, _store_out
from .weights import WeightHandle

# Launch shapes (rows per warp is fixed: 16 for the GLU, its block 1 being the up rows; 16 * RB for the down).
MMA_EXPERT_WARPS = 4
# Row blocks per warp of the down launch: None = auto_down_row_blocks (RB 2 where RB 1 would loop over >= 2 slots
# per program, else 1).
MMA_DOWN_ROW_BLOCKS: int | None = None
# The GLU launch's register cap per format (None: ptxas's choice). Two weight streams' pointers at ptxas's 128 cap
# spill (sm_90 offline: nvfp4 40 B, mxfp4 48 B of stack); uncapped they take 130 (nvfp4) / 100 (mxfp4) registers and
# none. Measured (kernels_micro `glu-r128` row, 4096 x 4096 top-10 / top-11): nvfp4 capped loses (H100 s18 74.6 ->
# 63.7%, H200 s19 59.2 -> 56.5%), mxfp4 capped wins (H100 69.2 -> 69.9, H200 56.9 -> 61.2%).
MMA_GLU_MAXNREG: dict[str, int | None] = {"nvfp4": None, "mxfp4": 128}
# K chunks of the GLU launch (glu_k_split): None = auto_glu_k_split's wave rule (KIE_MMA_GLU_KS unset or auto);
# KIE_MMA_GLU_KS=N sets N for every launch (1: none).
MMA_GLU_K_SPLIT: int | None = (None if os.environ.get("KIE_MMA_GLU_KS", "auto") in ("", "auto")
                                else int(os.environ["KIE_MMA_GLU_KS"]))
# Resident GLU programs per SM at 4 warps (sm_90, 64K registers), by (format, packing "mma"): nvfp4 uncapped takes
# 130 registers in checkpoint packing (136 x 128 threads: 3) and 128 packed (4); mxfp4 at its 128 cap 4
# (MMA_GLU_MAXNREG; offline sm_90, triton 3.6, NOTES.md session 39).
_GLU_PROGRAMS_PER_SM = {("nvfp4", False): 3, ("nvfp4", True): 4, ("mxfp4", False): 4, ("mxfp4", True): 4}
# auto_glu_k_split cuts K only where one-chunk waves waste at least this share of the launch (ceil(w) / w).
_GLU_WAVE_WASTE = 1.3
# Resident programs per SM at the 128-register cap and 4 warps: the down launch splits its slots until the grid fills
# the GPU this many times over.
_PROGRAMS_PER_SM = 4
# The shortest K chunk (256-code steps) down_launch_split cuts the down launch's rows into.
_DOWN_MIN_STEPS = 8
# Not here: both launches as stream-K (persistent programs, each an equal share of all units' 256-code steps; commit
# f0e1718): slower at every shape on an H100 (4096 x 4096 nvfp4 77.2 -> 73.3%, DeepSeek-V3 74.5 -> 72.5%, Mixtral
# decode -1.4% / -3.5%), NOTES.md session 38: balanced, fully resident programs do not stream these loops faster.


@triton.jit
def _mma_glu_kernel(xh_ptr, ids_ptr, wg_ptr, wu_ptr, stride_wn, stride_we, sg_ptr, su_ptr, stride_sn, stride_se,
                    gsg_ptr, gsu_ptr, stride_ge, bg_ptr, stride_bge, stride_bgn, bu_ptr, stride_bue, stride_bun,
                    h_ptr, I, K, limit, alpha,
                    MX: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, NW: tl.constexpr,
                    RP: tl.constexpr = False, PDL: tl.constexpr = False, E4B: tl.constexpr = False,
                    part_ptr=None, cnt_ptr=None, KS: tl.constexpr = 1):
    """grid (cdiv(I, 16 * NW), top_k * KS): h[slot, I] (fp16, xh layout) = glu(Wg[e] x + bg[e], Wu[e] x + bu[e]),
    e = ids[slot]; xh = prepare_xh(x, norm) [K]; weights [E, I, K/2] u8, scales [E, I, K/16 | K/32] (bytes).
    KS > 1 (glu_k_split): program (t, s) takes slot s // KS over K chunk s % KS (whole 256-code steps) and stores
    its gate / up sums in part [top_k * KS, 2, I]; the last of a (row tile, slot)'s KS programs (a counter per pair
    in cnt_ptr, left at zero) adds them in chunk order and applies the GLU. Why: more, shorter programs where a
    one-chunk grid would leave a mostly empty second wave of resident programs (NOTES.md session 20)."""
    pdl_begin(PDL)
    lane, warp = _lane_warp(NW)
    r = lane >> 2
    q = lane & 3
    pid_n = tl.program_id(0)
    slot = tl.program_id(1) // KS
    e = tl.load(ids_ptr + slot).to(tl.int64)  # the only data-dependent address: which expert's rows to stream
    base = (pid_n * NW + warp) * 16
    ra = tl.minimum(base + r, I - 1).to(tl.int64)
    rb = tl.minimum(base + r + 8, I - 1).to(tl.int64)
    wg = (wg_ptr + e * stride_we).to(tl.pointer_type(tl.uint32))
    wu = (wu_ptr + e * stride_we).to(tl.pointer_type(tl.uint32))
    sg = (sg_ptr + e * stride_se).to(tl.pointer_type(tl.uint8))
    su = (su_ptr + e * stride_se).to(tl.pointer_type(tl.uint8))
    st_lo, st_hi = _chunk_steps(K // 8, KS, tl.program_id(1) % KS)
    ga, gb, ua, ub = _rows_dot(xh_ptr.to(tl.pointer_type(tl.uint32)), wg, sg, ra, rb, wu, su, ra, rb,
                               stride_wn // 4, stride_sn, q, K // 8, K // 32 if MX else K // 16, _mine(r, q), st_lo,
                               st_hi, 2, MX, RP, E4B)
    fg = _global_factor(gsg_ptr + e * stride_ge, MX)
    fu = _global_factor(gsu_ptr + e * stride_ge, MX)
    ga = _quad_sum(ga, NW) * fg
    gb = _quad_sum(gb, NW) * fg
    ua = _quad_sum(ua, NW) * fu
    ub = _quad_sum(ub, NW) * fu
    n = base + r
    lead = q == 0
    last = True
    if KS > 1:   # part row slot * KS + chunk: gate rows at [0, I), up rows at [I, 2I)
        ma, mb = lead & (n < I), lead & (n + 8 < I)
        ga, gb, ua, ub, last = _reduce_partials(ga, gb, ua, ub, n, 8, I, I + 8, ma, mb, ma, mb, part_ptr,
                                                2 * I, slot * KS, tl.program_id(1) % KS,
                                                cnt_ptr + slot * tl.num_programs(0) + pid_n, KS, True)
    if HAS_BIAS:
        ga += tl.load(bg_ptr + e * stride_bge + ra * stride_bgn).to(tl.float32)
        gb += tl.load(bg_ptr + e * stride_bge + rb * stride_bgn).to(tl.float32)
        ua += tl.load(bu_ptr + e * stride_bue + ra * stride_bun).to(tl.float32)
        ub += tl.load(bu_ptr + e * stride_bue + rb * stride_bun).to(tl.float32)
    h = h_ptr + slot * I
    tl.store(h + xh_pos(n), _glu(ga, ua, limit, alpha, ACT).to(tl.float16), mask=last & lead & (n < I))
    tl.store(h + xh_pos(n + 8), _glu(gb, ub, limit, alpha, ACT).to(tl.float16), mask=last & lead & (n + 8 < I))


@triton.jit
def _chunk_steps(KW, KS: tl.constexpr, chunk):
    """[st_lo, st_hi) of _rows_dot's 256-code steps over a K of KW u32 words cut into KS chunks: chunk `chunk`."""
    n_steps = tl.cdiv(KW, 32)
    per_chunk = tl.cdiv(n_steps, KS)
    st_lo = chunk * per_chunk
    return st_lo, tl.minimum(st_lo + per_chunk, n_steps)


@triton.jit
def _reduce_partials(v0, v1, v2, v3, n, d1, d2, d3, m0, m1, m2, m3, part_ptr, stride, first, me, cnt,
                     COUNT: tl.constexpr, FOUR: tl.constexpr):
    """COUNT programs share one piece of work, each holding lane sums v0, v1 (FOUR: v2, v3 too) for offsets n,
    n + d1 (n + d2, n + d3) of a part row (masks m*). This one stores them in part row first + me, bumps the counter
    cnt; the last to arrive adds rows first .. first + COUNT - 1 in that order (deterministic) and leaves cnt at
    zero. -> (sums, last): the sums are meaningful where last."""
    p = part_ptr + (first + me) * stride + n
    tl.store(p, v0, mask=m0)
    tl.store(p + d1, v1, mask=m1)
    if FOUR:
        tl.store(p + d2, v2, mask=m2)
        tl.store(p + d3, v3, mask=m3)
    tl.debug_barrier()  # every thread's partial store precedes the (release) counter bump
    ticket = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    last = ticket == COUNT - 1
    if last:
        zero = tl.zeros(v0.shape, tl.float32)
        v0, v1, v2, v3 = zero, zero, zero, zero
        for c in range(COUNT):   # .cg: read L2, never a stale L1 line of another SM's partial
            p = part_ptr + (first + c) * stride + n
            v0 += tl.load(p, mask=m0, other=0.0, cache_modifier=".cg")
            v1 += tl.load(p + d1, mask=m1, other=0.0, cache_modifier=".cg")
            if FOUR:
                v2 += tl.load(p + d2, mask=m2, other=0.0, cache_modifier=".cg")
                v3 += tl.load(p + d3, mask=m3, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(cnt, 0)
    return v0, v1, v2, v3, last


@triton.jit
def _bias_rows(bd_ptr, e, stride_bde, ra, rb, w):
    return (w * tl.load(bd_ptr + e * stride_bde + ra).to(tl.float32),
            w * tl.load(bd_ptr + e * stride_bde + rb).to(tl.float32))


@triton.jit
def _mma_down_kernel(h_ptr, ids_ptr, wts_ptr, w_ptr, stride_wn, stride_we, s_ptr, stride_sn, stride_se, gs_ptr,
                     stride_ge, bd_ptr, stride_bde, res_ptr, y_ptr, part_ptr, cnt_ptr, N, I, slots_per_split,
                     MX: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, TOP_K: tl.constexpr,
                     SPLIT: tl.constexpr, RB: tl.constexpr, NW: tl.constexpr, RP: tl.constexpr = False,
                     PDL: tl.constexpr = False, E4B: tl.constexpr = False, KS: tl.constexpr = 1):
    """grid (cdiv(N, 16 * RB * NW), SPLIT): y[N] = sum_slot wts[slot] * (Wd[e] h[slot] + bd[e]) (+ residual),
    e = ids[slot]; h [top_k, I] fp16 in the xh layout (the GLU launch); weights [E, N, I/2] u8. SPLIT = slot groups
    x KS: program s takes slot group s // KS and K chunk s % KS (whole 256-code steps; chunk 0 adds the biases)."""
    pdl_begin(PDL)
    lane, warp = _lane_warp(NW)
    r = lane >> 2
    q = lane & 3
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    grp = pid_s // KS
    st_lo, st_hi = _chunk_steps(I // 8, KS, pid_s % KS)
    base = (pid_n * NW + warp) * (16 * RB)
    ra0 = tl.minimum(base + r, N - 1).to(tl.int64)
    rb0 = tl.minimum(base + r + 8, N - 1).to(tl.int64)
    ra1 = tl.minimum(base + 16 + r, N - 1).to(tl.int64)
    rb1 = tl.minimum(base + 24 + r, N - 1).to(tl.int64)
    mine = _mine(r, q)
    zero = tl.zeros(q.shape, tl.float32)
    y0, y1, y2, y3 = zero, zero, zero, zero     # lane partials (rows r, r + 8 of block 0, of block 1)
    b0, b1, b2, b3 = zero, zero, zero, zero     # weighted biases of the same rows
    for slot in range(grp * slots_per_split, tl.minimum(grp * slots_per_split + slots_per_split, TOP_K)):
        e = tl.load(ids_ptr + slot).to(tl.int64)
        wq = (w_ptr + e * stride_we).to(tl.pointer_type(tl.uint32))
        sq = (s_ptr + e * stride_se).to(tl.pointer_type(tl.uint8))
        d0, d1, d2, d3 = _rows_dot((h_ptr + slot * I).to(tl.pointer_type(tl.uint32)), wq, sq, ra0, rb0, wq, sq,
                                   ra1, rb1, stride_wn // 4, stride_sn, q, I // 8, I // 32 if MX else I // 16, mine,
                                   st_lo, st_hi, RB, MX, RP, E4B)
        wt = tl.load(wts_ptr + slot)
        f = wt * _global_factor(gs_ptr + e * stride_ge, MX)
        y0 += d0 * f
        y1 += d1 * f
        y2 += d2 * f
        y3 += d3 * f
        if HAS_BIAS and pid_s % KS == 0:
            c0, c1 = _bias_rows(bd_ptr, e, stride_bde, ra0, rb0, wt)
            b0 += c0
            b1 += c1
            if RB == 2:
                c2, c3 = _bias_rows(bd_ptr, e, stride_bde, ra1, rb1, wt)
                b2 += c2
                b3 += c3
    n = base + r
    lead = q == 0
    y0 = _quad_sum(y0, NW) + b0
    y1 = _quad_sum(y1, NW) + b1
    if RB == 2:
        y2 = _quad_sum(y2, NW) + b2
        y3 = _quad_sum(y3, NW) + b3
    last = True
    if SPLIT > 1:   # part row pid_s of [SPLIT, N]
        y0, y1, y2, y3, last = _reduce_partials(y0, y1, y2, y3, n, 8, 16, 24, lead & (n < N),
                                                lead & (n + 8 < N), lead & (n + 16 < N), lead & (n + 24 < N),
                                                part_ptr, N, 0, pid_s, cnt_ptr + pid_n, SPLIT, RB == 2)
    if last:
        _store_out(y0, n, lead & (n < N), y_ptr, y_ptr, res_ptr, False, HAS_RES)
        _store_out(y1, n + 8, lead & (n + 8 < N), y_ptr, y_ptr, res_ptr, False, HAS_RES)
        if RB == 2:
            _store_out(y2, n + 16, lead & (n + 16 < N), y_ptr, y_ptr, res_ptr, False, HAS_RES)
            _store_out(y3, n + 24, lead & (n + 24 < N), y_ptr, y_ptr, res_ptr, False, HAS_RES)


def moe_experts_mma(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: WeightHandle,
                    w_up: WeightHandle, w_down: WeightHandle, *, act_id: int, limit: float, alpha: float,
                    gate_bias: tuple, up_bias: tuple, down_bias: tuple, residual: torch.Tensor | None,
                    norm_weight: torch.Tensor | None, eps: float, y: torch.Tensor, counters: torch.Tensor,
                    split: int | None = None, num_warps: int = MMA_EXPERT_WARPS,
                    down_row_blocks: int | None = MMA_DOWN_ROW_BLOCKS, maxnreg: int | None = MMA_MAXNREG,
                    glu_maxnreg: int | None | str = "auto", down_k_split: int | None = None,
                    glu_k_split: int | None = MMA_GLU_K_SPLIT, xh: torch.Tensor | None = None) -> torch.Tensor:
    """moe.moe_experts' body on the tensor cores; its arguments already checked there (biases as (tensor, stride
    0, stride 1) triples, y the output). Callers: moe.moe_experts (mma=True, or its size rule). split: slot groups
    of the down launch, down_k_split: K chunks of each (None: down_launch_split's choice); down_row_blocks: 1 or 2
    (None: auto_down_row_blocks's rule); glu_k_split: K chunks of the GLU launch (None: auto_glu_k_split's rule).
    xh: prepare_xh(x, norm_weight, eps) already made (route(xh_out=)): none made here."""
    I, H = w_gate.out_features, w_gate.in_features
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        why = mma_experts_unreadable(w)
        if why:
            raise ValueError(f"moe_experts(mma=True): {name}: {why}")
    if (w_gate.weight.stride() != w_up.weight.stride() or w_gate.scale.stride() != w_up.scale.stride()
            or w_gate.fmt != w_down.fmt or w_gate.packing != w_up.packing):
        raise ValueError("moe_experts(mma=True): w_gate and w_up must share format, packing and strides, and "
                         "w_down their format")
    gks = glu_k_chunks(glu_k_split, I, H, ids.numel(), w_gate.fmt, x.device, num_warps, w_gate.packing == "mma")
    if down_row_blocks is None and num_warps in (1, 2, 4, 8):
        down_row_blocks = auto_down_row_blocks(H, ids.numel(), I, x.device, split, num_warps)
    if down_row_blocks not in (1, 2) or num_warps not in (1, 2, 4, 8):
        raise ValueError(f"moe_experts(mma=True): down_row_blocks {down_row_blocks} (1 or 2), num_warps "
                         f"{num_warps} (1, 2, 4, 8)")
    dev = x.device
    top_k = ids.numel()
    mx = w_gate.fmt == "mxfp4"
    e4b = not e4m3_native(dev)
    cap = reg_cap(dev, maxnreg)
    if glu_maxnreg == "auto":
        glu_maxnreg = MMA_GLU_MAXNREG.get(w_gate.fmt)
    glu_cap = reg_cap(dev, glu_maxnreg)
    xh = xh_input(x.reshape(-1), xh, H, norm_weight, eps)
    h = torch.empty((top_k, I), dtype=torch.float16, device=dev)
    gs = lambda w: w.global_scale if w.global_scale is not None else h  # noqa: E731
    st = lambda w: w.global_scale.stride(0) if w.global_scale is not None else 0  # noqa: E731
    (bg, sbg0, sbg1), (bu, sbu0, sbu1), (bd, sbd0, _) = gate_bias, up_bias, down_bias
    glu_tiles = triton.cdiv(I, 16 * num_warps)
    ks_args = {}
    if gks > 1:
        ks_args = dict(part_ptr=torch.empty((top_k * gks, 2, I), dtype=torch.float32, device=dev),
                       cnt_ptr=_counters(dev, glu_tiles * top_k), KS=gks)
    _mma_glu_kernel[(glu_tiles, top_k * gks)](
        xh, ids, w_gate.weight, w_up.weight, w_gate.weight.stride(1), w_gate.weight.stride(0),
        w_gate.scale.view(torch.uint8), w_up.scale.view(torch.uint8), w_gate.scale.stride(1),
        w_gate.scale.stride(0), gs(w_gate), gs(w_up), st(w_gate),
        bg if bg is not None else h, sbg0, sbg1, bu if bu is not None else h, sbu0, sbu1, h, I, H, limit, alpha,
        MX=mx, HAS_BIAS=bg is not None, ACT=act_id, NW=num_warps, RP=w_gate.packing == "mma", E4B=e4b,
        num_warps=num_warps, **ks_args, **launch_kw(dev), **glu_cap)
    n_tiles = triton.cdiv(H, 16 * down_row_blocks * num_warps)
    per, groups, ks = down_launch_split(n_tiles, top_k, I, dev, split, down_k_split)
    split = groups * ks
    part = torch.empty((split, H), dtype=torch.float32, device=dev) if split > 1 else y
    _mma_down_kernel[(n_tiles, split)](
        h, ids, weights, w_down.weight, w_down.weight.stride(1), w_down.weight.stride(0),
        w_down.scale.view(torch.uint8), w_down.scale.stride(1), w_down.scale.stride(0), gs(w_down), st(w_down),
        bd if bd is not None else y, sbd0, residual if residual is not None else y, y, part,
        counters if split > 1 else y, H, I, per,
        MX=mx, HAS_BIAS=bd is not None, HAS_RES=residual is not None, TOP_K=top_k, SPLIT=split,
        RB=down_row_blocks, NW=num_warps, RP=w_down.packing == "mma", E4B=e4b, KS=ks,
        num_warps=num_warps, **launch_kw(dev), **cap)
    return y


def glu_k_chunks(glu_k_split: int | None, I: int, H: int, top_k: int, fmt: str, dev: torch.device,
                 num_warps: int = MMA_EXPERT_WARPS, packed: bool = False) -> int:
    """The GLU launch's K chunks for moe_experts_mma(glu_k_split=): None takes auto_glu_k_split's rule (at the
    default warps; 1 at others), and any count is clamped to the 256-code steps of K (no empty chunk)."""
    if glu_k_split is None:
        glu_k_split = auto_glu_k_split(I, H, top_k, fmt, dev, packed) if num_warps == MMA_EXPERT_WARPS else 1
    if not isinstance(glu_k_split, int) or glu_k_split < 1:
        raise ValueError(f"moe_experts(mma=True): glu_k_split {glu_k_split!r}: expected an int >= 1")
    return min(glu_k_split, _k_steps(H))


def _k_steps(K: int) -> int:
    """256-code steps of _rows_dot's K loop (K // 8 u32 words, 32 per step): the most chunks a K can be cut into."""
    return triton.cdiv(K // 8, 32)


def auto_glu_k_split(I: int, H: int, top_k: int, fmt: str, dev: torch.device, packed: bool = False) -> int:
    """K chunks of the GLU launch: 1, unless its (row tile, slot) programs overflow the resident slots (programs per
    SM x SMs) into a last wave so empty that ceil(w) / w >= _GLU_WAVE_WASTE (w: waves of programs); then the count
    of 2 or 3 chunks whose waves waste least (chunks add a partial-sum round trip). Measured on an H100 (session 21,
    both launches' % of the probe, chunks 1 / 2 / 3): Mixtral-8x7B nvfp4 (1.13 waves) 63.9 / 69.6 / 71.4, mxfp4 4096
    x 4096 top-11 (1.33) 70.3 / 76.7 / 77.4 -> 3 chunks; nvfp4 4096 top-10 (1.62) 77.0 / 74.1 / 74.6, under one
    wave (DeepSeek-V3 nvfp4 / mxfp4, Mixtral mxfp4) 74.3 / 66.5 / 73.9, 73.8 / 73.4 / 70.0, 73.3 / 71.5 / 71.7 -> 1."""
    if dev.type != "cuda":
        return 1                                               # the interpreter runs programs one by one
    slots = _GLU_PROGRAMS_PER_SM.get((fmt, packed), 4) * num_sms(dev)   # packed: weights in packing "mma"
    programs = triton.cdiv(I, 16 * MMA_EXPERT_WARPS) * top_k
    most = _k_steps(H)

    def waste(ks):
        w = programs * ks / slots
        return 1.0 if w <= 1 else math.ceil(w) / w
    if waste(1) < _GLU_WAVE_WASTE:
        return 1
    return min((ks for ks in (2, 3) if ks <= most), key=waste, default=1)


def auto_down_row_blocks(H: int, top_k: int, I: int, dev: torch.device, split: int | None = None,
                    num_warps: int = MMA_EXPERT_WARPS) -> int:
    """The down launch's row blocks per warp: 2 (32 rows, two independent 16-row mma chains per warp) where at RB 1
    down_launch_split would give each program >= 2 slots to stream one after the other, so RB 2 takes the same
    bytes per program as one slot of twice the rows; else 1 (RB 2 would halve the programs of a grid that already
    has one slot each). Measured on an H100 (session 20, kernels_micro `down-rb2` rows, both launches' % of the
    probe): nvfp4 4096 x 4096 top-10 (RB 1: 2 slots per program) 74.0 -> 76.7, DeepSeek-V3 (2) 73.4 -> 74.5, mxfp4
    4096 top-11 (2) 69.7 -> 70.8, DeepSeek-V3 mxfp4 (2) 74.1 -> 73.9; gpt-oss-120b (1 slot each) 46.7 -> 43.3 /
    44.0 -> 41.2, qwen3-30b-a3b (1) 30.9 -> 29.7 / 30.6 -> 29.2."""
    per, _, _ = down_launch_split(triton.cdiv(H, 16 * num_warps), top_k, I, dev, split)
    return 2 if per >= 2 else 1


def down_launch_split(n_tiles: int, top_k: int, I: int, dev: torch.device, split: int | None = None,
                      k_split: int | None = None) -> tuple[int, int, int]:
    """(slots per program, slot groups, K chunks) of the down launch's n_tiles row tiles. Slot groups first (as many
    as fill _PROGRAMS_PER_SM programs per SM, moe.expert_down_split); when top_k is too small for that, K is cut
    into chunks of at least _DOWN_MIN_STEPS 256-code steps (each program's first step waits a full load latency).
    Why: Mixtral-8x7B's top-2 of [4096, 14336] gave 64 tiles x 2 = 128 programs, ~4 warps per SM with 2 KB each in
    flight (H200 s19: the tensor-core experts only +9% in its decode step); with 4 chunks of 14 steps, 512."""
    if split is None:
        split = expert_down_split(n_tiles, top_k, dev, per_sm=_PROGRAMS_PER_SM)
    per, groups = split_slots(split, top_k)
    if k_split is None:
        by_steps = triton.cdiv(I, 256) // _DOWN_MIN_STEPS
        k_split = max(1, min(by_steps, _PROGRAMS_PER_SM * num_sms(dev) // max(n_tiles * groups, 1)))
    elif not isinstance(k_split, int) or k_split < 1:
        raise ValueError(f"moe_experts(mma=True): down_k_split {k_split!r}: expected an int >= 1")
    return per, groups, k_split


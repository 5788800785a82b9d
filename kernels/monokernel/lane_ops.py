"""Laneformer device functions of the monokernel (planner side and semantics: lanes.py; oracle: dense/reference.py).

x is [LANES, D] fp32, then xf [D] (the LM head's input), then the partial history hist [2, RING, LANES, D].

- stream_lane_out: a lane output task (wo or w2: [LANES, D, K] with K a lane's share) for rows [row0, r_end) of
  D: walks row chunk -> lane -> K step as ONE flat tile sequence (double-buffered across lanes and chunks, like
  stream.stream_expert_down), keeps every lane's partial of the chunk in registers [BLOCK_L, BLOCK_N] and, at the
  chunk's last lane, applies the lane combination (lane_combine) to x of those rows for every lane.
- lane_combine: layer i < DELAY: EARLY_COMM -> x_l += sum_m p_m; else x_l += sqrt(L) p_l. Layer i >= DELAY:
  USE_COMM -> x_l += p_l + (sum_m p_m(i - DELAY) - p_l(i - DELAY)) (from the ring); else x_l += sqrt(L) p_l.
  Same expression order as the reference's `x + reduce(p)`.
- lane_final_mean: xf[r] = mean_l rmsnorm(x_l)[r] * s_l[r] (final aggregation without pre_norm_lane_agg).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .qtile import acc_total, qload, qstep, qzeros, sszeros
from .stream import row_factor


@triton.jit
def lane_out_tile(w_ptr, s_ptr, K: tl.constexpr, D: tl.constexpr, row0, r_end, q, n, LANES: tl.constexpr,
                  FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile q of a lane output task's walk over W [LANES, D, K]: row chunk q // (LANES * NK), lane (q // NK) %
    LANES, K step q % NK; masked to nothing when q >= n."""
    NK: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    RU: tl.constexpr = K // 8 if FMT >= 3 else K        # a weight row in w_ptr units
    SC: tl.constexpr = (K + 127) // 128 if FMT == 2 else (K // 16 if FMT == 3 else K // 32)
    m = tl.zeros((), dtype=tl.int64) + (q // NK) % LANES    # (q may be a Python int: the caller's tile 0)
    rows = row0 + (q // (LANES * NK)) * BLOCK_N + tl.arange(0, BLOCK_N)
    return qload(w_ptr + m * (D * RU), s_ptr + m * (D * SC), rows, (rows < r_end) & (q < n), (q % NK) * BLOCK_K, K,
                 FMT, BLOCK_K)


@triton.jit
def lane_combine(p, rows, r_mask, x_ptr, hist_ptr, xf_ptr, layer, sub, write_xf, lane_scale,
                 D: tl.constexpr, LANES: tl.constexpr, DELAY: tl.constexpr, RING: tl.constexpr,
                 EARLY_COMM: tl.constexpr, USE_COMM: tl.constexpr, BLOCK_L: tl.constexpr):
    """x[l, rows] += the lane combination of this layer's partials p [BLOCK_L, BLOCK_N] (lanes >= LANES: zeros);
    this layer's partials go to the history ring; write_xf: xf[rows] = sum_l x[l, rows] afterwards."""
    offs_l = tl.arange(0, BLOCK_L)
    m2 = (offs_l < LANES)[:, None] & r_mask[None, :]
    idx = offs_l[:, None] * D + rows[None, :]
    total = tl.sum(p, axis=0)[None, :]                                      # sum_m p_m(i)   [1, BLOCK_N]
    if EARLY_COMM:
        early = total + p * 0.0
    else:
        early = lane_scale * p
    if USE_COMM:
        if DELAY == 0:   # plain TP every layer (the reference's old = p)
            late = p + (total - p)
        else:
            old = tl.load(hist_ptr + ((sub * RING + (layer - DELAY) % RING) * LANES) * D + idx,
                          mask=m2 & (layer >= DELAY), other=0.0, cache_modifier=".cg")     # p(i - d)
            late = p + (tl.sum(old, axis=0)[None, :] - old)
    else:
        late = lane_scale * p
    add = tl.where(layer < DELAY, early, late)
    xn = tl.load(x_ptr + idx, mask=m2, other=0.0, cache_modifier=".cg") + add
    tl.store(x_ptr + idx, xn, mask=m2)
    if USE_COMM:
        if DELAY > 0:
            tl.store(hist_ptr + ((sub * RING + layer % RING) * LANES) * D + idx, p, mask=m2)
    if write_xf != 0:
        tl.store(xf_ptr + rows, tl.sum(tl.where(m2, xn, 0.0), axis=0), mask=r_mask)


@triton.jit
def stream_lane_out(w_ptr, s_ptr, f_ptr, w_first, s_first, K: tl.constexpr, row0, r_end, a_ptr, x_ptr, hist_ptr,
                    xf_ptr, layer, sub, write_xf, lane_scale,
                    D: tl.constexpr, LANES: tl.constexpr, DELAY: tl.constexpr, RING: tl.constexpr,
                    EARLY_COMM: tl.constexpr, USE_COMM: tl.constexpr, FMT: tl.constexpr, BLOCK_L: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XB: tl.constexpr, NS: tl.constexpr = 0):
    """p_m[r] = W[m, r, :] . a[m * K : (m + 1) * K] for every lane m and r in [row0, r_end), then lane_combine per
    row chunk. a: the lanes' concatenated inputs (attention output or FFN hidden, lane-major). w_first / s_first:
    tile 0, loaded by the caller before its wait."""
    NK: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    PER: tl.constexpr = LANES * NK
    VEC: tl.constexpr = min(BLOCK_K, 128 // w_ptr.dtype.element_ty.primitive_bitwidth)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    n = (r_end - row0 + BLOCK_N - 1) // BLOCK_N * PER
    acc = qzeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
    ss = sszeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
    p = tl.zeros((BLOCK_L, BLOCK_N), dtype=tl.float32)
    w_cur = w_first
    s_cur = s_first
    for q in tl.range(0, n, num_stages=max(NS, 1)):
        if NS > 0:
            w_cur, s_cur = lane_out_tile(w_ptr, s_ptr, K, D, row0, r_end, q, n, LANES, FMT, BLOCK_N, BLOCK_K)
        else:
            w_nxt, s_nxt = lane_out_tile(w_ptr, s_ptr, K, D, row0, r_end, q + 1, n, LANES, FMT, BLOCK_N, BLOCK_K)
        m = (q // NK) % LANES
        acc, ss = qstep(acc, ss, w_cur, s_cur, a_ptr + m * K, a_ptr, 1.0, (q % NK) * BLOCK_K, K, False, False, FMT,
                        BLOCK_N, BLOCK_K, VEC, XB)
        if q % NK == NK - 1:   # lane m's partial of this row chunk is complete
            rows = row0 + (q // PER) * BLOCK_N + offs_n
            r_mask = rows < r_end
            y = row_factor(acc_total(acc), f_ptr + m * D, rows, r_mask, FMT)
            p = tl.where(offs_l[:, None] == m, y[None, :], p)
            acc = qzeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
            if m == LANES - 1:
                lane_combine(p, rows, r_mask, x_ptr, hist_ptr, xf_ptr, layer, sub, write_xf, lane_scale, D, LANES,
                             DELAY, RING, EARLY_COMM, USE_COMM, BLOCK_L)
        if NS == 0:
            w_cur = w_nxt
            s_cur = s_nxt


@triton.jit
def lane_final_mean(x_ptr, nw_ptr, xf_ptr, r0, r_end, eps, D: tl.constexpr, LANES: tl.constexpr,
                    LANE_NORM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK: tl.constexpr):
    """xf[r] = (1 / LANES) sum_l x_l[r] * rstd(x_l) * s_l[r] for r in [r0, r_end): each task takes every lane's
    rstd over all of D (x is L2-resident), then its rows. s: the final norm, [LANES, D] (LANE_NORM) or [D]."""
    offs_l = tl.arange(0, BLOCK_L)
    l_mask = offs_l < LANES
    ss = tl.zeros((BLOCK_L,), dtype=tl.float32)
    for k0 in range(0, D, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        m2 = l_mask[:, None] & (offs < D)[None, :]
        v = tl.load(x_ptr + offs_l[:, None] * D + offs[None, :], mask=m2, other=0.0, cache_modifier=".cg")
        ss += tl.sum(v * v, axis=1)
    rs = 1.0 / tl.sqrt(ss / D + eps)                                             # [BLOCK_L]
    for k0 in range(r0, r_end, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < r_end
        m2 = l_mask[:, None] & mask[None, :]
        v = tl.load(x_ptr + offs_l[:, None] * D + offs[None, :], mask=m2, other=0.0, cache_modifier=".cg")
        s = tl.load(nw_ptr + offs_l[:, None] * (D * LANE_NORM) + offs[None, :], mask=m2, other=0.0).to(tl.float32)
        tl.store(xf_ptr + offs, tl.sum(v * rs[:, None] * s, axis=0) / LANES, mask=mask)

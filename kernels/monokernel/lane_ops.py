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
- tensor parallel (TP > 0; lanes.py's docstring): lane_combine also writes the rank's pre-summed partial into the
  symmetric recv and reads the ranks' delayed ones from there; lane_reduce (same-layer totals), lane_sum and
  lane_final_reduce (final aggregation over the ranks).
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
def lane_combine(p, rows, r_mask, x_ptr, hist_ptr, xf_ptr, layer, sub, write_xf, lane_scale, sym_ptr, tp_rank,
                 D: tl.constexpr, LANES: tl.constexpr, DELAY: tl.constexpr, RING: tl.constexpr,
                 EARLY_COMM: tl.constexpr, USE_COMM: tl.constexpr, BLOCK_L: tl.constexpr, TP: tl.constexpr = 0):
    """x[l, rows] += the lane combination of this layer's partials p [BLOCK_L, BLOCK_N] (lanes >= LANES: zeros);
    this layer's partials go to the history ring; write_xf: xf[rows] = sum_l x[l, rows] afterwards.
    TP > 0 (this rank's lanes only; lanes.py): S = sum_l p_l goes to our row of the layer's slot of the symmetric
    recv (sym_ptr: [2 L, TP, D]; the caller puts it); a layer that needs its own layer's total leaves x to a
    REDUCE task (lane_reduce); a delayed layer reads the ranks' S of layer i - DELAY from recv."""
    offs_l = tl.arange(0, BLOCK_L)
    m2 = (offs_l < LANES)[:, None] & r_mask[None, :]
    idx = offs_l[:, None] * D + rows[None, :]
    if TP == 0:
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
    else:
        tl.store(sym_ptr + (layer * 2 + sub) * (TP * D) + tp_rank * D + rows, tl.sum(p, axis=0), mask=r_mask)
        same = layer < 0          # lanes.same_layer_total: the REDUCE task combines
        if EARLY_COMM:
            same = layer < DELAY
        if USE_COMM:
            if DELAY == 0:
                same = layer >= 0
        if same == 0:
            late = lane_scale * p
            if USE_COMM:
                if DELAY > 0:     # lanes.delayed: the task waited for layer i - DELAY's KCCL counter
                    ok = layer >= DELAY
                    src = sym_ptr + (layer - DELAY) * 2 * (TP * D) + sub * (TP * D)
                    tot = tl.load(src + rows, mask=r_mask & ok, other=0.0, cache_modifier=".cg")
                    for q in range(1, TP):   # rank order: the same total on every rank
                        tot += tl.load(src + q * D + rows, mask=r_mask & ok, other=0.0, cache_modifier=".cg")
                    old = tl.load(hist_ptr + ((sub * RING + (layer - DELAY) % RING) * LANES) * D + idx,
                                  mask=m2 & ok, other=0.0, cache_modifier=".cg")             # own p(i - d)
                    late = tl.where(ok, p + (tot[None, :] - old), late)
            xn = tl.load(x_ptr + idx, mask=m2, other=0.0, cache_modifier=".cg") + late
            tl.store(x_ptr + idx, xn, mask=m2)
        if USE_COMM:   # own partials: read d layers later (delayed) or by this layer's REDUCE (d = 0)
            tl.store(hist_ptr + ((sub * RING + layer % RING) * LANES) * D + idx, p, mask=m2)


@triton.jit
def lane_reduce(sym_ptr, x_ptr, hist_ptr, layer, sub, r0, r_end, D: tl.constexpr, LANES: tl.constexpr,
                DELAY: tl.constexpr, RING: tl.constexpr, TP: tl.constexpr, BLOCK_L: tl.constexpr,
                BLOCK: tl.constexpr):
    """Tensor parallel, a layer that needs its own layer's total (lanes.same_layer_total), rows [r0, r_end):
    total = sum_q S_q(i) in rank order; x_l += total (i < DELAY, early comm) or p_l + (total - p_l) (DELAY 0)."""
    offs_l = tl.arange(0, BLOCK_L)
    src = sym_ptr + (layer * 2 + sub) * (TP * D)
    for k0 in range(r0, r_end, BLOCK):
        rows = k0 + tl.arange(0, BLOCK)
        r_mask = rows < r_end
        tot = tl.load(src + rows, mask=r_mask, other=0.0, cache_modifier=".cg")
        for q in range(1, TP):
            tot += tl.load(src + q * D + rows, mask=r_mask, other=0.0, cache_modifier=".cg")
        m2 = (offs_l < LANES)[:, None] & r_mask[None, :]
        idx = offs_l[:, None] * D + rows[None, :]
        if DELAY == 0:
            p = tl.load(hist_ptr + ((sub * RING + layer % RING) * LANES) * D + idx, mask=m2, other=0.0,
                        cache_modifier=".cg")
            add = p + (tot[None, :] - p)
        else:
            add = tot[None, :] + tl.zeros((BLOCK_L, BLOCK), dtype=tl.float32)
        xn = tl.load(x_ptr + idx, mask=m2, other=0.0, cache_modifier=".cg") + add
        tl.store(x_ptr + idx, xn, mask=m2)


@triton.jit
def lane_sum(x_ptr, out_ptr, r0, r_end, D: tl.constexpr, LANES: tl.constexpr, BLOCK_L: tl.constexpr,
             BLOCK: tl.constexpr):
    """out[r] = sum_l x_l[r] over this rank's lanes (tensor parallel, pre_norm_lane_agg)."""
    offs_l = tl.arange(0, BLOCK_L)
    for k0 in range(r0, r_end, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < r_end
        m2 = (offs_l < LANES)[:, None] & mask[None, :]
        v = tl.load(x_ptr + offs_l[:, None] * D + offs[None, :], mask=m2, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + offs, tl.sum(v, axis=0), mask=mask)


@triton.jit
def lane_final_reduce(recv_ptr, xf_ptr, r0, r_end, D: tl.constexpr, TP: tl.constexpr, MEAN: tl.constexpr,
                      LANES_ALL: tl.constexpr, BLOCK: tl.constexpr):
    """xf[r] = sum_q recv_f[q, r] in rank order (/ LANES_ALL: the mean of the lanes' final norms)."""
    for k0 in range(r0, r_end, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < r_end
        acc = tl.load(recv_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for q in range(1, TP):
            acc += tl.load(recv_ptr + q * D + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if MEAN:
            acc = acc / LANES_ALL
        tl.store(xf_ptr + offs, acc, mask=mask)


@triton.jit
def stream_lane_out(w_ptr, s_ptr, f_ptr, w_first, s_first, K: tl.constexpr, row0, r_end, a_ptr, x_ptr, hist_ptr,
                    xf_ptr, layer, sub, write_xf, lane_scale, sym_ptr, tp_rank,
                    D: tl.constexpr, LANES: tl.constexpr, DELAY: tl.constexpr, RING: tl.constexpr,
                    EARLY_COMM: tl.constexpr, USE_COMM: tl.constexpr, FMT: tl.constexpr, BLOCK_L: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XB: tl.constexpr, NS: tl.constexpr = 0,
                    TP: tl.constexpr = 0):
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
                lane_combine(p, rows, r_mask, x_ptr, hist_ptr, xf_ptr, layer, sub, write_xf, lane_scale, sym_ptr,
                             tp_rank, D, LANES, DELAY, RING, EARLY_COMM, USE_COMM, BLOCK_L, TP)
        if NS == 0:
            w_cur = w_nxt
            s_cur = s_nxt


@triton.jit
def lane_final_mean(x_ptr, nw_ptr, xf_ptr, r0, r_end, eps, D: tl.constexpr, LANES: tl.constexpr,
                    LANE_NORM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK: tl.constexpr, DIVIDE: tl.constexpr = 1):
    """xf[r] = (1 / LANES) sum_l x_l[r] * rstd(x_l) * s_l[r] for r in [r0, r_end): each task takes every lane's
    rstd over all of D (x is L2-resident), then its rows. s: the final norm, [LANES, D] (LANE_NORM) or [D].
    DIVIDE 0 (tensor parallel): the sum over this rank's lanes only (lane_final_reduce divides)."""
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
        tot = tl.sum(v * rs[:, None] * s, axis=0)
        if DIVIDE:
            tot = tot / LANES
        tl.store(xf_ptr + offs, tot, mask=mask)

"""Weight streaming for the monokernel's GEMV tasks: one task = rows [row0, r_end) of a matrix (or of a gate/up
pair, or of every routed expert's down projection), walked as ONE flat sequence of [BLOCK_N, BLOCK_K] tiles
(row chunk major, K step minor) with explicit double buffering: tile i+1's loads are issued before tile i's FMAs,
across row-chunk (and expert) boundaries too, so a program always has a tile in flight. The first tile comes
from the caller, which loads it before waiting on the task's input (weights never depend on activations).

A persistent kernel runs one program per SM, so latency is hidden by bytes in flight per program, not by
occupancy. From kernels/tiles.py (the shared GEMV building blocks) we take its two register tricks: x is loaded
as a [BLOCK_N, BLOCK_K] broadcast tile (`_bcast_load`: the weight tile's own layout, no shared-memory layout
conversion and barrier per step), and the accumulator keeps one value per row and 16-byte vector (the in-thread
part of the reduction per step, the cross-thread part once per row chunk). Epilogues (RMSNorm scale, bias,
residual, GLU, LM-head argmax) run when a row chunk's last K step is done; the RMSNorm's sum of squares is
accumulated during the first row chunk's sweep over K (no separate pass over x after the wait).

PyTorch reference of each: y = W @ (rmsnorm(x) or x) (+ b) (+ res); the tests compare whole decode steps.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kie_moe.kernels.tiles import _bcast_load


@triton.jit
def rstd(x_ptr, K, eps, BLOCK: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) over x[K] (fp32)."""
    ss = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg")
        ss += x * x
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def x_chunk(x_ptr, nw_ptr, offs_k, k_mask, NORM: tl.constexpr):
    """x[offs_k] (fp32; written by other programs: read from L2), times the norm weight when NORM (the caller
    applies rstd, a scalar, to the dot product)."""
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0, cache_modifier=".cg")
    if NORM:
        x = x * tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def tile(w_ptr, K: tl.constexpr, row0, r_end, j, n_tiles, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile j of a task's flat walk over W[row0:r_end, :K] (row chunk j // NK, K step j % NK); masked to
    nothing when j >= n_tiles (the look-ahead past the last tile costs no memory traffic)."""
    NK: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K + (K == 0)  # >= 1: ops absent from a model still compile
    rows = row0 + (j // NK) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = (j % NK) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < r_end)[:, None] & (cols < K)[None, :] & (j < n_tiles)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)


@triton.jit
def glu(g, u, limit, alpha, ACT: tl.constexpr):
    """ACT 0: silu(g) * u. ACT 1 (gpt-oss): g <= limit, |u| <= limit, (u + 1) * g * sigmoid(alpha * g)."""
    if ACT == 0:
        h = g * tl.sigmoid(g) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = (u + 1.0) * (g * tl.sigmoid(alpha * g))
    return h


@triton.jit
def hash32(x):
    """lowbias32 integer hash (uint32 -> uint32); numpy mirror: runtime.gumbel_ref."""
    x = x.to(tl.uint32)
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def gumbel(seed, step, offs):
    """Gumbel(0, 1) noise for vocab ids `offs` at decode step `step`: counter-based (no state), so every program
    draws its tile's noise independently and a seed replays exactly."""
    key = hash32(seed.to(tl.uint32) + step.to(tl.uint32) * 0x9E3779B9)
    h = hash32(key ^ offs.to(tl.uint32))
    u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(u))


@triton.jit
def x_load(x_ptr, kk, mask, BLOCK_N: tl.constexpr, XB: tl.constexpr):
    """x[kk] for a [BLOCK_N, BLOCK_K] weight tile. XB=1: kernels/tiles.py's broadcast load, [BLOCK_N, BLOCK_K]
    in the weight tile's layout (no layout conversion, but BLOCK_N x BLOCK_K fp32 registers: small tiles only);
    XB=0: a [1, BLOCK_K] row the FMA broadcasts (one shared-memory layout conversion per step, few registers:
    leaves room for big tiles, i.e. more bytes in flight per program)."""
    if XB:
        x = _bcast_load(x_ptr, kk, mask, BLOCK_N, True)
    else:
        x = tl.load(x_ptr + kk, mask=mask, other=0.0).to(tl.float32)[None, :]
    return x


@triton.jit
def mac(acc, p, VEC: tl.constexpr, XB: tl.constexpr):
    """acc += p summed over K. XB=1 (with kernels/tiles.py's layout): acc [R, BLOCK_K // VEC] keeps one value per
    row and 16-byte vector, the in-thread part of the sum (cross-thread once per row chunk); XB=0: acc [R], a
    full row sum per step (a few shuffles), which leaves the registers to weight tiles in flight."""
    if XB:
        acc += tl.sum(tl.reshape(p, (p.shape[0], p.shape[1] // VEC, VEC)), axis=2)
    else:
        acc += tl.sum(p, axis=1)
    return acc


@triton.jit
def acc_zeros(R: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, XB: tl.constexpr):
    if XB:
        z = tl.zeros((R, BLOCK_K // VEC), dtype=tl.float32)
    else:
        z = tl.zeros((R,), dtype=tl.float32)
    return z


@triton.jit
def acc_total(acc, XB: tl.constexpr):
    """Per-row totals [R] of an accumulator."""
    if XB:
        t = tl.sum(acc, axis=1)
    else:
        t = acc
    return t


@triton.jit
def stream_gemv(w_ptr, w_first, K: tl.constexpr, row0, r_end, x_ptr, nw_ptr, eps, b_ptr, y_ptr, res_ptr,
                tile_id, pv_ptr, pi_ptr, do_sample, inv_temp, seed, step,
                NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, LM: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XB: tl.constexpr):
    """y[r] = (rstd *) W[r] . (nw *) x (+ b[r]) (+ res[r]) for r in [row0, r_end); y may alias res (each task
    owns its rows). LM: instead of storing logits, the tile's max / argmax of logits (greedy) or of logits / T +
    Gumbel noise (sampling), lowest id on ties, to pv / pi[tile_id]."""
    NK: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K + (K == 0)  # >= 1: ops absent from a model still compile
    VEC: tl.constexpr = min(BLOCK_K, 128 // w_ptr.dtype.element_ty.primitive_bitwidth)  # columns per 16-B load
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n = (r_end - row0 + BLOCK_N - 1) // BLOCK_N * NK
    SR: tl.constexpr = BLOCK_N if XB else 1     # rows of x (and of the sum of squares)
    acc = acc_zeros(BLOCK_N, BLOCK_K, VEC, XB)
    ss = acc_zeros(SR, BLOCK_K, VEC, XB)
    scale = 1.0
    best_v = -float("inf")
    best_i = row0
    w_cur = w_first
    for i in range(0, n):
        w_nxt = tile(w_ptr, K, row0, r_end, i + 1, n, BLOCK_N, BLOCK_K)   # in flight during this tile's math
        kk = (i % NK) * BLOCK_K + offs_k
        x = x_load(x_ptr, kk, kk < K, BLOCK_N, XB)
        if NORM:
            if i < NK:   # the first row chunk sweeps all of x once: its sum of squares, for free
                ss = mac(ss, x * x, VEC, XB)
            x = x * x_load(nw_ptr, kk, kk < K, BLOCK_N, XB)
        acc = mac(acc, w_cur.to(tl.float32) * x, VEC, XB)
        if i % NK == NK - 1:
            if NORM:
                if i == NK - 1:   # every row of ss holds the same sum: divide by SR too
                    scale = 1.0 / tl.sqrt(tl.sum(acc_total(ss, XB), axis=0) / (SR * K) + eps)
            r0 = row0 + (i // NK) * BLOCK_N
            rows = r0 + offs_n
            r_mask = rows < r_end
            y = acc_total(acc, XB) * scale
            if LM:
                if do_sample != 0:
                    y = y * inv_temp + gumbel(seed, step, rows)
                y = tl.where(r_mask, y, -float("inf"))
                cm = tl.max(y, axis=0)
                ci = tl.argmax(y, axis=0) + r0
                better = cm > best_v
                best_i = tl.where(better, ci, best_i)
                best_v = tl.where(better, cm, best_v)
            else:
                if HAS_BIAS:
                    y += tl.load(b_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
                if HAS_RES:
                    y += tl.load(res_ptr + rows, mask=r_mask, other=0.0, cache_modifier=".cg")
                tl.store(y_ptr + rows, y, mask=r_mask)
            acc = acc_zeros(BLOCK_N, BLOCK_K, VEC, XB)
        w_cur = w_nxt
    if LM:
        tl.store(pv_ptr + tile_id, best_v)
        tl.store(pi_ptr + tile_id, best_i)


@triton.jit
def stream_glu(wg_ptr, wu_ptr, g_first, u_first, K: tl.constexpr, row0, r_end, x_ptr, nw_ptr, eps,
               bg_ptr, bu_ptr, h_ptr, limit, alpha,
               HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               XB: tl.constexpr):
    """h[r] = glu(Wg[r] . xn (+ bg[r]), Wu[r] . xn (+ bu[r])), xn = RMSNorm(x; nw): gate and up rows of a tile
    stream side by side and share each x chunk."""
    NK: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K + (K == 0)
    VEC: tl.constexpr = min(BLOCK_K, 128 // wg_ptr.dtype.element_ty.primitive_bitwidth)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n = (r_end - row0 + BLOCK_N - 1) // BLOCK_N * NK
    SR: tl.constexpr = BLOCK_N if XB else 1
    acc_g = acc_zeros(BLOCK_N, BLOCK_K, VEC, XB)
    acc_u = acc_zeros(BLOCK_N, BLOCK_K, VEC, XB)
    ss = acc_zeros(SR, BLOCK_K, VEC, XB)
    scale = 1.0
    g_cur = g_first
    u_cur = u_first
    for i in range(0, n):
        g_nxt = tile(wg_ptr, K, row0, r_end, i + 1, n, BLOCK_N, BLOCK_K)
        u_nxt = tile(wu_ptr, K, row0, r_end, i + 1, n, BLOCK_N, BLOCK_K)
        kk = (i % NK) * BLOCK_K + offs_k
        x = x_load(x_ptr, kk, kk < K, BLOCK_N, XB)
        if i < NK:
            ss = mac(ss, x * x, VEC, XB)
        x = x * x_load(nw_ptr, kk, kk < K, BLOCK_N, XB)
        acc_g = mac(acc_g, g_cur.to(tl.float32) * x, VEC, XB)
        acc_u = mac(acc_u, u_cur.to(tl.float32) * x, VEC, XB)
        if i % NK == NK - 1:
            if i == NK - 1:
                scale = 1.0 / tl.sqrt(tl.sum(acc_total(ss, XB), axis=0) / (SR * K) + eps)
            rows = row0 + (i // NK) * BLOCK_N + offs_n
            r_mask = rows < r_end
            g = acc_total(acc_g, XB) * scale
            u = acc_total(acc_u, XB) * scale
            if HAS_BIAS:
                g += tl.load(bg_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
                u += tl.load(bu_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
            tl.store(h_ptr + rows, glu(g, u, limit, alpha, ACT), mask=r_mask)
            acc_g = acc_zeros(BLOCK_N, BLOCK_K, VEC, XB)
            acc_u = acc_zeros(BLOCK_N, BLOCK_K, VEC, XB)
        g_cur = g_nxt
        u_cur = u_nxt


@triton.jit
def _down_tile(wa_ptr, ed_off, sd_off, ids, offs_j, row0, r_end, q, n,
               D: tl.constexpr, I_MOE: tl.constexpr, I_SH: tl.constexpr, TOPK: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile q of expert_down's walk: per row chunk, every slot's [D, I_MOE] down rows (slot j = expert ids[j]),
    then the shared expert's [D, I_SH]; each segment padded to whole K steps. Masked when q >= n."""
    NKE: tl.constexpr = (I_MOE + BLOCK_K - 1) // BLOCK_K + (I_MOE == 0)
    NKS: tl.constexpr = (I_SH + BLOCK_K - 1) // BLOCK_K
    PER: tl.constexpr = TOPK * NKE + NKS + (TOPK * NKE + NKS == 0)  # tiles per row chunk (>= 1)
    c = q % PER
    is_exp = c < TOPK * NKE
    j = c // NKE
    e = tl.sum(tl.where(offs_j == j, ids, 0), axis=0).to(tl.int64)
    off = tl.where(is_exp, ed_off + e * (D * I_MOE), sd_off)
    K = tl.where(is_exp, I_MOE, I_SH)
    k0 = tl.where(is_exp, c % NKE, c - TOPK * NKE) * BLOCK_K
    rows = row0 + (q // PER) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = k0 + tl.arange(0, BLOCK_K)
    live = q < n
    w = tl.load(wa_ptr + off + rows.to(tl.int64)[:, None] * K + cols[None, :],
                mask=(rows < r_end)[:, None] & (cols < K)[None, :] & live, other=0.0)
    return w


@triton.jit
def stream_expert_down(wa_ptr, ed_off, edb_off, sd_off, row0, r_end, h_ptr, ids_ptr, wts_ptr, sg_ptr, x_ptr,
                       D: tl.constexpr, I_MOE: tl.constexpr, I_SH: tl.constexpr, TOPK: tl.constexpr,
                       HAS_EBIAS: tl.constexpr, HAS_SH_GATE: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XB: tl.constexpr):
    """x[r] += sum_j w_j (Wdown[e_j][r] . h_j + bdown[e_j][r]) + sg (Wsh_down[r] . h_sh), r in [row0, r_end):
    every routed slot and the shared expert of an output tile in one task, routing weights folded into the
    activations, so the sum has a fixed order and needs no atomics. h: [TOPK, I_MOE] then [I_SH]."""
    NKE: tl.constexpr = (I_MOE + BLOCK_K - 1) // BLOCK_K + (I_MOE == 0)
    NKS: tl.constexpr = (I_SH + BLOCK_K - 1) // BLOCK_K
    PER: tl.constexpr = TOPK * NKE + NKS + (TOPK * NKE + NKS == 0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_TOPK)
    ids = tl.load(ids_ptr + offs_j, mask=offs_j < TOPK, other=0, cache_modifier=".cg")
    wts = tl.load(wts_ptr + offs_j, mask=offs_j < TOPK, other=0.0, cache_modifier=".cg")
    sg = 1.0
    if HAS_SH_GATE:
        sg = tl.load(sg_ptr, cache_modifier=".cg")
    VEC: tl.constexpr = min(BLOCK_K, 128 // wa_ptr.dtype.element_ty.primitive_bitwidth)
    offs_k = tl.arange(0, BLOCK_K)
    n = (r_end - row0 + BLOCK_N - 1) // BLOCK_N * PER
    acc = acc_zeros(BLOCK_N, BLOCK_K, VEC, XB)
    w_cur = _down_tile(wa_ptr, ed_off, sd_off, ids, offs_j, row0, r_end, 0, n, D, I_MOE, I_SH, TOPK,
                       BLOCK_N, BLOCK_K)
    for q in range(0, n):
        w_nxt = _down_tile(wa_ptr, ed_off, sd_off, ids, offs_j, row0, r_end, q + 1, n, D, I_MOE, I_SH, TOPK,
                           BLOCK_N, BLOCK_K)
        # this tile's activations: h_j * w_j for routed slot j, h_sh * sg for the shared expert
        c = q % PER
        is_exp = c < TOPK * NKE
        j = c // NKE
        xs = tl.where(is_exp, tl.sum(tl.where(offs_j == j, wts, 0.0), axis=0), sg)
        K = tl.where(is_exp, I_MOE, I_SH)
        kk = tl.where(is_exp, c % NKE, c - TOPK * NKE) * BLOCK_K + offs_k
        h_off = tl.where(is_exp, j * I_MOE, TOPK * I_MOE)
        x = x_load(h_ptr + h_off, kk, kk < K, BLOCK_N, XB) * xs
        acc = mac(acc, w_cur.to(tl.float32) * x, VEC, XB)
        if c == PER - 1:
            rows = row0 + (q // PER) * BLOCK_N + offs_n
            r_mask = rows < r_end
            y = acc_total(acc, XB)
            if HAS_EBIAS:
                for jj in range(TOPK):
                    e = tl.sum(tl.where(offs_j == jj, ids, 0), axis=0).to(tl.int64)
                    wj = tl.sum(tl.where(offs_j == jj, wts, 0.0), axis=0)
                    y += wj * tl.load(wa_ptr + edb_off + e * D + rows, mask=r_mask, other=0.0).to(tl.float32)
            y += tl.load(x_ptr + rows, mask=r_mask, other=0.0, cache_modifier=".cg")
            tl.store(x_ptr + rows, y, mask=r_mask)
            acc = acc_zeros(BLOCK_N, BLOCK_K, VEC, XB)
        w_cur = w_nxt

"""Weight streaming for the monokernel's GEMV tasks: one task = rows [row0, r_end) of a matrix (or of a gate/up
pair, or of every routed expert's down projection), walked as ONE flat sequence of [BLOCK_N, BLOCK_K] tiles
(row chunk major, K step minor) with explicit double buffering: tile i+1's loads are issued before tile i's FMAs,
across row-chunk (and expert) boundaries too, so a program always has a tile in flight. The first tile comes
from the caller, which loads it before waiting on the task's input (weights never depend on activations).

A persistent kernel runs one program per SM, so latency is hidden by bytes in flight per program, not by
occupancy; the accumulator is 1-D (one cross-thread reduction per tile) to leave registers for the tiles.
Epilogues (RMSNorm scale, bias, residual, GLU, LM-head argmax) run when a row chunk's last K step is done.

PyTorch reference of each: y = W @ (rmsnorm(x) or x) (+ b) (+ res); the tests compare whole decode steps.
"""
from __future__ import annotations

import triton
import triton.language as tl


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
def x_tile(x_ptr, nw_ptr, K: tl.constexpr, j, n_tiles, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """(raw x, norm weight) chunks for tile j of a K-major walk (masked when j >= n_tiles). Raw x feeds the
    sum of squares of the fused RMSNorm, accumulated during the first row chunk's sweep over K."""
    NK: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K + (K == 0)
    offs = (j % NK) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs < K) & (j < n_tiles)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    nw = x
    if NORM:
        nw = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x, nw


@triton.jit
def stream_gemv(w_ptr, w_first, K: tl.constexpr, row0, r_end, x_ptr, nw_ptr, eps, b_ptr, y_ptr, res_ptr,
                tile_id, pv_ptr, pi_ptr, do_sample, inv_temp, seed, step,
                NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, LM: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[r] = (rstd *) W[r] . (nw *) x (+ b[r]) (+ res[r]) for r in [row0, r_end); y may alias res (each task
    owns its rows). LM: instead of storing logits, the tile's max / argmax of logits (greedy) or of logits / T +
    Gumbel noise (sampling), lowest id on ties, to pv / pi[tile_id]."""
    NK: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K + (K == 0)  # >= 1: ops absent from a model still compile
    offs_n = tl.arange(0, BLOCK_N)
    n = (r_end - row0 + BLOCK_N - 1) // BLOCK_N * NK
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    scale = 1.0
    best_v = -float("inf")
    best_i = row0
    w_cur = w_first
    x_cur, n_cur = x_tile(x_ptr, nw_ptr, K, 0, n, NORM, BLOCK_K)
    for i in range(0, n):
        # tile i+1 (weights and x) is in flight while tile i's FMAs run
        w_nxt = tile(w_ptr, K, row0, r_end, i + 1, n, BLOCK_N, BLOCK_K)
        x_nxt, n_nxt = x_tile(x_ptr, nw_ptr, K, i + 1, n, NORM, BLOCK_K)
        xv = x_cur
        if NORM:
            ss += tl.where(i < NK, x_cur * x_cur, 0.0)
            xv = x_cur * n_cur
        acc += tl.sum(w_cur.to(tl.float32) * xv[None, :], axis=1)
        if i % NK == NK - 1:
            if NORM:
                if i == NK - 1:   # end of the first row chunk: the sweep has seen all of x
                    scale = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
            r0 = row0 + (i // NK) * BLOCK_N
            rows = r0 + offs_n
            r_mask = rows < r_end
            y = acc * scale
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
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        w_cur = w_nxt
        x_cur = x_nxt
        n_cur = n_nxt
    if LM:
        tl.store(pv_ptr + tile_id, best_v)
        tl.store(pi_ptr + tile_id, best_i)


@triton.jit
def stream_glu(wg_ptr, wu_ptr, g_first, u_first, K: tl.constexpr, row0, r_end, x_ptr, nw_ptr, eps,
               bg_ptr, bu_ptr, h_ptr, limit, alpha,
               HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[r] = glu(Wg[r] . xn (+ bg[r]), Wu[r] . xn (+ bu[r])), xn = RMSNorm(x; nw): gate and up rows of a tile
    stream side by side and share each x chunk."""
    NK: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K + (K == 0)
    offs_n = tl.arange(0, BLOCK_N)
    n = (r_end - row0 + BLOCK_N - 1) // BLOCK_N * NK
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    scale = 1.0
    g_cur = g_first
    u_cur = u_first
    x_cur, n_cur = x_tile(x_ptr, nw_ptr, K, 0, n, True, BLOCK_K)
    for i in range(0, n):
        g_nxt = tile(wg_ptr, K, row0, r_end, i + 1, n, BLOCK_N, BLOCK_K)
        u_nxt = tile(wu_ptr, K, row0, r_end, i + 1, n, BLOCK_N, BLOCK_K)
        x_nxt, n_nxt = x_tile(x_ptr, nw_ptr, K, i + 1, n, True, BLOCK_K)
        ss += tl.where(i < NK, x_cur * x_cur, 0.0)
        xv = (x_cur * n_cur)[None, :]
        acc_g += tl.sum(g_cur.to(tl.float32) * xv, axis=1)
        acc_u += tl.sum(u_cur.to(tl.float32) * xv, axis=1)
        if i % NK == NK - 1:
            if i == NK - 1:
                scale = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)
            rows = row0 + (i // NK) * BLOCK_N + offs_n
            r_mask = rows < r_end
            g = acc_g * scale
            u = acc_u * scale
            if HAS_BIAS:
                g += tl.load(bg_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
                u += tl.load(bu_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
            tl.store(h_ptr + rows, glu(g, u, limit, alpha, ACT), mask=r_mask)
            acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
        g_cur = g_nxt
        u_cur = u_nxt
        x_cur = x_nxt
        n_cur = n_nxt


@triton.jit
def _down_tile(wa_ptr, ed_off, sd_off, ids, wts, sg, offs_j, h_ptr, row0, r_end, q, n,
               D: tl.constexpr, I_MOE: tl.constexpr, I_SH: tl.constexpr, TOPK: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile q of expert_down's walk and its activation chunk: per row chunk, every slot's [D, I_MOE] down rows
    (slot j = expert ids[j]; activations h_j * w_j), then the shared expert's [D, I_SH] (h_sh * sg); each
    segment padded to whole K steps. Masked when q >= n."""
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
    xs = tl.where(is_exp, tl.sum(tl.where(offs_j == j, wts, 0.0), axis=0), sg)   # routing weight / shared gate
    h_off = tl.where(is_exp, j * I_MOE, TOPK * I_MOE)
    x = tl.load(h_ptr + h_off + cols, mask=(cols < K) & live, other=0.0, cache_modifier=".cg") * xs
    return w, x


@triton.jit
def stream_expert_down(wa_ptr, ed_off, edb_off, sd_off, row0, r_end, h_ptr, ids_ptr, wts_ptr, sg_ptr, x_ptr,
                       D: tl.constexpr, I_MOE: tl.constexpr, I_SH: tl.constexpr, TOPK: tl.constexpr,
                       HAS_EBIAS: tl.constexpr, HAS_SH_GATE: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
    n = (r_end - row0 + BLOCK_N - 1) // BLOCK_N * PER
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w_cur, x_cur = _down_tile(wa_ptr, ed_off, sd_off, ids, wts, sg, offs_j, h_ptr, row0, r_end, 0, n,
                              D, I_MOE, I_SH, TOPK, BLOCK_N, BLOCK_K)
    for q in range(0, n):
        w_nxt, x_nxt = _down_tile(wa_ptr, ed_off, sd_off, ids, wts, sg, offs_j, h_ptr, row0, r_end, q + 1, n,
                                  D, I_MOE, I_SH, TOPK, BLOCK_N, BLOCK_K)
        acc += tl.sum(w_cur.to(tl.float32) * x_cur[None, :], axis=1)
        if q % PER == PER - 1:
            rows = row0 + (q // PER) * BLOCK_N + offs_n
            r_mask = rows < r_end
            if HAS_EBIAS:
                for jj in range(TOPK):
                    e = tl.sum(tl.where(offs_j == jj, ids, 0), axis=0).to(tl.int64)
                    wj = tl.sum(tl.where(offs_j == jj, wts, 0.0), axis=0)
                    acc += wj * tl.load(wa_ptr + edb_off + e * D + rows, mask=r_mask, other=0.0).to(tl.float32)
            acc += tl.load(x_ptr + rows, mask=r_mask, other=0.0, cache_modifier=".cg")
            tl.store(x_ptr + rows, acc, mask=r_mask)
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        w_cur = w_nxt
        x_cur = x_nxt

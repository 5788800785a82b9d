"""Weight streaming for the monokernel's GEMV tasks: one task = rows [row0, r_end) of a matrix (or of a gate/up
pair, or of every routed expert's down projection), walked as ONE flat sequence of [BLOCK_N, BLOCK_K] tiles
(row chunk major, K step minor) with explicit double buffering: tile i+1's loads are issued before tile i's FMAs,
across row-chunk (and expert) boundaries too, so a program always has a tile in flight. The first tile comes
from the caller, which loads it before waiting on the task's input (weights never depend on activations).

A persistent kernel runs 1-2 programs per SM, so latency is hidden mostly by bytes in flight per program; measured
alone (benchmarks/stream_probe.py) this loop is issue / latency bound at one 8-warp program per SM (35% of the
probe for fp8 gate/up tiles, 77% with 4 programs of 4 warps). Tiles of every weight format come from qtile.py
(FMT constexpr; x as a broadcast row or, XB=1, as kernels/tiles.py's broadcast tile). Epilogues (RMSNorm scale,
per-row format factor, bias, residual, GLU, LM-head argmax) run when a row chunk's last K step is done; the
RMSNorm's sum of squares is accumulated during the first row chunk's sweep over K (no separate pass over x after
the wait).

PyTorch reference of each: y = W @ (rmsnorm(x) or x) (+ b) (+ res); the tests compare whole decode steps.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .qtile import acc_total, mac, qdot, qload, qstep, qzeros, ss_total, sszeros, x_load


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
def tile(w_ptr, s_ptr, K: tl.constexpr, row0, r_end, j, n_tiles, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr):
    """(weights, scales) of tile j of a task's flat walk over W[row0:r_end, :K] (row chunk j // NK, K step
    j % NK); masked to nothing when j >= n_tiles (the look-ahead past the last tile costs no memory traffic)."""
    NK: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K + (K == 0)  # >= 1: ops absent from a model still compile
    rows = row0 + (j // NK) * BLOCK_N + tl.arange(0, BLOCK_N)
    return qload(w_ptr, s_ptr, rows, (rows < r_end) & (j < n_tiles), (j % NK) * BLOCK_K, K, FMT, BLOCK_K)


@triton.jit
def row_factor(y, f_ptr, rows, r_mask, FMT: tl.constexpr):
    """The per-row factor of a format: fp8's row scale, nvfp4's 2^14 / global scale."""
    if FMT == 1:
        y = y * tl.load(f_ptr + rows, mask=r_mask, other=0.0)
    elif FMT == 3:
        y = y * tl.load(f_ptr + rows, mask=r_mask, other=0.0)
    return y


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
def stream_gemv(w_ptr, s_ptr, f_ptr, w_first, s_first, K: tl.constexpr, row0, r_end, x_ptr, nw_ptr, eps, b_ptr,
                y_ptr, res_ptr, tile_id, pv_ptr, pi_ptr, do_sample, inv_temp, seed, step,
                NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, LM: tl.constexpr,
                FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XB: tl.constexpr,
                NS: tl.constexpr = 0):
    """y[r] = (rstd *) W[r] . (nw *) x (+ b[r]) (+ res[r]) for r in [row0, r_end); y may alias res (each task
    owns its rows). LM: instead of storing logits, the tile's max / argmax of logits (greedy) or of logits / T +
    Gumbel noise (sampling), lowest id on ties, to pv / pi[tile_id] (pv +inf and pi -1 where the tile holds a NaN /
    +inf logit). NS > 0: instead of the explicit one-ahead double buffer, plain loads in a tl.range(num_stages=NS)
    loop (Triton's pipeliner: NS tiles in flight through shared memory, no registers)."""
    NK: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K + (K == 0)
    VEC: tl.constexpr = min(BLOCK_K, 128 // w_ptr.dtype.element_ty.primitive_bitwidth)  # columns per 16-B load
    offs_n = tl.arange(0, BLOCK_N)
    n = (r_end - row0 + BLOCK_N - 1) // BLOCK_N * NK
    acc = qzeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
    ss = sszeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
    scale = 1.0
    best_v = -float("inf")
    best_i = row0
    w_cur = w_first
    s_cur = s_first
    for i in tl.range(0, n, num_stages=max(NS, 1)):
        if NS > 0:   # the pipeliner keeps NS tiles in flight
            w_cur, s_cur = tile(w_ptr, s_ptr, K, row0, r_end, i, n, FMT, BLOCK_N, BLOCK_K)
        else:        # tile i+1 in flight while tile i's FMAs run
            w_nxt, s_nxt = tile(w_ptr, s_ptr, K, row0, r_end, i + 1, n, FMT, BLOCK_N, BLOCK_K)
        acc, ss = qstep(acc, ss, w_cur, s_cur, x_ptr, nw_ptr, 1.0, (i % NK) * BLOCK_K, K, i < NK, NORM, FMT,
                        BLOCK_N, BLOCK_K, VEC, XB)
        if i % NK == NK - 1:
            if NORM:
                if i == NK - 1:   # end of the first row chunk: its sweep has seen all of x
                    scale = 1.0 / tl.sqrt(ss_total(ss, K, FMT, BLOCK_N, XB) + eps)
            r0 = row0 + (i // NK) * BLOCK_N
            rows = r0 + offs_n
            r_mask = rows < r_end
            y = row_factor(acc_total(acc) * scale, f_ptr, rows, r_mask, FMT)
            if LM:
                if do_sample != 0:
                    y = y * inv_temp + gumbel(seed, step, rows)
                # NaN counts as +inf, so a broken tile always wins the max and then marks its id -1 (below):
                # a max that skipped NaN would hand a real-looking token (often an EOS) to the host
                y = tl.where(r_mask, tl.where(y != y, float("inf"), y), -float("inf"))
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
            acc = qzeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
        if NS == 0:
            w_cur = w_nxt
            s_cur = s_nxt
    if LM:   # pi = -1: a NaN / +inf logit in this tile (kernels/sampling.py marks it the same way)
        tl.store(pv_ptr + tile_id, best_v)
        tl.store(pi_ptr + tile_id, tl.where(best_v == float("inf"), -1, best_i))


@triton.jit
def stream_glu(wg_ptr, wu_ptr, sg_ptr, su_ptr, fg_ptr, fu_ptr, g_first, u_first, sg_first, su_first,
               K: tl.constexpr, row0, r_end, x_ptr, nw_ptr, eps, bg_ptr, bu_ptr, h_ptr, limit, alpha,
               HAS_BIAS: tl.constexpr, ACT: tl.constexpr, FMT: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, XB: tl.constexpr, NS: tl.constexpr = 0):
    """h[r] = glu(Wg[r] . xn (+ bg[r]), Wu[r] . xn (+ bu[r])), xn = RMSNorm(x; nw): gate and up rows of a tile
    stream side by side and share each x chunk."""
    NK: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K + (K == 0)
    VEC: tl.constexpr = min(BLOCK_K, 128 // wg_ptr.dtype.element_ty.primitive_bitwidth)
    offs_n = tl.arange(0, BLOCK_N)
    n = (r_end - row0 + BLOCK_N - 1) // BLOCK_N * NK
    acc_g = qzeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
    acc_u = qzeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
    ss = sszeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
    ss_u = sszeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
    scale = 1.0
    g_cur = g_first
    u_cur = u_first
    sg_cur = sg_first
    su_cur = su_first
    for i in tl.range(0, n, num_stages=max(NS, 1)):
        if NS > 0:
            g_cur, sg_cur = tile(wg_ptr, sg_ptr, K, row0, r_end, i, n, FMT, BLOCK_N, BLOCK_K)
            u_cur, su_cur = tile(wu_ptr, su_ptr, K, row0, r_end, i, n, FMT, BLOCK_N, BLOCK_K)
        else:
            g_nxt, sg_nxt = tile(wg_ptr, sg_ptr, K, row0, r_end, i + 1, n, FMT, BLOCK_N, BLOCK_K)
            u_nxt, su_nxt = tile(wu_ptr, su_ptr, K, row0, r_end, i + 1, n, FMT, BLOCK_N, BLOCK_K)
        k0 = (i % NK) * BLOCK_K
        if FMT <= 2:   # one (normalised) x tile for both matrices
            kk = k0 + tl.arange(0, BLOCK_K)
            x = x_load(x_ptr, kk, kk < K, BLOCK_N, XB)
            if i < NK:
                ss = mac(ss, x * x, VEC, XB)
            x = x * x_load(nw_ptr, kk, kk < K, BLOCK_N, XB)
            acc_g = qdot(acc_g, g_cur, sg_cur, x, FMT, BLOCK_N, BLOCK_K, VEC, XB)
            acc_u = qdot(acc_u, u_cur, su_cur, x, FMT, BLOCK_N, BLOCK_K, VEC, XB)
        else:
            acc_g, ss = qstep(acc_g, ss, g_cur, sg_cur, x_ptr, nw_ptr, 1.0, k0, K, i < NK, True, FMT,
                              BLOCK_N, BLOCK_K, VEC, XB)
            acc_u, ss_u = qstep(acc_u, ss_u, u_cur, su_cur, x_ptr, nw_ptr, 1.0, k0, K, False, True, FMT,
                                BLOCK_N, BLOCK_K, VEC, XB)
        if i % NK == NK - 1:
            if i == NK - 1:
                scale = 1.0 / tl.sqrt(ss_total(ss, K, FMT, BLOCK_N, XB) + eps)
            rows = row0 + (i // NK) * BLOCK_N + offs_n
            r_mask = rows < r_end
            g = row_factor(acc_total(acc_g) * scale, fg_ptr, rows, r_mask, FMT)
            u = row_factor(acc_total(acc_u) * scale, fu_ptr, rows, r_mask, FMT)
            if HAS_BIAS:
                g += tl.load(bg_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
                u += tl.load(bu_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
            tl.store(h_ptr + rows, glu(g, u, limit, alpha, ACT), mask=r_mask)
            acc_g = qzeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
            acc_u = qzeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
        if NS == 0:
            g_cur = g_nxt
            u_cur = u_nxt
            sg_cur = sg_nxt
            su_cur = su_nxt


@triton.jit
def _seg_k(is_exp, loc, offs_j, j, I_MOE: tl.constexpr, I_SH: tl.constexpr, EP: tl.constexpr):
    """Columns of an expert_down segment: I_MOE for a routed slot held here, 0 for one held by another rank
    (EP, expert parallel: nothing loaded), I_SH for the shared expert. Without EP no per-step reduction: this
    sits in the streaming loop (measured on the H200: the reduction cost qwen3 fp8 24% of its decode speed)."""
    if EP:
        k = tl.where(is_exp, tl.where(tl.sum(tl.where(offs_j == j, loc, 0), axis=0) > 0, I_MOE, 0), I_SH)
    else:
        k = tl.where(is_exp, I_MOE, I_SH)
    return k


@triton.jit
def _down_tile(w_ptr, s_ptr, ed_w, ed_s, sd_w, sd_s, ids, loc, offs_j, row0, r_end, q, n,
               D: tl.constexpr, I_MOE: tl.constexpr, I_SH: tl.constexpr, TOPK: tl.constexpr, FMT: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EP: tl.constexpr = False):
    """Tile q of expert_down's walk: per row chunk, every slot's [D, I_MOE] down rows (slot j = expert ids[j]),
    then the shared expert's [D, I_SH]; each segment padded to whole K steps. Masked when q >= n, and (expert
    parallel) for a slot whose expert another rank holds (loc[j] == 0: K 0). ed_w / ed_s: the first stored
    expert's weight / scale offsets (units of w_ptr / s_ptr); stored expert e is e * D rows further."""
    NKE: tl.constexpr = (I_MOE + BLOCK_K - 1) // BLOCK_K + (I_MOE == 0)
    NKS: tl.constexpr = (I_SH + BLOCK_K - 1) // BLOCK_K
    PER: tl.constexpr = TOPK * NKE + NKS + (TOPK * NKE + NKS == 0)  # tiles per row chunk (>= 1)
    RU: tl.constexpr = I_MOE // 8 if FMT >= 3 else I_MOE      # a weight row in w_ptr units
    SC: tl.constexpr = (I_MOE + 127) // 128 if FMT == 2 else (I_MOE // 16 if FMT == 3 else I_MOE // 32)  # scales
    c = q % PER
    is_exp = c < TOPK * NKE
    e = tl.sum(tl.where(offs_j == c // NKE, ids, 0), axis=0).to(tl.int64)
    K = _seg_k(is_exp, loc, offs_j, c // NKE, I_MOE, I_SH, EP)
    w_off = tl.where(is_exp, ed_w + e * (D * RU), sd_w)
    s_off = tl.where(is_exp, ed_s + e * (D * SC), sd_s)
    k0 = tl.where(is_exp, c % NKE, c - TOPK * NKE) * BLOCK_K
    rows = row0 + (q // PER) * BLOCK_N + tl.arange(0, BLOCK_N)
    return qload(w_ptr + w_off, s_ptr + s_off, rows, (rows < r_end) & (q < n), k0, K, FMT, BLOCK_K)


@triton.jit
def stream_expert_down(w_ptr, s_ptr, f_ptr, ed_w, ed_s, ed_f, sd_w, sd_s, sd_f, b_ptr, row0, r_end, h_ptr,
                       ids_ptr, wts_ptr, sg_ptr, x_ptr, y_ptr,
                       D: tl.constexpr, I_MOE: tl.constexpr, I_SH: tl.constexpr, TOPK: tl.constexpr,
                       HAS_EBIAS: tl.constexpr, HAS_SH_GATE: tl.constexpr, FMT: tl.constexpr,
                       BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, XB: tl.constexpr,
                       NS: tl.constexpr = 0, HAS_RES: tl.constexpr = True, E_LO: tl.constexpr = 0,
                       E_LOC: tl.constexpr = 0):
    """x[r] += sum_j w_j (Wdown[e_j][r] . h_j + bdown[e_j][r]) + sg (Wsh_down[r] . h_sh), r in [row0, r_end):
    every routed slot and the shared expert of an output tile in one task, routing weights folded into the
    activations, so the sum has a fixed order and needs no atomics. h: [TOPK, I_MOE] then [I_SH]. The result
    goes to y (y may alias x); without HAS_RES, y gets the sum alone (a tensor-parallel partial). E_LOC > 0
    (expert parallel): this rank stores experts [E_LO, E_LO + E_LOC); other slots add nothing here.
    Per-row format factors (fp8 / nvfp4) differ per expert: those formats keep one accumulator per segment
    (a row chunk's sum is closed per expert), the others one for the whole chunk."""
    NKE: tl.constexpr = (I_MOE + BLOCK_K - 1) // BLOCK_K + (I_MOE == 0)
    NKS: tl.constexpr = (I_SH + BLOCK_K - 1) // BLOCK_K
    PER: tl.constexpr = TOPK * NKE + NKS + (TOPK * NKE + NKS == 0)
    RF: tl.constexpr = (FMT == 1) | (FMT == 3)
    VEC: tl.constexpr = min(BLOCK_K, 128 // w_ptr.dtype.element_ty.primitive_bitwidth)
    offs_n = tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_TOPK)
    ids = tl.load(ids_ptr + offs_j, mask=offs_j < TOPK, other=0, cache_modifier=".cg")
    wts = tl.load(wts_ptr + offs_j, mask=offs_j < TOPK, other=0.0, cache_modifier=".cg")
    loc = (offs_j < TOPK).to(tl.int32)
    if E_LOC > 0:   # global ids -> stored ids; another rank's slots weigh 0 (and load nothing: _seg_k)
        here = (ids >= E_LO) & (ids < E_LO + E_LOC)
        loc = here.to(tl.int32)
        ids = tl.where(here, ids - E_LO, 0)
        wts = tl.where(here, wts, 0.0)
    sg = 1.0
    if HAS_SH_GATE:
        sg = tl.load(sg_ptr, cache_modifier=".cg")
    n = (r_end - row0 + BLOCK_N - 1) // BLOCK_N * PER
    acc = qzeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
    ss = sszeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    w_cur, s_cur = _down_tile(w_ptr, s_ptr, ed_w, ed_s, sd_w, sd_s, ids, loc, offs_j, row0, r_end, 0, n,
                              D, I_MOE, I_SH, TOPK, FMT, BLOCK_N, BLOCK_K, E_LOC > 0)
    for q in tl.range(0, n, num_stages=max(NS, 1)):
        if NS > 0:
            w_cur, s_cur = _down_tile(w_ptr, s_ptr, ed_w, ed_s, sd_w, sd_s, ids, loc, offs_j, row0, r_end, q, n,
                                      D, I_MOE, I_SH, TOPK, FMT, BLOCK_N, BLOCK_K, E_LOC > 0)
        else:
            w_nxt, s_nxt = _down_tile(w_ptr, s_ptr, ed_w, ed_s, sd_w, sd_s, ids, loc, offs_j, row0, r_end, q + 1,
                                      n,
                                      D, I_MOE, I_SH, TOPK, FMT, BLOCK_N, BLOCK_K, E_LOC > 0)
        # this tile's activations: h_j * w_j for routed slot j, h_sh * sg for the shared expert
        c = q % PER
        is_exp = c < TOPK * NKE
        j = c // NKE
        xs = tl.where(is_exp, tl.sum(tl.where(offs_j == j, wts, 0.0), axis=0), sg)
        K = _seg_k(is_exp, loc, offs_j, j, I_MOE, I_SH, E_LOC > 0)
        k0 = tl.where(is_exp, c % NKE, c - TOPK * NKE) * BLOCK_K
        h_off = tl.where(is_exp, j * I_MOE, TOPK * I_MOE)
        acc, ss = qstep(acc, ss, w_cur, s_cur, h_ptr + h_off, h_ptr, xs, k0, K, False, False, FMT,
                        BLOCK_N, BLOCK_K, VEC, XB)
        rows = row0 + (q // PER) * BLOCK_N + offs_n
        r_mask = rows < r_end
        if RF:
            seg_end = tl.where(is_exp, c % NKE == NKE - 1, c == PER - 1)
            if seg_end:   # close this expert's sum with its per-row factor
                e = tl.sum(tl.where(offs_j == j, ids, 0), axis=0).to(tl.int64)
                f_off = tl.where(is_exp, ed_f + e * D, sd_f)
                y += row_factor(acc_total(acc), f_ptr + f_off, rows, r_mask, FMT)
                acc = qzeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
        if c == PER - 1:
            if RF == 0:
                y = acc_total(acc)
                acc = qzeros(FMT, BLOCK_N, BLOCK_K, VEC, XB)
            if HAS_EBIAS:
                for jj in range(TOPK):
                    eb = tl.sum(tl.where(offs_j == jj, ids, 0), axis=0).to(tl.int64)
                    wj = tl.sum(tl.where(offs_j == jj, wts, 0.0), axis=0)
                    y += wj * tl.load(b_ptr + eb * D + rows, mask=r_mask, other=0.0).to(tl.float32)
            if HAS_RES:
                y += tl.load(x_ptr + rows, mask=r_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rows, y, mask=r_mask)
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if NS == 0:
            w_cur = w_nxt
            s_cur = s_nxt

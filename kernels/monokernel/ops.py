"""Device functions of the monokernel's tasks: GEMV row tiles (RMSNorm fused in front, bias / residual / GLU in
the epilogue), decode attention per kv head with RoPE + KV append, the attention-split combine, MoE routing
(top-k recomputed from the router logits by each consumer: no extra phase), LM-head partial argmax with Gumbel
noise, and the counter-based RNG.

Activations are fp32 end to end (a few KB; bandwidth is all weights), weights any float dtype of the arena.
Reads of data other programs wrote use `.cg` (L2, never a stale L1 line). PyTorch references: every op is one
line of models/reference.py; the tests compare whole decode steps against ReferenceDecoder.
"""
from __future__ import annotations

import triton
import triton.language as tl


# ---- GEMV --------------------------------------------------------------------------------------------------------

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
    """x[offs_k] (fp32), times the norm weight when NORM (the caller applies rstd to the dot product)."""
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0, cache_modifier=".cg")
    if NORM:
        x = x * tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def prefetch(w_ptr, K, r0, r_end, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first [BLOCK_N, BLOCK_K] weight tile of rows r0.. (masked to r_end): issued before the task's wait,
    since weights never depend on activations."""
    rows = r0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask = (rows < r_end)[:, None] & (offs_k < K)[None, :]
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def dot_rows(w_ptr, K, r0, r_end, x_ptr, nw_ptr, w_first, use_first, NORM: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """W[r0:r0+BLOCK_N, :K] @ x -> [BLOCK_N] fp32; the first K step comes from `w_first` when `use_first`."""
    rows = r0 + tl.arange(0, BLOCK_N)
    r_mask = rows < r_end
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    offs0 = tl.arange(0, BLOCK_K)
    # 2-D accumulator: one cross-thread reduction after the loop, not one per K step
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = 0
    if use_first:
        acc += w_first.to(tl.float32) * x_chunk(x_ptr, nw_ptr, offs0, offs0 < K, NORM)[None, :]
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        offs_k = k0 + offs0
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x_chunk(x_ptr, nw_ptr, offs_k, k_mask, NORM)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def dot_rows2(wg_ptr, wu_ptr, K, r0, r_end, x_ptr, nw_ptr, g_first, u_first, use_first, NORM: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Two matrices against one x (gate and up rows of a GLU): x is loaded once per K step."""
    rows = r0 + tl.arange(0, BLOCK_N)
    r_mask = rows < r_end
    g_rows = wg_ptr + rows.to(tl.int64)[:, None] * K
    u_rows = wu_ptr + rows.to(tl.int64)[:, None] * K
    offs0 = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = 0
    if use_first:
        x = x_chunk(x_ptr, nw_ptr, offs0, offs0 < K, NORM)[None, :]
        acc_g += g_first.to(tl.float32) * x
        acc_u += u_first.to(tl.float32) * x
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        offs_k = k0 + offs0
        k_mask = offs_k < K
        m = r_mask[:, None] & k_mask[None, :]
        g = tl.load(g_rows + offs_k[None, :], mask=m, other=0.0)
        u = tl.load(u_rows + offs_k[None, :], mask=m, other=0.0)
        x = x_chunk(x_ptr, nw_ptr, offs_k, k_mask, NORM)[None, :]
        acc_g += g.to(tl.float32) * x
        acc_u += u.to(tl.float32) * x
    return tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)


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
def gemv_task(w_ptr, w_first, K, row0, r_end, x_ptr, nw_ptr, eps, b_ptr, y_ptr, res_ptr,
              NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[r] = (rstd *) W[r] . (nw *) x (+ b[r]) (+ res[r]) for r in [row0, r_end). y may alias res (rows are
    this task's own)."""
    scale = 1.0
    if NORM:
        scale = rstd(x_ptr, K, eps, BLOCK_K)
    for r0 in range(row0, r_end, BLOCK_N):
        acc = dot_rows(w_ptr, K, r0, r_end, x_ptr, nw_ptr, w_first, r0 == row0, NORM, BLOCK_N, BLOCK_K) * scale
        rows = r0 + tl.arange(0, BLOCK_N)
        r_mask = rows < r_end
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
        if HAS_RES:
            acc += tl.load(res_ptr + rows, mask=r_mask, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + rows, acc, mask=r_mask)


@triton.jit
def glu_task(wg_ptr, wu_ptr, g_first, u_first, K, row0, r_end, x_ptr, nw_ptr, eps, bg_ptr, bu_ptr, h_ptr,
             limit, alpha, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h[r] = glu(Wg[r] . xn + bg[r], Wu[r] . xn + bu[r]), xn = RMSNorm(x) (norm weight nw)."""
    scale = rstd(x_ptr, K, eps, BLOCK_K)
    for r0 in range(row0, r_end, BLOCK_N):
        g, u = dot_rows2(wg_ptr, wu_ptr, K, r0, r_end, x_ptr, nw_ptr, g_first, u_first, r0 == row0, True,
                         BLOCK_N, BLOCK_K)
        g = g * scale
        u = u * scale
        rows = r0 + tl.arange(0, BLOCK_N)
        r_mask = rows < r_end
        if HAS_BIAS:
            g += tl.load(bg_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
            u += tl.load(bu_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + rows, glu(g, u, limit, alpha, ACT), mask=r_mask)


# ---- MoE routing ---------------------------------------------------------------------------------------------------

@triton.jit
def route(rlog_ptr, sbias_ptr, route_scale, E: tl.constexpr, TOPK: tl.constexpr, SCORING: tl.constexpr,
          NORM_TOPK: tl.constexpr, HAS_SBIAS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """Router logits [E] -> (expert ids [BLOCK_TOPK] int32, weights [BLOCK_TOPK] fp32), as models.reference.route:
    softmax / sigmoid scores (+ correction bias for the choice only), top-k (first index wins ties), optional
    renormalisation, routed scaling; SCORING 2 (gpt-oss): softmax over the top-k logits."""
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    lg = tl.load(rlog_ptr + offs_e, mask=e_mask, other=-float("inf"), cache_modifier=".cg")
    if SCORING == 0:
        ex = tl.where(e_mask, tl.exp(lg - tl.max(lg, axis=0)), 0.0)
        scores = ex / tl.sum(ex, axis=0)
    elif SCORING == 1:
        scores = tl.sigmoid(lg)
    else:
        scores = lg
    choice = scores
    if HAS_SBIAS:
        choice = choice + tl.load(sbias_ptr + offs_e, mask=e_mask, other=0.0).to(tl.float32)
    choice = tl.where(e_mask, choice, -float("inf"))
    offs_j = tl.arange(0, BLOCK_TOPK)
    ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)
    vals = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.argmax(choice, axis=0)
        v = tl.sum(tl.where(offs_e == best, scores, 0.0), axis=0)
        ids = tl.where(offs_j == j, best, ids)
        vals = tl.where(offs_j == j, v, vals)
        choice = tl.where(offs_e == best, -float("inf"), choice)
    j_mask = offs_j < TOPK
    if SCORING == 2:
        ex = tl.where(j_mask, tl.exp(vals - tl.max(tl.where(j_mask, vals, -float("inf")), axis=0)), 0.0)
        w = ex / tl.sum(ex, axis=0)
    else:
        w = vals
        if NORM_TOPK:
            tiny = 1e-20 if SCORING == 1 else 0.0
            w = w / (tl.sum(tl.where(j_mask, w, 0.0), axis=0) + tiny)
        w = w * route_scale
    return ids, w


# ---- attention -----------------------------------------------------------------------------------------------------

@triton.jit
def rope_index(ROT: tl.constexpr, ROPE_PAIR: tl.constexpr, BLOCK_H: tl.constexpr):
    """Index maps of a head's two rotated halves: (a, b, mask) with x[a_j], x[b_j] the pair rotated by freq j.
    half: (j, j + ROT/2); pair: (2j, 2j + 1)."""
    j = tl.arange(0, BLOCK_H)
    if ROPE_PAIR:
        a = 2 * j
        b = 2 * j + 1
    else:
        a = j
        b = j + ROT // 2
    return a, b, j < ROT // 2


@triton.jit
def qk_block(qkv_ptr, row_off, r_mask, fscale, fw_ptr, w_off, hw_ptr, cos, sin, eps, clip,
             DH: tl.constexpr, ROT: tl.constexpr, ROPE_PAIR: tl.constexpr, QK_NORM: tl.constexpr,
             HAS_CLIP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """Heads (rows) of raw q or k from the qkv buffer -> rotated parts (A, B) [R, BLOCK_H] and pass-through part
    C [R, BLOCK_C], in the reference's order: norm over the whole projection (QK_NORM 2: x * fscale * fw[w_off+i]),
    clip, per-head RMSNorm (QK_NORM 1, weight hw[i]), RoPE (x_a, x_b) -> (x_a c - x_b s, x_b c + x_a s)."""
    ia, ib, h_mask = rope_index(ROT, ROPE_PAIR, BLOCK_H)
    ic = ROT + tl.arange(0, BLOCK_C)
    c_mask = ic < DH
    ma = r_mask[:, None] & h_mask[None, :]
    mc = r_mask[:, None] & c_mask[None, :]
    a = tl.load(qkv_ptr + row_off[:, None] + ia[None, :], mask=ma, other=0.0, cache_modifier=".cg")
    b = tl.load(qkv_ptr + row_off[:, None] + ib[None, :], mask=ma, other=0.0, cache_modifier=".cg")
    c = tl.load(qkv_ptr + row_off[:, None] + ic[None, :], mask=mc, other=0.0, cache_modifier=".cg")
    if QK_NORM == 2:
        a = a * fscale * tl.load(fw_ptr + w_off[:, None] + ia[None, :], mask=ma, other=0.0).to(tl.float32)
        b = b * fscale * tl.load(fw_ptr + w_off[:, None] + ib[None, :], mask=ma, other=0.0).to(tl.float32)
        c = c * fscale * tl.load(fw_ptr + w_off[:, None] + ic[None, :], mask=mc, other=0.0).to(tl.float32)
    if HAS_CLIP:
        a = tl.minimum(tl.maximum(a, -clip), clip)
        b = tl.minimum(tl.maximum(b, -clip), clip)
        c = tl.minimum(tl.maximum(c, -clip), clip)
    if QK_NORM == 1:
        hr = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1) + tl.sum(c * c, axis=1)) / DH + eps)
        a = a * hr[:, None] * tl.load(hw_ptr + ia, mask=h_mask, other=0.0).to(tl.float32)[None, :]
        b = b * hr[:, None] * tl.load(hw_ptr + ib, mask=h_mask, other=0.0).to(tl.float32)[None, :]
        c = c * hr[:, None] * tl.load(hw_ptr + ic, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    ra = a * cos[None, :] - b * sin[None, :]
    rb = b * cos[None, :] + a * sin[None, :]
    return ra, rb, c


@triton.jit
def attention_task(g, sp, n_splits, pos, window, qkv_ptr, k_cache, v_cache, cos_ptr, sin_ptr,
                   qn_ptr, kn_ptr, ao_ptr, am_ptr, al_ptr, eps, sm_scale, clip,
                   HQ: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, ROT: tl.constexpr,
                   ROPE_PAIR: tl.constexpr, QK_NORM: tl.constexpr, HAS_CLIP: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_X: tl.constexpr):
    """One kv head `g`, split `sp` of `n_splits`: its REP query heads against cached keys of this split's share of
    the visible window [start, pos); split 0 also takes the current token (and appends its k, v to the cache at
    `pos`). Writes unnormalised partials: m [REP], l [REP], o [REP, DH] at split `sp` (combined by the o_proj).
    k_cache / v_cache: this layer's and head's [T_max, DH] rows."""
    REP: tl.constexpr = HQ // HKV
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < REP
    heads = g * REP + offs_r
    half: tl.constexpr = ROT // 2
    ia, ib, h_mask = rope_index(ROT, ROPE_PAIR, BLOCK_H)
    ic = ROT + tl.arange(0, BLOCK_C)
    c_mask = ic < DH
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < DH
    cos = tl.load(cos_ptr + pos * half + tl.arange(0, BLOCK_H), mask=h_mask, other=0.0)
    sin = tl.load(sin_ptr + pos * half + tl.arange(0, BLOCK_H), mask=h_mask, other=0.0)
    q_scale = 1.0
    k_scale = 1.0
    if QK_NORM == 2:
        q_scale = rstd(qkv_ptr, HQ * DH, eps, BLOCK_X)
        k_scale = rstd(qkv_ptr + HQ * DH, HKV * DH, eps, BLOCK_X)
    qa, qb, qc = qk_block(qkv_ptr, heads * DH, r_mask, q_scale, qn_ptr, heads * DH, qn_ptr, cos, sin, eps, clip,
                          DH, ROT, ROPE_PAIR, QK_NORM, HAS_CLIP, BLOCK_H, BLOCK_C)
    # k: the same machinery on a block whose only valid row is 0, then that row as vectors
    row0 = offs_r < 1
    ka, kb, kc = qk_block(qkv_ptr, HQ * DH + g * DH + offs_r * 0, row0, k_scale, kn_ptr, g * DH + offs_r * 0,
                          kn_ptr, cos, sin, eps, clip, DH, ROT, ROPE_PAIR, QK_NORM, HAS_CLIP, BLOCK_H, BLOCK_C)
    ka = tl.sum(ka, axis=0)
    kb = tl.sum(kb, axis=0)
    kc = tl.sum(kc, axis=0)
    v = tl.load(qkv_ptr + (HQ + HKV) * DH + g * DH + offs_d, mask=d_mask, other=0.0, cache_modifier=".cg")
    if HAS_CLIP:
        v = tl.minimum(tl.maximum(v, -clip), clip)

    is0 = sp == 0
    # the current token (split 0 only): score, and its k / v appended to the cache
    tl.store(k_cache + pos * DH + ia, ka, mask=h_mask & is0)
    tl.store(k_cache + pos * DH + ib, kb, mask=h_mask & is0)
    tl.store(k_cache + pos * DH + ic, kc, mask=c_mask & is0)
    tl.store(v_cache + pos * DH + offs_d, v, mask=d_mask & is0)
    s_cur = (tl.sum(qa * ka[None, :], axis=1) + tl.sum(qb * kb[None, :], axis=1)
             + tl.sum(qc * kc[None, :], axis=1)) * sm_scale
    m_i = tl.where(is0, s_cur, -1e30)                                        # [BLOCK_R]
    l_i = tl.where(is0, 1.0, 0.0) + s_cur * 0.0
    acc = tl.where(is0, 1.0, 0.0) * v[None, :] + tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)

    # cached keys visible from `pos`: [start, pos), this split's contiguous share
    start = 0
    if window > 0:
        start = tl.maximum(pos - window + 1, 0)
    chunk = (pos - start + n_splits - 1) // n_splits
    lo = start + sp * chunk
    hi = tl.minimum(lo + chunk, pos)
    for t0 in range(lo, hi, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        t_mask = offs_t < hi
        kp = k_cache + offs_t[:, None] * DH
        ta = tl.load(kp + ia[None, :], mask=t_mask[:, None] & h_mask[None, :], other=0.0, cache_modifier=".cg")
        tb = tl.load(kp + ib[None, :], mask=t_mask[:, None] & h_mask[None, :], other=0.0, cache_modifier=".cg")
        tc = tl.load(kp + ic[None, :], mask=t_mask[:, None] & c_mask[None, :], other=0.0, cache_modifier=".cg")
        s = (tl.sum(qa[:, None, :] * ta.to(tl.float32)[None, :, :], axis=2)
             + tl.sum(qb[:, None, :] * tb.to(tl.float32)[None, :, :], axis=2)
             + tl.sum(qc[:, None, :] * tc.to(tl.float32)[None, :, :], axis=2)) * sm_scale     # [R, T]
        s = tl.where(t_mask[None, :], s, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None]) * t_mask[None, :].to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_cache + offs_t[:, None] * DH + offs_d[None, :], mask=t_mask[:, None] & d_mask[None, :],
                     other=0.0, cache_modifier=".cg").to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vt[None, :, :], axis=1)
        m_i = m_new
    tl.store(am_ptr + sp * HQ + heads, m_i, mask=r_mask)
    tl.store(al_ptr + sp * HQ + heads, l_i, mask=r_mask)
    tl.store(ao_ptr + sp * HQ * DH + heads[:, None] * DH + offs_d[None, :], acc,
             mask=r_mask[:, None] & d_mask[None, :])


@triton.jit
def attn_combine(ao_ptr, am_ptr, al_ptr, sink_ptr, n_splits, dst_ptr,
                 HQ: tl.constexpr, DH: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK: tl.constexpr):
    """Split partials -> softmax(QK^T) V per head [HQ * DH] into dst (this program's scratch). The sink logit of
    a head joins the denominator only (gpt-oss)."""
    N: tl.constexpr = HQ * DH
    for k0 in range(0, N, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < N
        h = offs // DH
        m = tl.full((BLOCK,), -1e30, dtype=tl.float32)
        for s in range(n_splits):
            m = tl.maximum(m, tl.load(am_ptr + s * HQ + h, mask=mask, other=-1e30, cache_modifier=".cg"))
        num = tl.zeros((BLOCK,), dtype=tl.float32)
        den = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(n_splits):
            f = tl.exp(tl.load(am_ptr + s * HQ + h, mask=mask, other=-1e30, cache_modifier=".cg") - m)
            num += f * tl.load(ao_ptr + s * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
            den += f * tl.load(al_ptr + s * HQ + h, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_SINKS:
            den += tl.exp(tl.load(sink_ptr + h, mask=mask, other=0.0).to(tl.float32) - m)
        tl.store(dst_ptr + offs, num / den, mask=mask)


# ---- LM head and sampling --------------------------------------------------------------------------------------------

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
def lm_task(w_ptr, w_first, K, row0, r_end, x_ptr, nw_ptr, eps, tile, pv_ptr, pi_ptr, do_sample, inv_temp, seed,
            step, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Vocab rows [row0, r_end) of the LM head on RMSNorm(x): this tile's max and argmax of logits (greedy) or of
    logits / T + Gumbel noise (sampling), ties to the lowest id (torch.argmax's rule)."""
    scale = rstd(x_ptr, K, eps, BLOCK_K)
    best_v = -float("inf")
    best_i = row0
    for r0 in range(row0, r_end, BLOCK_N):
        logit = dot_rows(w_ptr, K, r0, r_end, x_ptr, nw_ptr, w_first, r0 == row0, True, BLOCK_N, BLOCK_K) * scale
        rows = r0 + tl.arange(0, BLOCK_N)
        val = logit
        if do_sample != 0:
            val = logit * inv_temp + gumbel(seed, step, rows)
        val = tl.where(rows < r_end, val, -float("inf"))
        cm = tl.max(val, axis=0)
        ci = tl.argmax(val, axis=0) + r0
        upd = cm > best_v
        best_i = tl.where(upd, ci, best_i)
        best_v = tl.where(upd, cm, best_v)
    tl.store(pv_ptr + tile, best_v)
    tl.store(pi_ptr + tile, best_i)


@triton.jit
def pick_token(pv_ptr, pi_ptr, n_tiles, BLOCK_P: tl.constexpr):
    """Reduce the LM-head tiles' (max, argmax) partials -> token id (first tile wins ties: lowest id)."""
    offs = tl.arange(0, BLOCK_P)
    mask = offs < n_tiles
    pv = tl.load(pv_ptr + offs, mask=mask, other=-float("inf"), cache_modifier=".cg")
    pi = tl.load(pi_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
    best = tl.argmax(pv, axis=0)
    return tl.sum(tl.where(offs == best, pi, 0), axis=0)


@triton.jit
def embed_row(emb_ptr, tok, x_ptr, D, BLOCK: tl.constexpr):
    """x = embed[tok] (fp32): the next step's input."""
    for k0 in range(0, D, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < D
        tl.store(x_ptr + offs, tl.load(emb_ptr + tok.to(tl.int64) * D + offs, mask=mask, other=0.0).to(tl.float32),
                 mask=mask)


@triton.jit
def vec_dot_norm(w_ptr, x_ptr, nw_ptr, K, eps, BLOCK_K: tl.constexpr):
    """w[K] . RMSNorm(x) (the shared-expert gate's single row)."""
    acc = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        acc += tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) * x_chunk(x_ptr, nw_ptr, offs, mask, True)
    return tl.sum(acc, axis=0) * rstd(x_ptr, K, eps, BLOCK_K)


@triton.jit
def expert_down_task(ed_ptr, edb_ptr, sd_ptr, row0, r_end, h_ptr, ids_ptr, wts_ptr, sg_ptr, x_ptr,
                     D: tl.constexpr, I_MOE: tl.constexpr, I_SH: tl.constexpr, TOPK: tl.constexpr,
                     HAS_EBIAS: tl.constexpr, HAS_SH_GATE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[r] += sum_j w_j * (Wdown[e_j][r] . h_j + bdown[e_j][r]) + sg * (Wsh_down[r] . h_sh), rows [row0, r_end):
    every routed slot (and the shared expert) of this output tile in one task, routing weights folded in, so the
    sum has a fixed order and needs no atomics. ed_ptr: expert 0's down [D, I_MOE]; h: [TOPK, I_MOE] + [I_SH]."""
    none = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for r0 in range(row0, r_end, BLOCK_N):
        rows = r0 + tl.arange(0, BLOCK_N)
        r_mask = rows < r_end
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(TOPK):
            e = tl.load(ids_ptr + j, cache_modifier=".cg").to(tl.int64)
            wj = tl.load(wts_ptr + j, cache_modifier=".cg")
            d = dot_rows(ed_ptr + e * (D * I_MOE), I_MOE, r0, r_end, h_ptr + j * I_MOE, h_ptr, none, False, False,
                         BLOCK_N, BLOCK_K)
            if HAS_EBIAS:
                d += tl.load(edb_ptr + e * D + rows, mask=r_mask, other=0.0).to(tl.float32)
            acc += d * wj
        if I_SH > 0:
            sh = dot_rows(sd_ptr, I_SH, r0, r_end, h_ptr + TOPK * I_MOE, h_ptr, none, False, False, BLOCK_N, BLOCK_K)
            if HAS_SH_GATE:
                sh = sh * tl.load(sg_ptr, cache_modifier=".cg")
            acc += sh
        acc += tl.load(x_ptr + rows, mask=r_mask, other=0.0, cache_modifier=".cg")
        tl.store(x_ptr + rows, acc, mask=r_mask)

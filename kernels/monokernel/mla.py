"""Multi-head Latent Attention (DeepSeek-V2/V3) in the monokernel, in the absorbed form.

The reference (models/reference.py `_mla`) expands the latent cache through kv_b every step: k_nope, v [T, H, .] =
kv_b(latent). Decode never needs that: q . k_nope = (W_kb[h]^T q_nope[h]) . latent and p . v = W_vb[h] (p . latent),
with W_kb[h] / W_vb[h] the nope / v rows of head h in kv_b [H * (nope + v), r_kv]. So a layer is
  qkv_proj   x -> [q_a | kv_a] (or [q | kv_a])                        (stream.stream_gemv, RMSNorm fused)
  q_b_proj   RMSNorm(q_a) -> q [H, nope + rope]                        (stream.stream_gemv; only with a q LoRA)
  absorb     q_lat[h] = W_kb[h]^T q_nope[h] [r_kv], q_pe[h] = RoPE(q_rope[h]); the head group holding head 0 also
             appends this token's RMSNorm(kv_a[:r_kv]) and RoPE(kv_a[r_kv:]) to the cache [T, r_kv + rope]
  attention  per group of MLA_HEADS heads and sequence split: scores = q_lat . latent + q_pe . k_pe over cache
             rows [0, pos] (tl.dot tiles), online softmax, o_lat = p . latent: partials (m, l, o_lat [r_kv])
  v_up       per head: combine the splits, v[h] = W_vb[h] o_lat[h]                 -> o_proj reads v [H * v]
Every kv_b byte is read once per step (its nope rows by absorb, its v rows by v_up); the latent cache once per
head group and split.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .ops import kv_split_range, rope_index


@triton.jit
def mla_absorb_task(h0, nh, pos, q_ptr, kvb_ptr, qlat_ptr, qpe_ptr, kva_ptr, kvnorm_ptr, cache_ptr, cos_ptr,
                    sin_ptr, eps, DH: tl.constexpr, NOPE: tl.constexpr, VD: tl.constexpr, R_KV: tl.constexpr,
                    ROT: tl.constexpr, ROPE_PAIR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_RKV: tl.constexpr,
                    BLOCK_H: tl.constexpr):
    """Heads [h0, h0 + nh): q_lat[h] = W_kb[h]^T q_nope[h], q_pe[h] = RoPE(q[h, nope:]). Head group 0 also writes
    this token's latent (RMSNorm over r_kv) and roped k_pe into cache row `pos` (cache_ptr: this layer's
    [T_max, r_kv + rope])."""
    half: tl.constexpr = ROT // 2
    cols = tl.arange(0, BLOCK_RKV)
    cm = cols < R_KV
    ia, ib, hm = rope_index(ROT, ROPE_PAIR, BLOCK_H)
    cos = tl.load(cos_ptr + pos * half + tl.arange(0, BLOCK_H), mask=hm, other=0.0)
    sin = tl.load(sin_ptr + pos * half + tl.arange(0, BLOCK_H), mask=hm, other=0.0)
    for h in range(h0, h0 + nh):
        acc = tl.zeros((BLOCK_RKV,), dtype=tl.float32)
        for r0 in range(0, NOPE, BLOCK_N):
            rows = r0 + tl.arange(0, BLOCK_N)
            rm = rows < NOPE
            w = tl.load(kvb_ptr + (h * (NOPE + VD) + rows).to(tl.int64)[:, None] * R_KV + cols[None, :],
                        mask=rm[:, None] & cm[None, :], other=0.0)
            qn = tl.load(q_ptr + h * DH + rows, mask=rm, other=0.0, cache_modifier=".cg")
            acc += tl.sum(w.to(tl.float32) * qn[:, None], axis=0)
        tl.store(qlat_ptr + h * R_KV + cols, acc, mask=cm)
        xa = tl.load(q_ptr + h * DH + NOPE + ia, mask=hm, other=0.0, cache_modifier=".cg")
        xb = tl.load(q_ptr + h * DH + NOPE + ib, mask=hm, other=0.0, cache_modifier=".cg")
        tl.store(qpe_ptr + h * ROT + ia, xa * cos - xb * sin, mask=hm)
        tl.store(qpe_ptr + h * ROT + ib, xb * cos + xa * sin, mask=hm)
    if h0 == 0:
        row = cache_ptr + pos.to(tl.int64) * (R_KV + ROT)
        lat = tl.load(kva_ptr + cols, mask=cm, other=0.0, cache_modifier=".cg")
        r = 1.0 / tl.sqrt(tl.sum(lat * lat, axis=0) / R_KV + eps)
        lat = lat * r * tl.load(kvnorm_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        tl.store(row + cols, lat, mask=cm)
        ka = tl.load(kva_ptr + R_KV + ia, mask=hm, other=0.0, cache_modifier=".cg")
        kb = tl.load(kva_ptr + R_KV + ib, mask=hm, other=0.0, cache_modifier=".cg")
        tl.store(row + R_KV + ia, ka * cos - kb * sin, mask=hm)
        tl.store(row + R_KV + ib, kb * cos + ka * sin, mask=hm)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:   # fp32 operands (an fp32 cache): exact products, as the fp32 reference
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def mla_attention_task(h0, nh, sp, n_splits, pos, qlat_ptr, qpe_ptr, cache_ptr, ao_ptr, am_ptr, al_ptr, sm_scale,
                       H: tl.constexpr, R_KV: tl.constexpr, ROT: tl.constexpr, BLOCK_HG: tl.constexpr,
                       BLOCK_RKV: tl.constexpr, BLOCK_RD: tl.constexpr, BLOCK_T: tl.constexpr):
    """Heads [h0, h0 + nh) (nh <= BLOCK_HG), split sp of the cache rows [0, pos]: unnormalised partials
    m, l [H] and o_lat [H, r_kv] at split sp (ao: [splits, H, r_kv])."""
    offs_h = tl.arange(0, BLOCK_HG)
    hm = offs_h < nh
    heads = h0 + offs_h
    cr = tl.arange(0, BLOCK_RKV)
    crm = cr < R_KV
    cd = tl.arange(0, BLOCK_RD)
    cdm = cd < ROT
    IEEE: tl.constexpr = cache_ptr.dtype.element_ty == tl.float32
    ql = tl.load(qlat_ptr + heads[:, None] * R_KV + cr[None, :], mask=hm[:, None] & crm[None, :], other=0.0,
                 cache_modifier=".cg").to(cache_ptr.dtype.element_ty)
    qp = tl.load(qpe_ptr + heads[:, None] * ROT + cd[None, :], mask=hm[:, None] & cdm[None, :], other=0.0,
                 cache_modifier=".cg").to(cache_ptr.dtype.element_ty)
    lo, hi = kv_split_range(pos + 1, 0, n_splits, sp)     # the current token is in the latent cache already
    m_i = tl.full((BLOCK_HG,), -1e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_HG,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_HG, BLOCK_RKV), dtype=tl.float32)
    for t0 in range(lo, hi, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        tm = offs_t < hi
        rowp = cache_ptr + offs_t.to(tl.int64)[:, None] * (R_KV + ROT)
        lat = tl.load(rowp + cr[None, :], mask=tm[:, None] & crm[None, :], other=0.0, cache_modifier=".cg")
        kpe = tl.load(rowp + R_KV + cd[None, :], mask=tm[:, None] & cdm[None, :], other=0.0, cache_modifier=".cg")
        s = (_dot(ql, tl.trans(lat), IEEE) + _dot(qp, tl.trans(kpe), IEEE)) * sm_scale       # [BLOCK_HG, BLOCK_T]
        s = tl.where(tm[None, :], s, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None]) * tm[None, :].to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(lat.dtype), lat, IEEE)
        m_i = m_new
    tl.store(am_ptr + sp * H + heads, m_i, mask=hm)
    tl.store(al_ptr + sp * H + heads, l_i, mask=hm)
    tl.store(ao_ptr + (sp * H + heads)[:, None] * R_KV + cr[None, :], acc, mask=hm[:, None] & crm[None, :])


@triton.jit
def mla_vup_task(h0, nh, n_splits, ao_ptr, am_ptr, al_ptr, kvb_ptr, v_ptr, H: tl.constexpr, NOPE: tl.constexpr,
                 VD: tl.constexpr, R_KV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_RKV: tl.constexpr):
    """Heads [h0, h0 + nh): o_lat[h] = the splits' softmax-weighted latent sum, v[h] = W_vb[h] o_lat[h]."""
    cr = tl.arange(0, BLOCK_RKV)
    crm = cr < R_KV
    for h in range(h0, h0 + nh):
        m = -1e30
        for s in range(n_splits):
            m = tl.maximum(m, tl.load(am_ptr + s * H + h, cache_modifier=".cg"))
        num = tl.zeros((BLOCK_RKV,), dtype=tl.float32)
        den = 0.0
        for s in range(n_splits):
            f = tl.exp(tl.load(am_ptr + s * H + h, cache_modifier=".cg") - m)
            num += f * tl.load(ao_ptr + (s * H + h) * R_KV + cr, mask=crm, other=0.0, cache_modifier=".cg")
            den += f * tl.load(al_ptr + s * H + h, cache_modifier=".cg")
        o_lat = num / den
        for r0 in range(0, VD, BLOCK_N):
            rows = r0 + tl.arange(0, BLOCK_N)
            rm = rows < VD
            w = tl.load(kvb_ptr + (h * (NOPE + VD) + NOPE + rows).to(tl.int64)[:, None] * R_KV + cr[None, :],
                        mask=rm[:, None] & crm[None, :], other=0.0)
            tl.store(v_ptr + h * VD + rows, tl.sum(w.to(tl.float32) * o_lat[None, :], axis=1), mask=rm)

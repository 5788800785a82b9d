"""Decode attention for one query token over the KV cache: GQA (sliding window, sinks) and MLA (absorbed form).

Cache layouts are those of kernels/rope.py (which appends the token first): GQA k_cache / v_cache
[max_len, Hkv, Dh]; MLA cache [max_len, r + rope] = (latent, k_pe). The context length is pos + 1 with `pos` read
on the device (int32 [1]), so the launch never syncs with the host and a CUDA graph replays at any length
(a position past the cache is clamped to it: no out-of-bounds reads).

Flash-decoding. One program owns (kv head, split): all REP = Hq/Hkv query heads of that kv head sit in one
[REP, Dh] tile, so each K/V byte is read once per token, and the scores are one tl.dot. The visible keys
[lo, pos] (lo = pos + 1 - window with a sliding window) are cut into NUM_SPLITS equal chunks, rounded up to
BLOCK_N, *on the device*: the grid is fixed (Hkv x NUM_SPLITS) while the work per program follows the length, and
splits past the end exit at once. Each split keeps an fp32 online softmax (running max m, sum l, acc) and writes
(acc / l, lse = m + log2 l); a combine program per q head merges the active splits. With NUM_SPLITS == 1 the
split program finishes the softmax itself (one launch). Scores live in the log2 domain: scale * log2(e) is folded
into the scores so the softmax is exp2.

Sinks (gpt-oss): one learned logit per q head joins the softmax denominator and is dropped after it, i.e.
out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}), exactly the reference's extra column.

MLA (DeepSeek) decode in the absorbed form, three program kinds (three launches here; three task kinds in the
monokernel):
  1. absorb   q_lat[h] = W_uk[h]^T q_nope[h]            W_uk[h] = kv_b[h*(nope+v) : h*(nope+v)+nope] [nope, r]
  2. attend   score_t = (q_lat[h] . latent_t + q_pe[h] . k_pe_t) * scale; o_lat[h] = softmax @ latent
              a tile of BLOCK_H heads per program (MQA: every head reads the same latent rows), split like GQA
  3. up       out[h] = W_uv[h] @ combine(o_lat[h])        W_uv[h] = kv_b[h*(nope+v)+nope : (h+1)*(nope+v)] [v, r]
kv_b is the bf16 / fp32 [H*(nope+v), r] weight (dequantise a quantised kv_b once at load time).

Precision: scores and softmax in fp32; on the GPU the two matmuls take bf16 operands (probabilities are rounded
to bf16 before P @ V, as in FlashAttention). Under TRITON_INTERPRET the dots run in fp32 (the interpreter cannot
multiply bf16), so CPU tests are slightly more exact than the GPU.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from ..models.reference import ReferenceDecoder
from .pdl import launch_kw, pdl_begin
from .rope import (NORM_FULL, _norm_rope_loaded, _norm_rope_rows, _rope_rows_load, _style_pair, cast_to,
                   check_rope_args, round_to)
from .tiles import _x8_offs

__all__ = ["gqa_decode", "rope_gqa_decode", "mla_decode", "gqa_decode_ref", "mla_decode_ref", "default_num_splits",
           "gqa_split_task", "gqa_combine_task", "mla_absorb_task", "mla_split_task", "mla_combine_up_task"]

LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# rope_gqa_split_task loads q, k, v and the norm weights before pos (one round trip for all); 0: after it, in the
# order of the math (the A/B of NOTES.md session 28).
LOADS_FIRST = tl.constexpr(os.environ.get("KIE_ATTN_LOADS_FIRST", "1") == "1")


# ---- shared device helpers ---------------------------------------------------------------------------------------

@triton.jit
def _split_geometry(pos_ptr, max_len, window, HAS_WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """-> (lo, length, chunk, n_active): keys [lo, length) are visible; split s owns [lo + s*chunk, +chunk)."""
    length = tl.minimum(tl.load(pos_ptr) + 1, max_len)
    lo = length * 0
    if HAS_WINDOW:                       # key j visible from query pos iff pos - window < j <= pos
        lo = tl.maximum(length - window, 0)
    n_vis = length - lo
    chunk = tl.cdiv(tl.cdiv(n_vis, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return lo, length, chunk, tl.cdiv(n_vis, chunk)


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
    """One key block: s [ROWS, BLOCK_N] log2-domain scores (-inf where masked), v [BLOCK_N, D]."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _store_partial(o_part_ptr, lse_part_ptr, rows, split, offs_d, m_i, l_i, acc, mask_rows, mask_d,
                   stride_oph, stride_ops, stride_lh):
    """Split partials: o = acc / l [ROWS, D] and lse = m + log2(l) (log2 domain; -inf for an empty split)."""
    has = l_i > 0
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), -float("inf"))
    tl.store(o_part_ptr + rows[:, None] * stride_oph + split * stride_ops + offs_d[None, :], o,
             mask=mask_rows[:, None] & mask_d[None, :])
    tl.store(lse_part_ptr + rows * stride_lh + split, lse, mask=mask_rows)


@triton.jit
def _combine_row(o_part_ptr, lse_part_ptr, row, n_active, sink, stride_oph, stride_ops, stride_lh,
                 D: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the n_active split partials of one row -> [BLOCK_D] fp32. sink is log2-domain (ignored without sinks)."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < n_active
    lse = tl.load(lse_part_ptr + row * stride_lh + offs_s, mask=mask_s, other=-float("inf"))
    m = tl.max(lse, axis=0)
    if HAS_SINKS:
        m = tl.maximum(m, sink)
    w = tl.where(mask_s, tl.exp2(lse - m), 0.0)
    o = tl.load(o_part_ptr + row * stride_oph + offs_s[:, None] * stride_ops + offs_d[None, :],
                mask=mask_s[:, None] & (offs_d < D)[None, :], other=0.0)
    den = tl.sum(w, axis=0)
    if HAS_SINKS:
        den += tl.exp2(sink - m)
    return tl.sum(w[:, None] * o, axis=0) / den


# ---- GQA ------------------------------------------------------------------------------------------------------

@triton.jit
def _store_o(out_ptr, head, offs_d, o, mask, stride_oh, DH: tl.constexpr, X8: tl.constexpr):
    """Attention output rows `head` (broadcast against offs_d): out[head, d], or with X8 > 0 the flat [Hq * DH]
    output in the x8 layout an fp4 o_proj reads (tiles._x8_offs, X8 = Hq * DH / 8, fp32)."""
    if X8 > 0:
        tl.store(out_ptr + _x8_offs(head * DH + offs_d, X8), cast_to(o, out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + head * stride_oh + offs_d, cast_to(o, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gqa_split_task(kv_head, split, q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, sinks_ptr, out_ptr,
                   o_part_ptr, lse_part_ptr, max_len, window, qk_scale,
                   stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_oh,
                   stride_oph, stride_ops, stride_lh,
                   DH: tl.constexpr, REP: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                   HAS_SINKS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, X8: tl.constexpr = 0):
    """One program's share: the REP q heads of `kv_head` over split `split` of the visible keys.

    q [Hq, DH]; caches [max_len, Hkv, DH]; qk_scale = softmax_scale * log2(e). NUM_SPLITS == 1: writes
    out [Hq, DH] (sinks applied); else o_part [Hq, NUM_SPLITS, DH] fp32 and lse_part [Hq, NUM_SPLITS] fp32.
    """
    lo, length, chunk, n_active = _split_geometry(pos_ptr, max_len, window, HAS_WINDOW, NUM_SPLITS, BLOCK_N)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, length)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * REP + offs_r
    q = tl.load(q_ptr + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_r < REP)[:, None] & (offs_d < DH)[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_R, BLOCK_D]
    _gqa_attend(q, kv_head, split, start, end, k_cache_ptr, v_cache_ptr, sinks_ptr, out_ptr, o_part_ptr,
                lse_part_ptr, qk_scale, stride_kt, stride_kh, stride_vt, stride_vh, stride_oh, stride_oph, stride_ops,
                stride_lh, DH, REP, NUM_SPLITS, HAS_SINKS, DOT_DTYPE, DOT_PREC, BLOCK_R, BLOCK_N, BLOCK_D, X8)


@triton.jit
def _gqa_attend(q, kv_head, split, start, end, k_cache_ptr, v_cache_ptr, sinks_ptr, out_ptr, o_part_ptr,
                lse_part_ptr, qk_scale, stride_kt, stride_kh, stride_vt, stride_vh, stride_oh, stride_oph, stride_ops,
                stride_lh, DH: tl.constexpr, REP: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_SINKS: tl.constexpr,
                DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, X8: tl.constexpr = 0):
    """q [BLOCK_R, BLOCK_D] (DOT_DTYPE, the REP heads of kv_head) over keys [start, end) -> out or the split's
    partial (see gqa_split_task)."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * REP + offs_r
    mask_r = offs_r < REP
    mask_d = offs_d < DH
    m_i = tl.full([BLOCK_R], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + offs_n
        mask_n = offs < end
        mask_kv = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_base + offs[:, None] * stride_kt + offs_d[None, :], mask=mask_kv, other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_base + offs[:, None] * stride_vt + offs_d[None, :], mask=mask_kv, other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PREC) * qk_scale      # [BLOCK_R, BLOCK_N]
        s = tl.where(mask_n[None, :], s, -float("inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, v.to(DOT_DTYPE), DOT_DTYPE, DOT_PREC)
    if NUM_SPLITS == 1:
        scale = 1.0 / l_i
        if HAS_SINKS:                    # the sink joins the denominator only
            sink = tl.load(sinks_ptr + heads, mask=mask_r, other=0.0).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            scale = tl.exp2(m_i - m_f) / (l_i * tl.exp2(m_i - m_f) + tl.exp2(sink - m_f))
        out = acc * scale[:, None]
        _store_o(out_ptr, heads[:, None], offs_d[None, :], out, mask_r[:, None] & mask_d[None, :], stride_oh, DH, X8)
    else:
        _store_partial(o_part_ptr, lse_part_ptr, heads, split, offs_d, m_i, l_i, acc, mask_r, mask_d,
                       stride_oph, stride_ops, stride_lh)


@triton.jit
def rope_gqa_split_task(kv_head, split, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr,
                        q_norm_ptr, k_norm_ptr, sinks_ptr, out_ptr, o_part_ptr, lse_part_ptr, max_len, window,
                        qk_scale, eps, clip, stride_qh, stride_kh, stride_vh, stride_kt, stride_kch, stride_vt,
                        stride_vch, stride_cos, stride_oh, stride_oph, stride_ops, stride_lh,
                        DH: tl.constexpr, ROT: tl.constexpr, PAIR: tl.constexpr, NORM: tl.constexpr,
                        CLIP: tl.constexpr, REP: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        HAS_SINKS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, X8: tl.constexpr = 0):
    """kernels/rope.py's rope_append_task and gqa_split_task in one program (one launch less per layer): the
    program whose key range holds `pos` norms + rotates k of `kv_head` and appends k, v at cache[pos] before it
    reads the range (the other splits never read row pos); every program norms + rotates its own REP q heads
    in registers (q is not written back). Same rounding as the two launches (q, k rounded to q's dtype).
    q [Hq, DH], k / v [Hkv, DH] raw; NORM none or per head (a full-projection norm needs every head: unfused)."""
    # Every input that does not depend on the position (q, k and v rows, the norm weights) is loaded first, so all
    # of them share one round trip with pos; the cos / sin rows follow pos (KIE_ATTN_LOADS_FIRST=0: the order before).
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    if LOADS_FIRST:
        qr = _rope_rows_load(q_ptr, kv_head * REP, REP, stride_qh, q_norm_ptr, DH, ROT, PAIR, NORM, BLOCK_R,
                             BLOCK_D)
        kr = _rope_rows_load(k_ptr, kv_head, 1, stride_kh, k_norm_ptr, DH, ROT, PAIR, NORM, 1, BLOCK_D)
        v = tl.load(v_ptr + kr[4][:, None] * stride_vh + kr[5][None, :], mask=kr[6], other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr)
    row = tl.minimum(pos, max_len - 1)
    cos_row = cos_ptr + row * stride_cos
    sin_row = sin_ptr + row * stride_cos
    lo, length, chunk, n_active = _split_geometry(pos_ptr, max_len, window, HAS_WINDOW, NUM_SPLITS, BLOCK_N)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, length)
    if (pos >= start) & (pos < end):      # end <= length <= max_len: row pos is inside the cache
        if LOADS_FIRST:
            k, offs_h, offs_d, mask = _norm_rope_loaded(kr, 1, cos_row, sin_row, eps, clip, DH, ROT, PAIR, NORM,
                                                        CLIP, DTYPE)
        else:
            k, offs_h, offs_d, mask = _norm_rope_rows(k_ptr, kv_head, 1, stride_kh, k_norm_ptr, cos_row, sin_row,
                                                      eps, clip, DH, ROT, PAIR, NORM, CLIP, DTYPE, 1, BLOCK_D)
            v = tl.load(v_ptr + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(k_cache_ptr + pos * stride_kt + offs_h[:, None] * stride_kch + offs_d[None, :],
                 cast_to(cast_to(k, DTYPE), k_cache_ptr.dtype.element_ty), mask=mask)
        if CLIP:
            v = round_to(tl.minimum(tl.maximum(v, -clip), clip), DTYPE)
        tl.store(v_cache_ptr + pos * stride_vt + offs_h[:, None] * stride_vch + offs_d[None, :],
                 cast_to(v, v_cache_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()                # the row is in the cache before any thread of this program reads it
    if LOADS_FIRST:
        q, _, _, _ = _norm_rope_loaded(qr, REP, cos_row, sin_row, eps, clip, DH, ROT, PAIR, NORM, CLIP, DTYPE)
    else:
        q, _, _, _ = _norm_rope_rows(q_ptr, kv_head * REP, REP, stride_qh, q_norm_ptr, cos_row, sin_row, eps, clip,
                                     DH, ROT, PAIR, NORM, CLIP, DTYPE, BLOCK_R, BLOCK_D)
    q = cast_to(q, DTYPE).to(DOT_DTYPE)
    _gqa_attend(q, kv_head, split, start, end, k_cache_ptr, v_cache_ptr, sinks_ptr, out_ptr, o_part_ptr,
                lse_part_ptr, qk_scale, stride_kt, stride_kch, stride_vt, stride_vch, stride_oh, stride_oph,
                stride_ops, stride_lh, DH, REP, NUM_SPLITS, HAS_SINKS, DOT_DTYPE, DOT_PREC, BLOCK_R, BLOCK_N,
                BLOCK_D, X8)


@triton.jit
def gqa_combine_task(head, pos_ptr, sinks_ptr, out_ptr, o_part_ptr, lse_part_ptr, max_len, window,
                     stride_oh, stride_oph, stride_ops, stride_lh,
                     DH: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                     SPLIT_BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                     X8: tl.constexpr = 0):
    """One program's share of the combine: q head `head` -> out[head] [DH] (X8: see _store_o)."""
    lo, length, chunk, n_active = _split_geometry(pos_ptr, max_len, window, HAS_WINDOW, NUM_SPLITS, SPLIT_BLOCK_N)
    sink = 0.0
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
    o = _combine_row(o_part_ptr, lse_part_ptr, head, n_active, sink, stride_oph, stride_ops, stride_lh,
                     DH, HAS_SINKS, BLOCK_S, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    _store_o(out_ptr, head, offs_d, o, offs_d < DH, stride_oh, DH, X8)


@triton.jit
def _gqa_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, sinks_ptr, out_ptr, o_part_ptr, lse_part_ptr,
                      max_len, window, qk_scale, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_oh,
                      stride_oph, stride_ops, stride_lh,
                      DH: tl.constexpr, REP: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      HAS_SINKS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, X8: tl.constexpr = 0,
                      PDL: tl.constexpr = False):
    pdl_begin(PDL)
    gqa_split_task(tl.program_id(0), tl.program_id(1), q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, sinks_ptr, out_ptr,
                   o_part_ptr, lse_part_ptr, max_len, window, qk_scale, stride_qh, stride_kt, stride_kh, stride_vt,
                   stride_vh, stride_oh, stride_oph, stride_ops, stride_lh,
                   DH, REP, NUM_SPLITS, HAS_WINDOW, HAS_SINKS, DOT_DTYPE, DOT_PREC, BLOCK_R, BLOCK_N, BLOCK_D, X8)


@triton.jit
def _rope_gqa_split_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr, q_norm_ptr,
                           k_norm_ptr, sinks_ptr, out_ptr, o_part_ptr, lse_part_ptr, max_len, window, qk_scale, eps,
                           clip, stride_qh, stride_kh, stride_vh, stride_kt, stride_kch, stride_vt, stride_vch,
                           stride_cos, stride_oh, stride_oph, stride_ops, stride_lh,
                           DH: tl.constexpr, ROT: tl.constexpr, PAIR: tl.constexpr, NORM: tl.constexpr,
                           CLIP: tl.constexpr, REP: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                           DOT_PREC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_D: tl.constexpr, X8: tl.constexpr = 0, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    rope_gqa_split_task(tl.program_id(0), tl.program_id(1), q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
                        cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, sinks_ptr, out_ptr, o_part_ptr, lse_part_ptr,
                        max_len, window, qk_scale, eps, clip, stride_qh, stride_kh, stride_vh, stride_kt, stride_kch,
                        stride_vt, stride_vch, stride_cos, stride_oh, stride_oph, stride_ops, stride_lh,
                        DH, ROT, PAIR, NORM, CLIP, REP, NUM_SPLITS, HAS_WINDOW, HAS_SINKS, DOT_DTYPE, DOT_PREC,
                        BLOCK_R, BLOCK_N, BLOCK_D, X8)


@triton.jit
def _gqa_combine_kernel(pos_ptr, sinks_ptr, out_ptr, o_part_ptr, lse_part_ptr, max_len, window,
                        stride_oh, stride_oph, stride_ops, stride_lh,
                        DH: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        HAS_SINKS: tl.constexpr, SPLIT_BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_D: tl.constexpr, X8: tl.constexpr = 0, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    gqa_combine_task(tl.program_id(0), pos_ptr, sinks_ptr, out_ptr, o_part_ptr, lse_part_ptr, max_len, window,
                     stride_oh, stride_oph, stride_ops, stride_lh,
                     DH, NUM_SPLITS, HAS_WINDOW, HAS_SINKS, SPLIT_BLOCK_N, BLOCK_S, BLOCK_D, X8)


# ---- MLA ------------------------------------------------------------------------------------------------------

@triton.jit
def mla_absorb_task(head, r_tile, q_ptr, kv_b_ptr, q_lat_ptr, stride_qh, stride_wb, stride_lh,
                    NOPE: tl.constexpr, V: tl.constexpr, R: tl.constexpr,
                    BLOCK_NOPE: tl.constexpr, BLOCK_RT: tl.constexpr):
    """q_lat[head, tile] = W_uk[head]^T q_nope[head]: q [H, NOPE + rope], kv_b [H*(NOPE+V), R], q_lat [H, R] fp32."""
    offs_n = tl.arange(0, BLOCK_NOPE)
    offs_r = r_tile * BLOCK_RT + tl.arange(0, BLOCK_RT)
    mask_n = offs_n < NOPE
    mask_r = offs_r < R
    w = tl.load(kv_b_ptr + (head * (NOPE + V) + offs_n)[:, None] * stride_wb + offs_r[None, :],
                mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(tl.float32)          # [BLOCK_NOPE, BLOCK_RT]
    qn = tl.load(q_ptr + head * stride_qh + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(q_lat_ptr + head * stride_lh + offs_r, tl.sum(qn[:, None] * w, axis=0), mask=mask_r)


@triton.jit
def mla_split_task(head_tile, split, q_lat_ptr, q_ptr, cache_ptr, pos_ptr, o_part_ptr, lse_part_ptr,
                   n_heads, max_len, window, qk_scale, stride_lh, stride_qh, stride_ct, stride_oph, stride_ops,
                   stride_lseh, NOPE: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    """BLOCK_H heads x one split over the latent cache [max_len, R + ROPE] -> o_part [H, S, R], lse_part [H, S]."""
    lo, length, chunk, n_active = _split_geometry(pos_ptr, max_len, window, HAS_WINDOW, NUM_SPLITS, BLOCK_N)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, length)
    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    mask_h = heads < n_heads
    mask_r = offs_r < R
    mask_p = offs_p < ROPE
    ql = tl.load(q_lat_ptr + heads[:, None] * stride_lh + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :],
                 other=0.0).to(DOT_DTYPE)                                                 # [BLOCK_H, BLOCK_R]
    qp = tl.load(q_ptr + NOPE + heads[:, None] * stride_qh + offs_p[None, :],
                 mask=mask_h[:, None] & mask_p[None, :], other=0.0).to(DOT_DTYPE)         # [BLOCK_H, BLOCK_P]
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + offs_n
        mask_n = offs < end
        lat = tl.load(cache_ptr + offs[:, None] * stride_ct + offs_r[None, :],
                      mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(DOT_DTYPE)    # [BLOCK_N, BLOCK_R]
        kpe = tl.load(cache_ptr + R + offs[:, None] * stride_ct + offs_p[None, :],
                      mask=mask_n[:, None] & mask_p[None, :], other=0.0).to(DOT_DTYPE)    # [BLOCK_N, BLOCK_P]
        s = (tl.dot(ql, tl.trans(lat), input_precision=DOT_PREC)
             + tl.dot(qp, tl.trans(kpe), input_precision=DOT_PREC)) * qk_scale            # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s, -float("inf"))
        m_i, l_i, acc = _online_softmax_step(s, m_i, l_i, acc, lat, DOT_DTYPE, DOT_PREC)
    _store_partial(o_part_ptr, lse_part_ptr, heads, split, offs_r, m_i, l_i, acc, mask_h, mask_r,
                   stride_oph, stride_ops, stride_lseh)


@triton.jit
def mla_combine_up_task(head, v_tile, pos_ptr, kv_b_ptr, out_ptr, o_part_ptr, lse_part_ptr, max_len, window,
                        stride_wb, stride_oh, stride_oph, stride_ops, stride_lseh,
                        NOPE: tl.constexpr, V: tl.constexpr, R: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, SPLIT_BLOCK_N: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """out[head, tile] = W_uv[head] @ combine(o_lat[head]): the latent never leaves registers. out [H, V]."""
    lo, length, chunk, n_active = _split_geometry(pos_ptr, max_len, window, HAS_WINDOW, NUM_SPLITS, SPLIT_BLOCK_N)
    o_lat = _combine_row(o_part_ptr, lse_part_ptr, head, n_active, 0.0, stride_oph, stride_ops, stride_lseh,
                         R, False, BLOCK_S, BLOCK_R)                                      # [BLOCK_R]
    offs_v = v_tile * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, BLOCK_R)
    mask_v = offs_v < V
    w = tl.load(kv_b_ptr + (head * (NOPE + V) + NOPE + offs_v)[:, None] * stride_wb + offs_r[None, :],
                mask=mask_v[:, None] & (offs_r < R)[None, :], other=0.0).to(tl.float32)   # [BLOCK_V, BLOCK_R]
    out = tl.sum(w * o_lat[None, :], axis=1)
    tl.store(out_ptr + head * stride_oh + offs_v, cast_to(out, out_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _mla_absorb_kernel(q_ptr, kv_b_ptr, q_lat_ptr, stride_qh, stride_wb, stride_lh,
                       NOPE: tl.constexpr, V: tl.constexpr, R: tl.constexpr,
                       BLOCK_NOPE: tl.constexpr, BLOCK_RT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    mla_absorb_task(tl.program_id(0), tl.program_id(1), q_ptr, kv_b_ptr, q_lat_ptr, stride_qh, stride_wb, stride_lh,
                    NOPE, V, R, BLOCK_NOPE, BLOCK_RT)


@triton.jit
def _mla_split_kernel(q_lat_ptr, q_ptr, cache_ptr, pos_ptr, o_part_ptr, lse_part_ptr, n_heads, max_len, window,
                      qk_scale, stride_lh, stride_qh, stride_ct, stride_oph, stride_ops, stride_lseh,
                      NOPE: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    mla_split_task(tl.program_id(0), tl.program_id(1), q_lat_ptr, q_ptr, cache_ptr, pos_ptr, o_part_ptr,
                   lse_part_ptr, n_heads, max_len, window, qk_scale, stride_lh, stride_qh, stride_ct, stride_oph,
                   stride_ops, stride_lseh, NOPE, ROPE, R, NUM_SPLITS, HAS_WINDOW, DOT_DTYPE, DOT_PREC,
                   BLOCK_H, BLOCK_N, BLOCK_R, BLOCK_P)


@triton.jit
def _mla_combine_up_kernel(pos_ptr, kv_b_ptr, out_ptr, o_part_ptr, lse_part_ptr, max_len, window,
                           stride_wb, stride_oh, stride_oph, stride_ops, stride_lseh,
                           NOPE: tl.constexpr, V: tl.constexpr, R: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           HAS_WINDOW: tl.constexpr, SPLIT_BLOCK_N: tl.constexpr,
                           BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                           PDL: tl.constexpr = False):
    pdl_begin(PDL)
    mla_combine_up_task(tl.program_id(0), tl.program_id(1), pos_ptr, kv_b_ptr, out_ptr, o_part_ptr, lse_part_ptr,
                        max_len, window, stride_wb, stride_oh, stride_oph, stride_ops, stride_lseh,
                        NOPE, V, R, NUM_SPLITS, HAS_WINDOW, SPLIT_BLOCK_N, BLOCK_S, BLOCK_R, BLOCK_V)


# ---- launchers ---------------------------------------------------------------------------------------------------

def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4                       # the interpreter: a few splits, so CPU tests still exercise the combine


def default_num_splits(units: int, max_len: int, device, block_n: int = 64, min_chunk: int = 256) -> int:
    """Splits per (kv head | head tile): about two programs per SM at full length, chunks of >= min_chunk keys.

    Chosen from max_len (host-known), not the live length: the chunk size adapts to the length on the device.
    """
    want = max(1, (2 * _num_sms(torch.device(device)) + units - 1) // units)
    return max(1, min(want, triton.cdiv(max_len, max(min_chunk, block_n))))


def _check_pos(pos: torch.Tensor, device):
    if pos.dtype != torch.int32 or pos.numel() != 1 or pos.device != device:
        raise ValueError(f"pos must be a device int32 tensor with one element on {device}, got "
                         f"{pos.dtype} {tuple(pos.shape)} on {pos.device}")


def _dot_dtype(cache_dtype: torch.dtype):
    return tl.float32 if _INTERPRET else _TL_DTYPE[cache_dtype]


def _dot_prec(cache_dtype: torch.dtype) -> str:
    # an fp32 cache gets true fp32 products (not tf32): it exists for exactness, not speed
    return "ieee" if cache_dtype == torch.float32 else "tf32"


def gqa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor, *,
               softmax_scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
               num_splits: int | None = None, out: torch.Tensor | None = None, block_n: int = 64,
               num_warps: int = 4, out_x8: bool = False) -> torch.Tensor:
    """q [Hq, Dh] (rotated), k_cache / v_cache [max_len, Hkv, Dh], pos device int32 [1] -> out [Hq, Dh] (q's dtype).

    window: sliding window (key j visible iff pos - window < j <= pos); sinks [Hq] (gpt-oss). Launches only.
    out_x8: out is the flat [Hq * Dh] output as fp32 [8, Hq * Dh / 8] in the x8 layout, what an fp4 o_proj reads
    (gemv(None, w_o, x8=out, ...)): no prepare_x8 launch between the two.
    """
    return _gqa(q, k_cache, v_cache, pos, softmax_scale, window, sinks, num_splits, out, block_n, num_warps,
                out_x8=out_x8)


def rope_gqa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, softmax_scale: float,
                    style: str = "half", qk_norm: str | None = None, q_norm: torch.Tensor | None = None,
                    k_norm: torch.Tensor | None = None, eps: float = 1e-6, clip_qkv: float | None = None,
                    window: int | None = None, sinks: torch.Tensor | None = None, num_splits: int | None = None,
                    out: torch.Tensor | None = None, block_n: int = 64, num_warps: int = 4,
                    out_x8: bool = False) -> torch.Tensor:
    """rope_append(q, k, v -> cache[pos]) then gqa_decode, as one split launch (+ the combine when split): the
    same outputs and cache rows, q and k left unrotated in their buffers. Arguments as the two functions';
    qk_norm "full" (OLMoE) is refused: it needs every head in one program (use the two launches)."""
    norm = check_rope_args(q, k, v, k_cache, v_cache, pos, cos, sin, qk_norm, q_norm, k_norm)
    if norm == NORM_FULL:
        raise ValueError("rope_gqa_decode: qk_norm 'full' normalises over all heads at once; use rope_append + "
                         "gqa_decode")
    fused = dict(k=k, v=v, cos=cos, sin=sin, q_norm=q_norm if norm else q, k_norm=k_norm if norm else k,
                 eps=float(eps), clip=float(clip_qkv or 0.0), ROT=2 * cos.shape[1], PAIR=_style_pair(style),
                 NORM=norm, CLIP=clip_qkv is not None)
    return _gqa(q, k_cache, v_cache, pos, softmax_scale, window, sinks, num_splits, out, block_n, num_warps, fused,
                out_x8)


def _gqa(q, k_cache, v_cache, pos, softmax_scale, window, sinks, num_splits, out, block_n, num_warps, fused=None,
         out_x8=False):
    """gqa_decode's checks and launches; `fused` (rope_gqa_decode): the split launch norms, rotates and appends."""
    if q.dim() != 2 or k_cache.dim() != 3:
        raise ValueError(f"q must be [Hq, Dh] and k_cache [max_len, Hkv, Dh], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}")
    Hq, Dh = q.shape
    max_len, Hkv, Dh_k = k_cache.shape
    dev = q.device
    if Dh_k != Dh or Hkv == 0 or Hq % Hkv:
        raise ValueError(f"k_cache [max_len, Hkv, Dh] = {tuple(k_cache.shape)} does not fit q {tuple(q.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache: expected {tuple(k_cache.shape)} {k_cache.dtype}, got {tuple(v_cache.shape)} "
                         f"{v_cache.dtype}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != dev or t.stride(-1) != 1:
            raise ValueError(f"{name}: must be on {dev} with a contiguous last dim")
    _check_pos(pos, dev)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if sinks is not None and (tuple(sinks.shape) != (Hq,) or not sinks.is_contiguous() or sinks.device != dev):
        raise ValueError(f"sinks: expected a contiguous [{Hq}] tensor on {dev}, got {tuple(sinks.shape)}")
    x8 = Hq * Dh // 8 if out_x8 else 0
    if out_x8 and (Hq * Dh) % 8:
        raise ValueError(f"out_x8: Hq * Dh = {Hq * Dh} is not a multiple of 8")
    if out_x8 and out is None:
        out = torch.empty(8, x8, device=dev, dtype=torch.float32)
    elif out_x8 and (tuple(out.shape) != (8, x8) or out.dtype != torch.float32 or not out.is_contiguous()
                     or out.device != dev):
        raise ValueError(f"out: with out_x8 a contiguous fp32 [8, {x8}] on {dev}, got {out.dtype} {tuple(out.shape)}")
    elif out is None:
        out = torch.empty_like(q)
    elif not out_x8 and (tuple(out.shape) != (Hq, Dh) or out.stride(-1) != 1 or out.device != dev):
        raise ValueError(f"out: expected [{Hq}, {Dh}] on {dev}, got {tuple(out.shape)}")
    span = min(max_len, window) if window is not None else max_len
    S = num_splits or default_num_splits(Hkv, span, dev, block_n)
    rep = Hq // Hkv
    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    if S > 1:
        o_part = torch.empty(Hq, S, Dh, device=dev, dtype=torch.float32)
        lse_part = torch.empty(Hq, S, device=dev, dtype=torch.float32)
    else:
        o_part = lse_part = out                     # unused
    sk = sinks if sinks is not None else q
    common = dict(HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None)
    tiles = dict(DH=Dh, REP=rep, NUM_SPLITS=S, DOT_DTYPE=_dot_dtype(k_cache.dtype), DOT_PREC=_dot_prec(k_cache.dtype),
                 BLOCK_R=max(16, triton.next_power_of_2(rep)), BLOCK_N=block_n, BLOCK_D=BLOCK_D, X8=x8,
                 num_warps=num_warps)
    part_strides = (out.stride(0), o_part.stride(0), o_part.stride(1) if S > 1 else 0, lse_part.stride(0))
    if fused is None:
        _gqa_split_kernel[(Hkv, S)](
            q, k_cache, v_cache, pos, sk, out, o_part, lse_part, max_len, int(window or 0), softmax_scale * LOG2E,
            q.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), *part_strides,
            **tiles, **common, **launch_kw(dev))
    else:
        f = fused
        _rope_gqa_split_kernel[(Hkv, S)](
            q, f["k"], f["v"], k_cache, v_cache, pos, f["cos"], f["sin"], f["q_norm"], f["k_norm"], sk, out, o_part,
            lse_part, max_len, int(window or 0), softmax_scale * LOG2E, f["eps"], f["clip"],
            q.stride(0), f["k"].stride(0), f["v"].stride(0), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), f["cos"].stride(0), *part_strides,
            ROT=f["ROT"], PAIR=f["PAIR"], NORM=f["NORM"], CLIP=f["CLIP"], **tiles, **common, **launch_kw(dev))
    if S > 1:
        _gqa_combine_kernel[(Hq,)](
            pos, sk, out, o_part, lse_part, max_len, int(window or 0),
            out.stride(0), o_part.stride(0), o_part.stride(1), lse_part.stride(0),
            DH=Dh, NUM_SPLITS=S, SPLIT_BLOCK_N=block_n, BLOCK_S=triton.next_power_of_2(S), BLOCK_D=BLOCK_D,
            X8=x8, num_warps=1, **common, **launch_kw(dev))
    return out


def mla_decode(q: torch.Tensor, cache: torch.Tensor, kv_b: torch.Tensor, pos: torch.Tensor, *, nope: int,
               v_head_dim: int, softmax_scale: float, window: int | None = None, num_splits: int | None = None,
               out: torch.Tensor | None = None, block_h: int = 16, block_n: int = 32,
               num_warps: int = 4) -> torch.Tensor:
    """MLA absorbed decode. q [H, nope + rope] (rope part rotated), cache [max_len, r + rope], kv_b
    [H*(nope+v), r] -> out [H, v] (q's dtype): the input of o_proj. Launches only (three kernels)."""
    if q.dim() != 2 or q.shape[1] <= nope or cache.dim() != 2 or kv_b.dim() != 2:
        raise ValueError(f"q must be [H, nope+rope] (nope={nope}), cache [max_len, r+rope], kv_b [H*(nope+v), r]; "
                         f"got {tuple(q.shape)}, {tuple(cache.shape)}, {tuple(kv_b.shape)}")
    H, rope = q.shape[0], q.shape[1] - nope
    max_len, r = cache.shape[0], cache.shape[1] - rope
    V = v_head_dim
    dev = q.device
    if r < 1 or tuple(kv_b.shape) != (H * (nope + V), r):
        raise ValueError(f"kv_b: expected [{H * (nope + V)}, {r}] for H={H}, nope={nope}, v={V}, r={r}, "
                         f"got {tuple(kv_b.shape)}")
    for name, t in (("q", q), ("cache", cache), ("kv_b", kv_b)):
        if t.device != dev or t.stride(-1) != 1:
            raise ValueError(f"{name}: must be on {dev} with a contiguous last dim")
    _check_pos(pos, dev)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if out is None:
        out = torch.empty(H, V, device=dev, dtype=q.dtype)
    elif tuple(out.shape) != (H, V) or out.stride(-1) != 1 or out.device != dev:
        raise ValueError(f"out: expected [{H}, {V}] on {dev}, got {tuple(out.shape)}")
    block_h = max(16, triton.next_power_of_2(min(block_h, H)))
    tiles = triton.cdiv(H, block_h)
    span = min(max_len, window) if window is not None else max_len
    S = num_splits or default_num_splits(tiles, span, dev, block_n)
    BLOCK_R = max(16, triton.next_power_of_2(r))
    q_lat = torch.empty(H, r, device=dev, dtype=torch.float32)
    o_part = torch.empty(H, S, r, device=dev, dtype=torch.float32)
    lse_part = torch.empty(H, S, device=dev, dtype=torch.float32)
    BLOCK_RT = min(BLOCK_R, 64)
    _mla_absorb_kernel[(H, triton.cdiv(r, BLOCK_RT))](
        q, kv_b, q_lat, q.stride(0), kv_b.stride(0), q_lat.stride(0),
        NOPE=nope, V=V, R=r, BLOCK_NOPE=triton.next_power_of_2(nope), BLOCK_RT=BLOCK_RT, num_warps=4, **launch_kw(dev))
    _mla_split_kernel[(tiles, S)](
        q_lat, q, cache, pos, o_part, lse_part, H, max_len, int(window or 0), softmax_scale * LOG2E,
        q_lat.stride(0), q.stride(0), cache.stride(0), o_part.stride(0), o_part.stride(1), lse_part.stride(0),
        NOPE=nope, ROPE=rope, R=r, NUM_SPLITS=S, HAS_WINDOW=window is not None, DOT_DTYPE=_dot_dtype(cache.dtype),
        DOT_PREC=_dot_prec(cache.dtype),
        BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=BLOCK_R, BLOCK_P=max(16, triton.next_power_of_2(rope)),
        num_warps=num_warps, **launch_kw(dev))
    BLOCK_V = min(64, triton.next_power_of_2(V))
    _mla_combine_up_kernel[(H, triton.cdiv(V, BLOCK_V))](
        pos, kv_b, out, o_part, lse_part, max_len, int(window or 0),
        kv_b.stride(0), out.stride(0), o_part.stride(0), o_part.stride(1), lse_part.stride(0),
        NOPE=nope, V=V, R=r, NUM_SPLITS=S, HAS_WINDOW=window is not None, SPLIT_BLOCK_N=block_n,
        BLOCK_S=triton.next_power_of_2(S), BLOCK_R=BLOCK_R, BLOCK_V=BLOCK_V, num_warps=8, **launch_kw(dev))
    return out


# ---- references: models/reference.py's own attention, fed from the cache ----------------------------------------

def gqa_decode_ref(q, k_cache, v_cache, pos: int, *, softmax_scale: float, window=None, sinks=None) -> torch.Tensor:
    """ReferenceDecoder._attend for the query at `pos` over cache[:pos+1] -> [Hq, Dh] in q's dtype."""
    Hq, Dh = q.shape
    rep = Hq // k_cache.shape[1]
    k = k_cache[:pos + 1].repeat_interleave(rep, 1)
    v = v_cache[:pos + 1].repeat_interleave(rep, 1)
    a = SimpleNamespace(softmax_scale=softmax_scale)
    out = ReferenceDecoder._attend(None, a, q[None], k.to(q.dtype), v.to(q.dtype), window, sinks, pos)
    return out.view(Hq, Dh)


def mla_decode_ref(q, cache, kv_b, pos: int, *, nope: int, v_head_dim: int, softmax_scale: float,
                   window=None) -> torch.Tensor:
    """The reference's non-absorbed MLA (expand latent through kv_b, then attend) -> [H, v] in q's dtype."""
    H, rope = q.shape[0], q.shape[1] - nope
    r = cache.shape[1] - rope
    latent, k_pe = cache[:pos + 1, :r].to(q.dtype), cache[:pos + 1, r:].to(q.dtype)
    T = latent.shape[0]
    kvb = torch.nn.functional.linear(latent, kv_b.to(q.dtype)).view(T, H, nope + v_head_dim)
    k = torch.cat([kvb[..., :nope], k_pe[:, None, :].expand(T, H, rope)], dim=-1)
    a = SimpleNamespace(softmax_scale=softmax_scale)
    out = ReferenceDecoder._attend(None, a, q[None], k, kvb[..., nope:], window, None, pos)
    return out.view(H, v_head_dim)


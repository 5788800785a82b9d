"""Device functions of the monokernel's non-GEMV tasks (GEMV streaming: stream.py): decode attention per kv head
with RoPE + KV append, the attention-split combine, MoE routing (top-k recomputed from the router logits by each
consumer: no extra phase), the sampler's reduction over LM-head tiles, the next step's embedding row.

Activations are fp32 end to end (a few KB; bandwidth is all weights), weights any float dtype of the arena.
Reads of data other programs wrote use `.cg` (L2, never a stale L1 line). PyTorch references: every op is one
line of models/reference.py; the tests compare whole decode steps against ReferenceDecoder.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kie_moe.kccl.sync import clock64

from .plan import env_flag
from .stream import rstd, x_chunk


# ---- MoE routing ---------------------------------------------------------------------------------------------------

# The router inside o_proj (plan.route_in_o): fixed-point scales of the int64 accumulator [E logits, sum(x^2)].
# A partial p (fp32) times 2^32 is an integer already when |p| >= 2^-8 (24-bit mantissa), so the accumulator holds
# the exact sum of the tasks' fp32 partials (truncation below 2^-32 otherwise) in any order of arrival; it overflows
# past |sum| 2^31 (logits before the norm scale) / 2^43 (sum of squares), far beyond activations of real models.
RACC_LG_SCALE = tl.constexpr(4294967296.0)
RACC_SS_SCALE = tl.constexpr(1048576.0)


@triton.jit
def route_partial(x_ptr, nw_ptr, wr_ptr, racc_ptr, r0, nr, D: tl.constexpr, E: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_RO: tl.constexpr, XM_OFF: tl.constexpr = 0):
    """An o_proj task's share of the router: x rows [r0, r0 + nr) are final (this task wrote them). Adds
    W_r[:, rows] (nw * x)[rows] [E] and sum(x[rows]^2) into racc (int64 [E + 1], fixed point as above).
    wr_ptr: the router's [E, D] rows (float arena), nw_ptr: the MoE block's RMSNorm weight. XM_OFF > 0: also
    copies the rows to x_ptr + XM_OFF, the experts' input while their fused down adds into x (fused_down.py)."""
    offs_r = tl.arange(0, BLOCK_RO)
    rm = offs_r < nr
    x = tl.load(x_ptr + r0 + offs_r, mask=rm, other=0.0, cache_modifier=".cg")
    if XM_OFF > 0:
        tl.store(x_ptr + XM_OFF + r0 + offs_r, x, mask=rm)
    xn = x * tl.load(nw_ptr + r0 + offs_r, mask=rm, other=0.0).to(tl.float32)
    offs_e = tl.arange(0, BLOCK_E)
    em = offs_e < E
    w = tl.load(wr_ptr + offs_e[:, None] * D + (r0 + offs_r)[None, :], mask=em[:, None] & rm[None, :],
                other=0.0).to(tl.float32)
    p = tl.sum(w * xn[None, :], axis=1)                                  # [BLOCK_E]
    tl.atomic_add(racc_ptr + offs_e, (p * RACC_LG_SCALE).to(tl.int64), mask=em, sem="relaxed")
    tl.atomic_add(racc_ptr + E, (tl.sum(x * x, axis=0) * RACC_SS_SCALE).to(tl.int64), sem="relaxed")


@triton.jit
def route_acc_logits(racc_ptr, rb_ptr, eps, D: tl.constexpr, E: tl.constexpr, HAS_RBIAS: tl.constexpr,
                     BLOCK_E: tl.constexpr):
    """The router's logits [BLOCK_E] fp32 (-inf past E) from a layer's accumulator once every o_proj task added its
    share: W_r (nw * x) / rms(x) (+ the router bias), as the router tasks' RMSNorm -> GEMV."""
    offs_e = tl.arange(0, BLOCK_E)
    em = offs_e < E
    acc = tl.load(racc_ptr + offs_e, mask=em, other=0, cache_modifier=".cg")
    ss = tl.load(racc_ptr + E, cache_modifier=".cg").to(tl.float32) / RACC_SS_SCALE
    lg = acc.to(tl.float32) / RACC_LG_SCALE * (1.0 / tl.sqrt(ss / D + eps))
    if HAS_RBIAS:
        lg += tl.load(rb_ptr + offs_e, mask=em, other=0.0).to(tl.float32)
    return tl.where(em, lg, -float("inf"))


@triton.jit
def route_acc_zero(racc_ptr, E: tl.constexpr, BLOCK_E: tl.constexpr):
    """A layer's accumulator [E + 1] back to zero once every expert task of its step has read it."""
    offs_e = tl.arange(0, BLOCK_E)
    tl.store(racc_ptr + offs_e, tl.zeros((BLOCK_E,), tl.int64), mask=offs_e < E)
    tl.store(racc_ptr + E, tl.zeros((), tl.int64))


@triton.jit
def load_logits(rlog_ptr, E: tl.constexpr, BLOCK_E: tl.constexpr):
    """The router tasks' logits [BLOCK_E] fp32 (written by other programs: from L2; -inf past E)."""
    offs_e = tl.arange(0, BLOCK_E)
    return tl.load(rlog_ptr + offs_e, mask=offs_e < E, other=-float("inf"), cache_modifier=".cg")


@triton.jit
def route(rlog_ptr, sbias_ptr, route_scale, E: tl.constexpr, TOPK: tl.constexpr, SCORING: tl.constexpr,
          NORM_TOPK: tl.constexpr, HAS_SBIAS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
          NG: tl.constexpr = 1, TG: tl.constexpr = 1, GSCORE: tl.constexpr = 0, BLOCK_G: tl.constexpr = 1,
          MERGE: tl.constexpr = False):
    """Router logits [E] -> (expert ids [BLOCK_TOPK] int32, weights [BLOCK_TOPK] fp32), as models.reference.route:
    softmax / sigmoid scores (+ correction bias for the choice only), group-limited choice (DeepSeek: NG groups
    scored by their max, GSCORE 1: by their top-2 sum; only the TG best groups compete), top-k (first index
    wins ties), optional renormalisation, routed scaling; SCORING 2 (gpt-oss): softmax over the top-k logits."""
    return route_lg(load_logits(rlog_ptr, E, BLOCK_E), sbias_ptr, route_scale, E, TOPK, SCORING, NORM_TOPK,
                    HAS_SBIAS, BLOCK_E, BLOCK_TOPK, NG, TG, GSCORE, BLOCK_G, MERGE)


@triton.jit
def _better(av, ai, bv, bi):
    """(value, id) a before b in the top-k's order: the larger value, the lower id on a tie (argmax's rule)."""
    return (av > bv) | ((av == bv) & (ai < bi))


@triton.jit
def _top4_combine(a1, i1, a2, i2, a3, i3, a4, i4, b1, j1, b2, j2, b3, j3, b4, j4):
    """The top 4 of two lists of 4 sorted in _better's order: the better of a_k and b_(5-k) (a V-shaped, so bitonic,
    sequence holding the top 4), then a 4-wide bitonic merge ((1, 3), (2, 4); (1, 2), (3, 4))."""
    c = _better(a1, i1, b4, j4)
    t1v, t1i = tl.where(c, a1, b4), tl.where(c, i1, j4)
    c = _better(a2, i2, b3, j3)
    t2v, t2i = tl.where(c, a2, b3), tl.where(c, i2, j3)
    c = _better(a3, i3, b2, j2)
    t3v, t3i = tl.where(c, a3, b2), tl.where(c, i3, j2)
    c = _better(a4, i4, b1, j1)
    t4v, t4i = tl.where(c, a4, b1), tl.where(c, i4, j1)
    c = _better(t1v, t1i, t3v, t3i)
    u1v, u1i, u3v, u3i = tl.where(c, t1v, t3v), tl.where(c, t1i, t3i), tl.where(c, t3v, t1v), tl.where(c, t3i, t1i)
    c = _better(t2v, t2i, t4v, t4i)
    u2v, u2i, u4v, u4i = tl.where(c, t2v, t4v), tl.where(c, t2i, t4i), tl.where(c, t4v, t2v), tl.where(c, t4i, t2i)
    c = _better(u1v, u1i, u2v, u2i)
    r1v, r1i, r2v, r2i = tl.where(c, u1v, u2v), tl.where(c, u1i, u2i), tl.where(c, u2v, u1v), tl.where(c, u2i, u1i)
    c = _better(u3v, u3i, u4v, u4i)
    r3v, r3i, r4v, r4i = tl.where(c, u3v, u4v), tl.where(c, u3i, u4i), tl.where(c, u4v, u3v), tl.where(c, u4i, u3i)
    return r1v, r1i, r2v, r2i, r3v, r3i, r4v, r4i


@triton.jit
def _top4(choice, offs_e, BLOCK_E: tl.constexpr):
    """The 4 best (value, id) of choice [BLOCK_E] in _better's order, as uniform scalars: one block reduction whose
    elements are lists of 4 (an element starts as itself, then 3 (-inf, 2^30) fillers that lose every tie)."""
    ninf = tl.full((BLOCK_E,), -float("inf"), tl.float32)
    big = tl.full((BLOCK_E,), 1 << 30, tl.int32)
    return tl.reduce((choice, offs_e, ninf, big, ninf, big, ninf, big), 0, _top4_combine)


@triton.jit
def route_lg(lg, sbias_ptr, route_scale, E: tl.constexpr, TOPK: tl.constexpr, SCORING: tl.constexpr,
             NORM_TOPK: tl.constexpr, HAS_SBIAS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
             NG: tl.constexpr = 1, TG: tl.constexpr = 1, GSCORE: tl.constexpr = 0, BLOCK_G: tl.constexpr = 1,
             MERGE: tl.constexpr = False):
    """route() from logits lg [BLOCK_E] fp32 in registers (-inf past E).
    A block-wide reduction costs ~0.2 us (8 warps: shuffles, shared memory, barriers), so the top-k takes as few as
    it can: one max-with-index per slot where the choice is the score (no correction bias), and for a softmax
    renormalised over the top-k without groups (qwen3, Mixtral, OLMoE) no softmax over all E: the top-k of the
    logits is the top-k of their softmax, and the renormalised weights are the softmax of the k chosen logits (10
    reductions for qwen3's top-8 instead of 19). MERGE (KIE_TOPK_MERGE, no correction bias): 4 slots per block
    reduction (_top4: its elements are sorted lists of 4), the weights from the chosen values as scalars: qwen3's top-8
    in 2 reductions."""
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    TOPK_SOFTMAX: tl.constexpr = SCORING == 2 or (SCORING == 0 and NORM_TOPK and not HAS_SBIAS and NG == 1)
    if TOPK_SOFTMAX:
        scores = lg
    elif SCORING == 0:
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
    if NG > 1:
        gid = offs_e // (E // NG)
        offs_g = tl.arange(0, BLOCK_G)
        gsc = tl.full((BLOCK_G,), -float("inf"), dtype=tl.float32)
        for gi in tl.static_range(NG):
            cg = tl.where(gid == gi, choice, -float("inf"))
            top = tl.max(cg, axis=0)
            if GSCORE:
                top += tl.max(tl.where(offs_e == tl.argmax(cg, axis=0), -float("inf"), cg), axis=0)
            gsc = tl.where(offs_g == gi, top, gsc)
        keep = tl.zeros((BLOCK_G,), dtype=tl.int32)
        for _ in tl.static_range(TG):
            b = tl.argmax(gsc, axis=0)
            keep = tl.where(offs_g == b, 1, keep)
            gsc = tl.where(offs_g == b, -float("inf"), gsc)
        ekeep = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for gi in tl.static_range(NG):
            ekeep = tl.where(gid == gi, tl.sum(tl.where(offs_g == gi, keep, 0), axis=0), ekeep)
        choice = tl.where(ekeep > 0, choice, -float("inf"))
    offs_j = tl.arange(0, BLOCK_TOPK)
    j_mask = offs_j < TOPK
    ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)
    vals = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    if MERGE and not HAS_SBIAS:
        # rounds of 4 slots; the first slot of round 0 holds the largest value (the softmax's shift), and the
        # weights' sums run over the chosen values as scalars (no reduction over the [BLOCK_TOPK] vectors)
        tot = 0.0
        vmax = 0.0
        for rnd in tl.static_range((TOPK + 3) // 4):
            top = _top4(choice, offs_e, BLOCK_E)
            if rnd == 0:
                vmax = top[0]
            for k in tl.static_range(4):
                if rnd * 4 + k < TOPK:
                    v = top[2 * k]
                    i = top[2 * k + 1]
                    if TOPK_SOFTMAX:
                        v = tl.exp(v - vmax)
                    tot += v
                    ids = tl.where(offs_j == rnd * 4 + k, i, ids)
                    vals = tl.where(offs_j == rnd * 4 + k, v, vals)
                    choice = tl.where(offs_e == i, -float("inf"), choice)
    else:
        for j in tl.static_range(TOPK):
            if HAS_SBIAS:   # the choice is score + bias: the score needs a second reduction
                best = tl.argmax(choice, axis=0)
                v = tl.sum(tl.where(offs_e == best, scores, 0.0), axis=0)
            else:           # the choice is the score (the first index wins ties, as argmax)
                v, best = tl.max(choice, axis=0, return_indices=True, return_indices_tie_break_left=True)
            ids = tl.where(offs_j == j, best, ids)
            vals = tl.where(offs_j == j, v, vals)
            choice = tl.where(offs_e == best, -float("inf"), choice)
        if TOPK_SOFTMAX:   # vals -> exp(vals - max), as MERGE leaves them
            vals = tl.where(j_mask, tl.exp(vals - tl.max(tl.where(j_mask, vals, -float("inf")), axis=0)), 0.0)
        tot = 0.0
        if TOPK_SOFTMAX or NORM_TOPK:
            tot = tl.sum(tl.where(j_mask, vals, 0.0), axis=0)
    # the weights from the chosen values and their sum tot
    if TOPK_SOFTMAX:
        w = vals / tot
        if SCORING == 0:
            w = w * route_scale
    else:
        w = vals
        if NORM_TOPK:
            w = w / (tot + (1e-20 if SCORING == 1 else 0.0))
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
def _kv_block(k_cache, v_cache, t0, hi, ia, ib, ic, h_mask, c_mask, offs_d, d_mask, DH: tl.constexpr,
              ROT: tl.constexpr, BLOCK_T: tl.constexpr):
    """Cache rows [t0, t0 + BLOCK_T) below hi: K's rotated halves, its unrotated part (ROT < DH; else K's first
    half again, unused) and V, as stored (masked to nothing past hi: a look-ahead costs no traffic)."""
    offs_t = t0 + tl.arange(0, BLOCK_T)
    t_mask = offs_t < hi
    kp = k_cache + offs_t[:, None] * DH
    ta = tl.load(kp + ia[None, :], mask=t_mask[:, None] & h_mask[None, :], other=0.0, cache_modifier=".cg")
    tb = tl.load(kp + ib[None, :], mask=t_mask[:, None] & h_mask[None, :], other=0.0, cache_modifier=".cg")
    tc = ta
    if ROT < DH:
        tc = tl.load(kp + ic[None, :], mask=t_mask[:, None] & c_mask[None, :], other=0.0, cache_modifier=".cg")
    vt = tl.load(v_cache + offs_t[:, None] * DH + offs_d[None, :], mask=t_mask[:, None] & d_mask[None, :],
                 other=0.0, cache_modifier=".cg")
    return ta, tb, tc, vt


@triton.jit
def kv_split_range(pos, window, n_splits, sp):
    """[lo, hi): the cached positions split `sp` of `n_splits` reads at step `pos` (window > 0: only the last
    `window` positions, the current one included, are visible); the current token itself is not in the range."""
    start = 0
    if window > 0:
        start = tl.maximum(pos - window + 1, 0)
    chunk = (pos - start + n_splits - 1) // n_splits
    lo = start + sp * chunk
    hi = tl.minimum(lo + chunk, pos)
    return lo, hi


@triton.jit
def _dot16(a, b, EMU: tl.constexpr):
    """a @ b of 16-bit operands on the tensor cores. EMU (under the interpreter: not USE_ASM): Triton 3.6's
    interpreter multiplies bf16 tl.dot operands as their raw bits (fp16 works), so the same products run as fp32
    dots of the rounded values there (each product exact in fp32 either way)."""
    if EMU:
        y = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        y = tl.dot(a, b)
    return y


@triton.jit
def _split16(a, W: tl.constexpr):
    """fp32 a -> (hi, lo) in the 16-bit dtype W, hi + lo = a to ~2 x W's mantissa bits."""
    hi = a.to(W)
    return hi, (a - hi.to(tl.float32)).to(W)


@triton.jit
def _dot(a, b, TRANS_B: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    """a [M, K] fp32 @ b [K, N] (TRANS_B: b given as [N, K]; fp32 or the KV cache's bf16 / fp16) -> fp32 [M, N].
    PREC "ieee" / "tf32x3" / "tf32": tl.dot of the fp32 operands at that input precision. "bf16x2": 16-bit tensor
    core products of a split into hi + lo of b's dtype (2 mma, b exact: a 16-bit cache loses nothing; ~16 bits of a
    for bf16, ~22 for fp16), or for an fp32 b both split into bf16 pairs (3 mma: hi.hi + hi.lo + lo.hi)."""
    if TRANS_B:
        b = tl.trans(b)
    if PREC == "bf16x2":
        if b.dtype == tl.float32:
            ah, al = _split16(a, tl.bfloat16)
            bh, bl = _split16(b, tl.bfloat16)
            y = _dot16(ah, bh, EMU) + _dot16(ah, bl, EMU) + _dot16(al, bh, EMU)
        else:
            ah, al = _split16(a, b.dtype)
            y = _dot16(ah, b, EMU) + _dot16(al, b, EMU)
    elif PREC == "bf16":
        if b.dtype == tl.float32:
            y = _dot16(a.to(tl.bfloat16), b.to(tl.bfloat16), EMU)
        else:
            y = _dot16(a.to(b.dtype), b, EMU)
    else:
        y = tl.dot(a, b.to(tl.float32), input_precision=PREC)
    return y


# The attention task is a called function (Triton's noinline), not inlined into the monokernel's one body: ptxas gives
# that body the registers of its hungriest path, and inlined, attention's bf16x2 code made every other op's code
# spill (qwen3-30b-a3b fp8 sm_90: 96 B of stack, 48 spill instructions -> none); qwen3 fp8 +9.5% at 32 positions,
# +12% at 8K, H100 (NOTES.md session 36). KIE_ATTN_NOINLINE=0 inlines it (read at import: one build per process).
@triton.jit(noinline=env_flag("KIE_ATTN_NOINLINE", True))
def attention_task(g, sp, n_splits, pos, lo, hi, qkv_ptr, k_cache, v_cache, cos_ptr, sin_ptr,
                   qn_ptr, kn_ptr, ao_ptr, am_ptr, al_ptr, acnt_ptr, sink_ptr, eps, sm_scale, clip, tr, trace_on,
                   HQ: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, ROT: tl.constexpr,
                   ROPE_PAIR: tl.constexpr, QK_NORM: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_SINKS: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_QG: tl.constexpr, NT: tl.constexpr,
                   STAMP: tl.constexpr = False, PREC: tl.constexpr = "ieee", USE_ASM: tl.constexpr = True):
    """One kv head `g`, split `sp` of `n_splits`: its REP query heads against cached keys [lo, hi), this split's
    share of the visible window (kv_split_range, computed once by the caller);
    split 0 also takes the current token (and appends its k, v to the cache at
    `pos`). Writes unnormalised partials: m [REP], l [REP], o [REP, DH] at split `sp`; the last of the head's
    splits to finish (acnt_ptr: this layer's and head's counter, zeroed per launch, + n_splits per step) combines
    them into split 0's row of ao, so the o_proj reads a plain vector. k_cache / v_cache: this layer's and head's
    [T_max, DH] rows. Every BLOCK_* that is a tl.dot dimension (R, H, C, D, T) is >= 16 (runtime pads them;
    masks keep the padding out). STAMP (trace mode): clock64 into tr[7] when the K/V loop starts, so the trace can
    split the task's work into what comes before the loop and the loop + combine (trace.py, `pre us`).
    PREC: the tl.dot precision of the scores and p.V: "ieee" (fp32 FMAs), "tf32x3" (tensor cores, three tf32
    products per fp32 one: ~fp32 accuracy; K / V, stored in bf16 / fp16 / fp32, lose nothing to their split) or
    "tf32" (one product: 10-bit operands, for timing only), "bf16x2" (_dot: q and p split into two 16-bit halves
    against the 16-bit cache as stored, 2 products) or "bf16" (one product: q and p rounded to the cache's dtype,
    the graph backend's attention precision; USE_ASM False, the interpreter: the 16-bit products emulated in fp32,
    _dot16). On an H100 an ieee block of 16 positions costs ~10,000
    cycles for its ~490 instructions (benchmarks/attention_task_micro.py; the FMA dots' dependent chains)."""
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
    # cached keys [lo, hi) were written by earlier steps: the first block's loads go out first and overlap the
    # q / k loads below.
    ta, tb, tc, vt = _kv_block(k_cache, v_cache, lo, hi, ia, ib, ic, h_mask, c_mask, offs_d, d_mask, DH, ROT,
                               BLOCK_T)
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

    if STAMP:
        if trace_on:
            tl.store(tr + 7, clock64())
    # Scores and p.V are fp32 tl.dot tiles (ieee: FMA products, exact as the reference; [REP, T, Dh] broadcast
    # products would need 16K+ registers' worth of fp32 per block and spill); block i + 1's loads are in flight
    # while block i's math runs (one round trip per split instead of one per block).
    for t0 in range(lo, hi, BLOCK_T):
        na, nb, nc, nv = _kv_block(k_cache, v_cache, t0 + BLOCK_T, hi, ia, ib, ic, h_mask, c_mask, offs_d, d_mask,
                                   DH, ROT, BLOCK_T)
        t_mask = t0 + tl.arange(0, BLOCK_T) < hi
        s = _dot(qa, ta, True, PREC, not USE_ASM) + _dot(qb, tb, True, PREC, not USE_ASM)       # [R, T]
        if ROT < DH:   # the heads' unrotated columns
            s += _dot(qc, tc, True, PREC, not USE_ASM)
        s = tl.where(t_mask[None, :], s * sm_scale, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None]) * t_mask[None, :].to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p, vt, False, PREC, not USE_ASM)
        m_i = m_new
        ta, tb, tc, vt = na, nb, nc, nv
    tl.store(am_ptr + sp * HQ + heads, m_i, mask=r_mask)
    tl.store(al_ptr + sp * HQ + heads, l_i, mask=r_mask)
    tl.store(ao_ptr + sp * HQ * DH + heads[:, None] * DH + offs_d[None, :], acc,
             mask=r_mask[:, None] & d_mask[None, :])
    tl.debug_barrier()   # every thread's partial stores before the acq_rel count (the CUTLASS semaphore pattern)
    done = tl.atomic_add(acnt_ptr, 1, sem="acq_rel", scope="gpu")
    if done % n_splits == n_splits - 1:
        head_combine(ao_ptr, am_ptr, al_ptr, sink_ptr, n_splits, g, HQ, DH, REP, HAS_SINKS, BLOCK_QG, NT)


@triton.jit
def head_combine(ao_ptr, am_ptr, al_ptr, sink_ptr, n_splits, g, HQ: tl.constexpr, DH: tl.constexpr,
                 REP: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_QG: tl.constexpr, NT: tl.constexpr):
    """kv head g's splits -> softmax(QK^T) V of its REP query heads [REP * DH], written over split 0's partial
    (ao row 0, where the o_proj reads it). SC splits per round trip ([SC, BLOCK_QG] loads, rescaled online; about
    4 elements per thread and tensor: more spills the whole kernel); the sink logit of a head joins the
    denominator only (gpt-oss). NT: threads per program."""
    N: tl.constexpr = HQ * DH
    SC: tl.constexpr = (4 * NT) // BLOCK_QG if BLOCK_QG < 4 * NT else 1
    offs_s = tl.arange(0, SC)
    c = tl.arange(0, BLOCK_QG)
    c_mask = c < REP * DH
    h = g * REP + c // DH
    col = g * (REP * DH) + c
    m = tl.full((BLOCK_QG,), -1e30, dtype=tl.float32)
    num = tl.zeros((BLOCK_QG,), dtype=tl.float32)
    den = tl.zeros((BLOCK_QG,), dtype=tl.float32)
    for s0 in range(0, n_splits, SC):
        sp = s0 + offs_s
        msk = (sp < n_splits)[:, None] & c_mask[None, :]
        ms = tl.load(am_ptr + sp[:, None] * HQ + h[None, :], mask=msk, other=-1e30, cache_modifier=".cg")
        os_ = tl.load(ao_ptr + sp[:, None] * N + col[None, :], mask=msk, other=0.0, cache_modifier=".cg")
        ls = tl.load(al_ptr + sp[:, None] * HQ + h[None, :], mask=msk, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(ms, axis=0))
        a = tl.exp(m - m_new)
        f = tl.exp(ms - m_new[None, :])
        num = num * a + tl.sum(f * os_, axis=0)
        den = den * a + tl.sum(f * ls, axis=0)
        m = m_new
    if HAS_SINKS:
        den += tl.exp(tl.load(sink_ptr + h, mask=c_mask, other=0.0).to(tl.float32) - m)
    tl.store(ao_ptr + col, num / tl.where(c_mask, den, 1.0), mask=c_mask)   # (padding lanes: 0 / 0 otherwise)


# ---- LM head and sampling --------------------------------------------------------------------------------------------

@triton.jit
def pick_token(pv_ptr, pi_ptr, n_tiles, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr = 256):
    """Reduce the LM-head tiles' (max, argmax) partials -> token id (first tile wins ties: lowest id); -1 when a
    tile saw a NaN / +inf logit (its pv is +inf, so it wins, and its pi is -1: stream_gemv). Walks the
    [n_tiles] partials in CHUNK pieces with a running best: a [BLOCK_P] vector (2048 for a 151k vocab) held
    whole cost the sampler ~30 registers per thread, and it sets the register budget of the whole monokernel."""
    C: tl.constexpr = min(CHUNK, BLOCK_P)
    best_v = -float("inf")
    best_i = 0
    for c0 in range(0, n_tiles, C):
        offs = c0 + tl.arange(0, C)
        mask = offs < n_tiles
        pv = tl.load(pv_ptr + offs, mask=mask, other=-float("inf"), cache_modifier=".cg")
        pi = tl.load(pi_ptr + offs, mask=mask, other=0, cache_modifier=".cg")
        cm = tl.max(pv, axis=0)
        ci = tl.sum(tl.where(offs == tl.argmax(pv, axis=0) + c0, pi, 0), axis=0)
        better = cm > best_v   # strict: an earlier chunk keeps a tie
        best_i = tl.where(better, ci, best_i)
        best_v = tl.where(better, cm, best_v)
    return best_i


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

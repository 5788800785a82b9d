"""nvfp4 GEMV on the tensor cores: e2m1 codes decoded in registers straight into mma.sync A fragments.

Why: the CUDA-core nvfp4 tile (tiles.py) is issue-bound at ~61% of the read probe: each code needs its own fp32
convert and FFMA (~33 SASS instructions per u32 word of 8 codes). Here a word's 8 codes stay f16 (the byte-plane
decode of tiles.py: 7 integer ops + 4 byte permutes give four f16x2 registers), get their group scale with 4 exact
HMUL2, and the dot products run on `mma.sync.m16n8k16` with fp32 accumulation: ~17 instructions per word, and no
shared memory (a plain `tl.dot` stages its operands there and measured 2-3x slower: benchmarks/NOTES.md session 6).

Lane roles (one warp = 16 weight rows at a time; lane l has r = l // 4, q = l % 4):
- lane (r, q) holds rows `row_a = base + r` and `row_b = base + r + 8` as the mma's A rows r and r + 8, and for each
  256-code step of K 8 of the row's 32 words (two 16-byte pieces; the quad reads the whole 128-byte line) and their
  four nvfp4 group scales per row (group = 16 codes = two words: each mma pair step covers one group per lane);
- an mma sums, per A row, the 4 codes each quad lane puts in its fragment. A word's codes land as f16x2 pairs
  {e0, e2}, {e4, e6}, {e1, e3}, {e5, e7} (the byte-plane order), so the input is stored per 8 elements in the order
  0, 2, 1, 3, 4, 6, 5, 7 ("xh", fp16; prepare_xh) and every lane's B fragment is its own word's x: all 8 B columns
  are equal, D[r][c] is row r's running dot for every c, and each lane ends with the full sums of its two rows.
Exactness: the decode gives 2^-14 x e2m1 in f16 (subnormals included); times an e4m3 scale (a multiple of 2^-9,
<= 448) that is a multiple of 2^-24 below 0.17 with <= 6 significant bits: exact in f16. f16 x f16 products are exact
in the mma's fp32 sums; 2^14 / global_scale is applied once per row. x is rounded to fp16 (exact for bf16 inputs
with 2^-14 <= |x| <= 65504; smaller values keep fp16's 2^-24 absolute precision, larger ones overflow).

Lane ids come from `%laneid` / `%tid.x` and every address is built from them, so the kernel never depends on which
element of a Triton tensor a thread holds: tensors are [32 * NW], one element per thread. Under the interpreter
(or KIE_TILES_ASM=0) the same loop runs with lane = element index, the decode of tiles.py and plain fp32 FMAs; the
quad's sum then happens once at the end (`_quad_sum`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .gemv import check_vec, check_x, make_out, num_sms
from .pdl import launch_kw, pdl_begin
from .tiles import _ASM, _e2m1_word, _rstd, _store_out
from .weights import WeightHandle

__all__ = ["prepare_xh", "gemv_nvfp4_mma", "MMA_ROW_BLOCKS", "MMA_WARPS", "MMA_DEPTH", "MMA_L2_PREFETCH", "MMA_PIECES", "MMA_LAYOUT", "MMA_QUADS_PER_ROW"]

MMA_ROW_BLOCKS = 2  # 16-row blocks per warp (x fragments are loaded once for all of them)
MMA_WARPS = 4
MMA_DEPTH = 1  # steps of loads in flight ahead of the mma
MMA_L2_PREFETCH = 0  # steps ahead each warp prefetches its rows into L2 (0: none)
MMA_PIECES = 2  # 16-byte pieces per lane, row and step: a step reads 64 x pieces contiguous bytes of each row
MMA_LAYOUT = "rows"
MMA_QUADS_PER_ROW = 8  # diag layout: quads sharing one row pair

# Byte-plane decode of one word W (tiles.py _E2M1_WORD_PTX) into f16x2 P0 = {e0, e2}, P1 = {e4, e6}, P2 = {e1, e3},
# P3 = {e5, e7}, each 2^-14 x its e2m1 value, then times the f16x2 scale S.
_DECODE = """shl.b32 t, {W}, 4;
and.b32 t, t, 0x80808080;
shl.b32 u, {W}, 1;
and.b32 u, u, 0x0E0E0E0E;
or.b32 lo, t, u;
shr.b32 t, {W}, 3;
and.b32 t, t, 0x0E0E0E0E;
and.b32 u, {W}, 0x80808080;
or.b32 hi, t, u;
prmt.b32 {P}0, lo, z, 0x1404;
prmt.b32 {P}1, lo, z, 0x3424;
prmt.b32 {P}2, hi, z, 0x1404;
prmt.b32 {P}3, hi, z, 0x3424;
mul.rn.f16x2 {P}0, {P}0, {S};
mul.rn.f16x2 {P}1, {P}1, {S};
mul.rn.f16x2 {P}2, {P}2, {S};
mul.rn.f16x2 {P}3, {P}3, {S};
"""
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{d0, d1, d2, d3}}, {{{A}0, {B}0, {A}2, {B}2}}, " \
       "{{{X0}, {X1}}}, {{{C}}};\n"
_MMA_HI = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{d0, d1, d2, d3}}, {{{A}1, {B}1, {A}3, {B}3}}, " \
          "{{{X0}, {X1}}}, {{d0, d1, d2, d3}};\n"
# Operands: $0..$3 out accumulators; $4..$7 in accumulators; $8, $9 row a's words; $10, $11 row b's; $12 the two
# e4m3 scales (row a in byte 0, row b in byte 1); $13..$20 the x pairs of the two words (4 per word).
_MMA_PAIR_PTX = tl.constexpr(
    "{\n.reg .b32 t, u, lo, hi, z, sa, sb, a<4>, b<4>;\n.reg .b16 sh;\n.reg .f32 d<4>;\nmov.b32 z, 0;\n"
    "cvt.u16.u32 sh, $12;\ncvt.rn.f16x2.e4m3x2 sa, sh;\nprmt.b32 sb, sa, sa, 0x3232;\nprmt.b32 sa, sa, sa, 0x1010;\n"
    + _DECODE.format(W="$8", P="a", S="sa") + _DECODE.format(W="$10", P="b", S="sb")
    + _MMA.format(A="a", B="b", X0="$13", X1="$14", C="$4, $5, $6, $7")
    + _MMA_HI.format(A="a", B="b", X0="$15", X1="$16")
    + _DECODE.format(W="$9", P="a", S="sa") + _DECODE.format(W="$11", P="b", S="sb")
    + _MMA.format(A="a", B="b", X0="$17", X1="$18", C="d0, d1, d2, d3")
    + _MMA_HI.format(A="a", B="b", X0="$19", X1="$20")
    + "mov.f32 $0, d0;\nmov.f32 $1, d1;\nmov.f32 $2, d2;\nmov.f32 $3, d3;\n}")


# Weights stream through once: they skip L1 (L1::no_allocate), so the x fragments every warp of an SM re-reads stay
# there. KIE_MMA_L1_NA=0 loads them like any read-only data (A/B).
_W_LOAD = tl.constexpr("ld.global.nc" + (".L1::no_allocate" if os.environ.get("KIE_MMA_L1_NA", "1") == "1" else "")
                       + ".v4.u32 {$0, $1, $2, $3}, [$4];")


@triton.jit
def _xh_kernel(x_ptr, nw_ptr, xh_ptr, K, eps, HAS_NW: tl.constexpr, BLOCK: tl.constexpr, BLOCK_X: tl.constexpr,
               PDL: tl.constexpr = False):
    """grid (cdiv(K, BLOCK),): xh[8j + slot(e)] = fp16((x * rstd * nw)[8j + e]), slot = 0, 2, 1, 3, 4, 6, 5, 7."""
    pdl_begin(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NW:
        x = x * _rstd(x_ptr, K, eps, BLOCK_X) * tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    e = offs % 8
    slot = (e & 4) | ((e & 1) << 1) | ((e >> 1) & 1)
    tl.store(xh_ptr + (offs - e) + slot, x.to(tl.float16), mask=mask)


@triton.jit
def _lane_warp(NW: tl.constexpr):
    """(lane, warp) of the thread holding each element of a [32 * NW] tensor (interpreter: of the element index)."""
    if _ASM:
        z = tl.zeros((NW * 32,), tl.int32)
        lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [z], dtype=tl.int32, is_pure=False, pack=1)
        tid = tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [z], dtype=tl.int32, is_pure=False, pack=1)
        warp = tid >> 5
    else:
        i = tl.arange(0, NW * 32)
        lane = i % 32
        warp = i // 32
    return lane, warp


@triton.jit
def _ld_words(ptr):
    """Four consecutive u32 words at ptr (16-byte aligned)."""
    if _ASM:
        a, b, c, d = tl.inline_asm_elementwise(_W_LOAD, "=r,=r,=r,=r,l", [ptr], dtype=(tl.uint32,) * 4, is_pure=True,
                                               pack=1)
    else:
        a = tl.load(ptr)
        b = tl.load(ptr + 1)
        c = tl.load(ptr + 2)
        d = tl.load(ptr + 3)
    return a, b, c, d


@triton.jit
def _ld_scales(ptr):
    """The two group scales (e4m3 bytes, as int32) at ptr, ptr + 1."""
    return tl.load(ptr).to(tl.int32), tl.load(ptr + 1).to(tl.int32)


@triton.jit
def _ld_x(ptr, valid):
    """The 8 x pairs (u32 = f16x2) of two consecutive words of xh at ptr (16-byte aligned); 0 where not valid."""
    if _ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            "{\n.reg .pred p;\nsetp.ne.s32 p, $9, 0;\nmov.b32 $0, 0;\nmov.b32 $1, 0;\nmov.b32 $2, 0;\nmov.b32 $3, 0;\n"
            "mov.b32 $4, 0;\nmov.b32 $5, 0;\nmov.b32 $6, 0;\nmov.b32 $7, 0;\n"
            "@p ld.global.v4.u32 {$0, $1, $2, $3}, [$8];\n@p ld.global.v4.u32 {$4, $5, $6, $7}, [$8+16];\n}",
            "=r,=r,=r,=r,=r,=r,=r,=r,l,r", [ptr, valid.to(tl.int32)], dtype=(tl.uint32,) * 8, is_pure=True, pack=1)
    else:
        v0 = tl.load(ptr, mask=valid, other=0)
        v1 = tl.load(ptr + 1, mask=valid, other=0)
        v2 = tl.load(ptr + 2, mask=valid, other=0)
        v3 = tl.load(ptr + 3, mask=valid, other=0)
        v4 = tl.load(ptr + 4, mask=valid, other=0)
        v5 = tl.load(ptr + 5, mask=valid, other=0)
        v6 = tl.load(ptr + 6, mask=valid, other=0)
        v7 = tl.load(ptr + 7, mask=valid, other=0)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def _h(v, HI: tl.constexpr):
    """Half HI of an f16x2 pair (u32) as fp32 (portable path)."""
    if HI:
        v = v >> 16
    return (v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_dot(w, s, x0, x1, x2, x3):
    """Portable: one word's 8 codes (x 2^-14) times scale s, dotted with its x pairs {x0, x2} {x1, x3} {x4, x6}
    {x5, x7} (x0..x3 here are those four u32 pairs)."""
    e0, e1, e2, e3, e4, e5, e6, e7 = _e2m1_word(w)
    p = e0 * _h(x0, False) + e2 * _h(x0, True) + e1 * _h(x1, False) + e3 * _h(x1, True)
    p += e4 * _h(x2, False) + e6 * _h(x2, True) + e5 * _h(x3, False) + e7 * _h(x3, True)
    return p * s


@triton.jit
def _pair_step(d0, d1, d2, d3, wa0, wa1, wb0, wb1, sa, sb, x0, x1, x2, x3, x4, x5, x6, x7):
    """Accumulate one 64-code chunk of rows a (d0, d1) and b (d2, d3): words wa0, wa1 / wb0, wb1, e4m3 scale bytes
    sa / sb (int32), x pairs x0..x7. GPU: 4 mma (quad sums included); portable: this lane's part only."""
    if _ASM:
        sab = sa | (sb << 8)
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            _MMA_PAIR_PTX, "=f,=f,=f,=f,f,f,f,f,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [d0, d1, d2, d3, wa0, wa1, wb0, wb1, sab, x0, x1, x2, x3, x4, x5, x6, x7],
            dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    else:
        fa = sa.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        fb = sb.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        d0 += _word_dot(wa0, fa, x0, x1, x2, x3) + _word_dot(wa1, fa, x4, x5, x6, x7)
        d2 += _word_dot(wb0, fb, x0, x1, x2, x3) + _word_dot(wb1, fb, x4, x5, x6, x7)
    return d0, d1, d2, d3


@triton.jit
def _quad_sum(v, NW: tl.constexpr):
    """Portable path: the sum over each quad of lanes (4 consecutive elements), given back to all 4."""
    if _ASM:
        return v
    else:
        s = tl.sum(tl.reshape(v, (NW * 8, 4)), axis=1)
        return tl.reshape(tl.broadcast_to(s[:, None], (NW * 8, 4)), (NW * 32,))


@triton.jit
def _rows_load(wq, sq, ra, rb, swn, stride_sn, w_off, g_off):
    """One step's loads for a row pair: 4 words of row a and of row b from word w_off, their 2 + 2 scales."""
    a0, a1, a2, a3 = _ld_words(wq + ra * swn + w_off)
    b0, b1, b2, b3 = _ld_words(wq + rb * swn + w_off)
    sa0, sa1 = _ld_scales(sq + ra * stride_sn + g_off)
    sb0, sb1 = _ld_scales(sq + rb * stride_sn + g_off)
    return a0, a1, a2, a3, b0, b1, b2, b3, sa0, sa1, sb0, sb1


@triton.jit
def _half_step(d0, d1, d2, d3, f0, f1, f2, f3, H0, H1, xq, x_off, valid, RB: tl.constexpr):
    """One 16-byte half of a step for row block 0 (H0, accumulators d) and, when RB == 2, block 1 (H1, f): its two
    groups as two pair steps; each x fragment is loaded once for both blocks. H = (row a's 4 words, row b's 4
    words, row a's 2 scales, row b's 2 scales)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _ld_x(xq + 4 * x_off, valid)
    d0, d1, d2, d3 = _pair_step(d0, d1, d2, d3, H0[0], H0[1], H0[4], H0[5], H0[8], H0[10],
                                x0, x1, x2, x3, x4, x5, x6, x7)
    if RB == 2:
        f0, f1, f2, f3 = _pair_step(f0, f1, f2, f3, H1[0], H1[1], H1[4], H1[5], H1[8], H1[10],
                                    x0, x1, x2, x3, x4, x5, x6, x7)
    x0, x1, x2, x3, x4, x5, x6, x7 = _ld_x(xq + 4 * x_off + 8, valid)
    d0, d1, d2, d3 = _pair_step(d0, d1, d2, d3, H0[2], H0[3], H0[6], H0[7], H0[9], H0[11],
                                x0, x1, x2, x3, x4, x5, x6, x7)
    if RB == 2:
        f0, f1, f2, f3 = _pair_step(f0, f1, f2, f3, H1[2], H1[3], H1[6], H1[7], H1[9], H1[11],
                                    x0, x1, x2, x3, x4, x5, x6, x7)
    return d0, d1, d2, d3, f0, f1, f2, f3


@triton.jit
def _piece_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, h: tl.constexpr, NH: tl.constexpr):
    """Piece h of a step of NH 16-byte pieces per lane and row: words 16 NH st + 16h + 4q .. + 3 (one load
    instruction per piece and row covers 64 contiguous bytes of the row across the quad, so a step reads 64 NH
    contiguous bytes per row), clamped in-row on its own (K % 32 == 0 lets a ragged last step end after any piece),
    and the piece's two group scales."""
    w = tl.minimum(16 * NH * st + 16 * h + 4 * q, KW - 4)
    g = tl.minimum(8 * NH * st + 8 * h + 2 * q, KG - 2)
    return _rows_load(wq, sq, ra, rb, swn, stride_sn, w, g)


@triton.jit
def _stage_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, NH: tl.constexpr):
    """One step's loads for a row pair: NH pieces (2 or 4) per row (_piece_load)."""
    if NH == 2:
        return (_piece_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, 0, NH),
                _piece_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, 1, NH))
    else:
        return (_piece_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, 0, NH),
                _piece_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, 1, NH),
                _piece_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, 2, NH),
                _piece_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, 3, NH))


@triton.jit
def _l2_prefetch(ptr):
    """Prefetch the line at ptr into L2 (GPU only; one instruction per lane)."""
    if _ASM:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptr], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _nvfp4_mma_kernel(xh_ptr, w_ptr, stride_wn, s_ptr, stride_sn, gs_ptr, bias_ptr, res_ptr, y_ptr, N, K,
                      HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RB: tl.constexpr, NW: tl.constexpr,
                      DEPTH: tl.constexpr, PF: tl.constexpr, NH: tl.constexpr, PDL: tl.constexpr = False):
    """grid (cdiv(N, 16 * RB * NW),): y = W @ x for nvfp4 W [N, K/2] u8, scales [N, K/16] e4m3 (as u8), xh from
    prepare_xh, K % 32 == 0. Each warp owns 16 * RB rows and the whole K in 256-code steps (128 bytes per row: the
    quad reads whole lines; _stage_load says which lane reads what). Loads run DEPTH steps ahead of the mma."""
    pdl_begin(PDL)
    lane, warp = _lane_warp(NW)
    r = lane >> 2
    q = lane & 3
    base = (tl.program_id(0) * NW + warp) * (16 * RB)
    KW = K // 8                      # u32 words per row, a multiple of 4
    KG = K // 16                     # scale groups per row, even
    SW: tl.constexpr = 16 * NH       # words per row per step
    n_steps = tl.cdiv(KW, SW)
    wq = w_ptr.to(tl.pointer_type(tl.uint32))
    xq = xh_ptr.to(tl.pointer_type(tl.uint32))
    sq = s_ptr.to(tl.pointer_type(tl.uint8))
    # Rows (clamped: rows past N read row N - 1 and are not stored), int64 offsets.
    ra0 = tl.minimum(base + r, N - 1).to(tl.int64)
    rb0 = tl.minimum(base + r + 8, N - 1).to(tl.int64)
    ra1 = tl.minimum(base + 16 + r, N - 1).to(tl.int64)
    rb1 = tl.minimum(base + 24 + r, N - 1).to(tl.int64)
    swn = stride_wn // 4
    zero = tl.zeros((NW * 32,), tl.float32)
    a0, a1, a2, a3, e0, e1, e2, e3 = zero, zero, zero, zero, zero, zero, zero, zero
    c0, c1, c2, c3, f0, f1, f2, f3 = zero, zero, zero, zero, zero, zero, zero, zero
    # Steps past the end clamp to the last one (re-read: L1 / L2 hits).
    P0 = _stage_load(wq, sq, ra0, rb0, swn, stride_sn, 0, q, KW, KG, NH)
    if RB == 2:
        P1 = _stage_load(wq, sq, ra1, rb1, swn, stride_sn, 0, q, KW, KG, NH)
    if DEPTH == 2:
        s1 = tl.minimum(1, n_steps - 1)
        Q0 = _stage_load(wq, sq, ra0, rb0, swn, stride_sn, s1, q, KW, KG, NH)
        if RB == 2:
            Q1 = _stage_load(wq, sq, ra1, rb1, swn, stride_sn, s1, q, KW, KG, NH)
    prow = tl.minimum(base + lane % (16 * RB), N - 1).to(tl.int64)
    for st in range(0, n_steps):
        if PF > 0:
            _l2_prefetch(wq + prow * swn + tl.maximum(tl.minimum(SW * (st + PF), KW - 32), 0))
            _l2_prefetch(sq + prow * stride_sn + tl.maximum(tl.minimum(SW // 2 * (st + PF), KG - 16), 0))
        sn = tl.minimum(st + DEPTH, n_steps - 1)
        C0 = P0
        if DEPTH == 2:
            P0 = Q0
            Q0 = _stage_load(wq, sq, ra0, rb0, swn, stride_sn, sn, q, KW, KG, NH)
        else:
            P0 = _stage_load(wq, sq, ra0, rb0, swn, stride_sn, sn, q, KW, KG, NH)
        if RB == 2:
            C1 = P1
            if DEPTH == 2:
                P1 = Q1
                Q1 = _stage_load(wq, sq, ra1, rb1, swn, stride_sn, sn, q, KW, KG, NH)
            else:
                P1 = _stage_load(wq, sq, ra1, rb1, swn, stride_sn, sn, q, KW, KG, NH)
        # Pieces feed separate accumulator chains (NH 2: a / e, and c / f for block 1; NH 4, one block: a e c f):
        # one piece's mma never waits for another's.
        x_off = SW * st + 4 * q
        if NH == 2:
            if RB == 1:
                C1 = C0
            a0, a1, a2, a3, c0, c1, c2, c3 = _half_step(a0, a1, a2, a3, c0, c1, c2, c3, C0[0], C1[0], xq, x_off,
                                                        x_off < KW, RB)
            e0, e1, e2, e3, f0, f1, f2, f3 = _half_step(e0, e1, e2, e3, f0, f1, f2, f3, C0[1], C1[1], xq,
                                                        x_off + 16, x_off + 16 < KW, RB)
        else:
            a0, a1, a2, a3, _u0, _u1, _u2, _u3 = _half_step(a0, a1, a2, a3, a0, a1, a2, a3, C0[0], C0[0], xq, x_off,
                                                            x_off < KW, 1)
            e0, e1, e2, e3, _u0, _u1, _u2, _u3 = _half_step(e0, e1, e2, e3, e0, e1, e2, e3, C0[1], C0[1], xq,
                                                            x_off + 16, x_off + 16 < KW, 1)
            c0, c1, c2, c3, _u0, _u1, _u2, _u3 = _half_step(c0, c1, c2, c3, c0, c1, c2, c3, C0[2], C0[2], xq,
                                                            x_off + 32, x_off + 32 < KW, 1)
            f0, f1, f2, f3, _u0, _u1, _u2, _u3 = _half_step(f0, f1, f2, f3, f0, f1, f2, f3, C0[3], C0[3], xq,
                                                            x_off + 48, x_off + 48 < KW, 1)
    # 2^14 undoes the decode's exponent shift; 1 / global scale per Linear. One lane per quad stores.
    g = 16384.0 / tl.load(gs_ptr).to(tl.float32)
    lead = q == 0
    n = base + r
    if NH == 4:
        a0 += c0 + f0
        a2 += c2 + f2
    _store_out(_quad_sum(a0 + e0, NW) * g, n, lead & (n < N), y_ptr, bias_ptr, res_ptr, HAS_BIAS, HAS_RES)
    _store_out(_quad_sum(a2 + e2, NW) * g, n + 8, lead & (n + 8 < N), y_ptr, bias_ptr, res_ptr, HAS_BIAS, HAS_RES)
    if RB == 2:
        _store_out(_quad_sum(c0 + f0, NW) * g, n + 16, lead & (n + 16 < N), y_ptr, bias_ptr, res_ptr, HAS_BIAS,
                   HAS_RES)
        _store_out(_quad_sum(c2 + f2, NW) * g, n + 24, lead & (n + 24 < N), y_ptr, bias_ptr, res_ptr, HAS_BIAS,
                   HAS_RES)


# ---- "diagonal" layout: the 8 quads of a warp read 8 different K pieces of the same rows -------------------------
# An mma's quad g supplies A rows g and g + 8 and B column g, so D[g][g] and D[g + 8][g] only ever combine quad g's
# own A rows with quad g's own x: each quad may work on its own K piece, and those two diagonal entries (held by lane
# q = g // 2 of the quad: c0 / c2 for even g, c1 / c3 for odd g) accumulate its rows' partial dots across mma; the
# other entries of D are cross terms and are never read. So GPR quads can share one row pair, and one warp load
# instruction then reads GPR x 64 contiguous bytes of a row (the row-block layout above reads 8 rows x 64 bytes).
@triton.jit
def _shfl_xor(v, m: tl.constexpr):
    return tl.inline_asm_elementwise(f"shfl.sync.bfly.b32 $0, $1, {m}, 0x1f, 0xffffffff;", "=r,r",
                                     [v.to(tl.int32, bitcast=True)], dtype=tl.int32, is_pure=False,
                                     pack=1).to(tl.float32, bitcast=True)


@triton.jit
def _group_sum(v, G: tl.constexpr, NW: tl.constexpr):
    """Sum over each group of G consecutive lanes (G a power of two <= 32), given back to all of them."""
    if _ASM:
        if G >= 2:
            v += _shfl_xor(v, 1)
        if G >= 4:
            v += _shfl_xor(v, 2)
        if G >= 8:
            v += _shfl_xor(v, 4)
        if G >= 16:
            v += _shfl_xor(v, 8)
        if G >= 32:
            v += _shfl_xor(v, 16)
        return v
    else:
        t = tl.sum(tl.reshape(v, (NW * 32 // G, G)), axis=1)
        return tl.reshape(tl.broadcast_to(t[:, None], (NW * 32 // G, G)), (NW * 32,))


@triton.jit
def _diag(c0, c1, g, q):
    """GPU: this lane's share of its quad's diagonal entry (c0 for even g, c1 for odd g, in lane q = g // 2);
    portable: the lane's own partial sum (c0)."""
    if _ASM:
        return tl.where(q == (g >> 1), tl.where((g & 1) == 1, c1, c0), 0.0)
    else:
        return c0


@triton.jit
def _diag_load(wq, sq, ra, rb, swn, stride_sn, st, c, q, KW, KG, j: tl.constexpr, GPR: tl.constexpr,
               NP: tl.constexpr):
    """Piece j of step st for quad phase c: words 16 (GPR (NP st + j) + c) + 4q .. + 3 of rows ra and rb (piece j
    of the GPR quads of a row pair is GPR x 64 contiguous bytes), clamped in-row, and its two group scales."""
    w = 16 * (GPR * (NP * st + j) + c) + 4 * q
    return _rows_load(wq, sq, ra, rb, swn, stride_sn, tl.minimum(w, KW - 4), tl.minimum(w // 2, KG - 2))


@triton.jit
def _diag_stage(wq, sq, ra, rb, swn, stride_sn, st, c, q, KW, KG, GPR: tl.constexpr, NP: tl.constexpr):
    if NP == 2:
        return (_diag_load(wq, sq, ra, rb, swn, stride_sn, st, c, q, KW, KG, 0, GPR, NP),
                _diag_load(wq, sq, ra, rb, swn, stride_sn, st, c, q, KW, KG, 1, GPR, NP))
    else:
        return (_diag_load(wq, sq, ra, rb, swn, stride_sn, st, c, q, KW, KG, 0, GPR, NP),
                _diag_load(wq, sq, ra, rb, swn, stride_sn, st, c, q, KW, KG, 1, GPR, NP),
                _diag_load(wq, sq, ra, rb, swn, stride_sn, st, c, q, KW, KG, 2, GPR, NP),
                _diag_load(wq, sq, ra, rb, swn, stride_sn, st, c, q, KW, KG, 3, GPR, NP))


@triton.jit
def _task_rows(wid, t, ROUNDS, p, N, PPW: tl.constexpr):
    """Rows (a, b) of row pair p of this warp's t-th task: task = wid * ROUNDS + t owns rows [2 PPW task, + 2 PPW)."""
    ra = (wid * ROUNDS + t) * (2 * PPW) + p
    return ra, ra + PPW


@triton.jit
def _nvfp4_mma_diag_kernel(xh_ptr, w_ptr, stride_wn, s_ptr, stride_sn, gs_ptr, bias_ptr, res_ptr, y_ptr, N, K,
                           ROUNDS, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NW: tl.constexpr,
                           GPR: tl.constexpr, NP: tl.constexpr, PDL: tl.constexpr = False):
    """grid (cdiv(n_tasks, NW * ROUNDS),): the diagonal layout (comment above). Lane (g, q): row pair p = g // GPR
    of the task, phase c = g % GPR. A task = 2 * (8 // GPR) rows x whole K; warp wid runs tasks wid * ROUNDS ..
    + ROUNDS - 1 as one flat loop of (task, step) iterations, so its loads run one step ahead across task
    boundaries too. A step = NP pieces per lane and row."""
    pdl_begin(PDL)
    PPW: tl.constexpr = 8 // GPR
    lane, warp = _lane_warp(NW)
    g = lane >> 2
    q = lane & 3
    p = g // GPR
    c = g % GPR
    wid = tl.program_id(0) * NW + warp
    KW = K // 8
    KG = K // 16
    spt = tl.cdiv(KW, 16 * GPR * NP)                  # steps per task
    n_it = ROUNDS * spt
    wq = w_ptr.to(tl.pointer_type(tl.uint32))
    xq = xh_ptr.to(tl.pointer_type(tl.uint32))
    sq = s_ptr.to(tl.pointer_type(tl.uint8))
    swn = stride_wn // 4
    gsc = 16384.0 / tl.load(gs_ptr).to(tl.float32)
    zero = tl.zeros((NW * 32,), tl.float32)
    a0, a1, a2, a3, e0, e1, e2, e3 = zero, zero, zero, zero, zero, zero, zero, zero
    ra, rb = _task_rows(wid, 0, ROUNDS, p, N, PPW)
    P = _diag_stage(wq, sq, tl.minimum(ra, N - 1).to(tl.int64), tl.minimum(rb, N - 1).to(tl.int64), swn, stride_sn,
                    0, c, q, KW, KG, GPR, NP)
    for it in range(0, n_it):
        t = it // spt
        st = it - t * spt
        itn = tl.minimum(it + 1, n_it - 1)
        tn = itn // spt
        rna, rnb = _task_rows(wid, tn, ROUNDS, p, N, PPW)
        C = P
        P = _diag_stage(wq, sq, tl.minimum(rna, N - 1).to(tl.int64), tl.minimum(rnb, N - 1).to(tl.int64), swn,
                        stride_sn, itn - tn * spt, c, q, KW, KG, GPR, NP)
        x0 = 16 * (GPR * NP * st + c) + 4 * q           # word of piece 0; piece j adds 16 GPR j
        a0, a1, a2, a3, _u0, _u1, _u2, _u3 = _half_step(a0, a1, a2, a3, a0, a1, a2, a3, C[0], C[0], xq, x0,
                                                        x0 < KW, 1)
        e0, e1, e2, e3, _u0, _u1, _u2, _u3 = _half_step(e0, e1, e2, e3, e0, e1, e2, e3, C[1], C[1], xq,
                                                        x0 + 16 * GPR, x0 + 16 * GPR < KW, 1)
        if NP == 4:
            a0, a1, a2, a3, _u0, _u1, _u2, _u3 = _half_step(a0, a1, a2, a3, a0, a1, a2, a3, C[2], C[2], xq,
                                                            x0 + 32 * GPR, x0 + 32 * GPR < KW, 1)
            e0, e1, e2, e3, _u0, _u1, _u2, _u3 = _half_step(e0, e1, e2, e3, e0, e1, e2, e3, C[3], C[3], xq,
                                                            x0 + 48 * GPR, x0 + 48 * GPR < KW, 1)
        if st == spt - 1:
            ya = _group_sum(_diag(a0, a1, g, q) + _diag(e0, e1, g, q), 4 * GPR, NW) * gsc
            yb = _group_sum(_diag(a2, a3, g, q) + _diag(e2, e3, g, q), 4 * GPR, NW) * gsc
            ta, tb = _task_rows(wid, t, ROUNDS, p, N, PPW)
            lead = (lane % (4 * GPR)) == 0
            _store_out(ya, ta, lead & (ta < N), y_ptr, bias_ptr, res_ptr, HAS_BIAS, HAS_RES)
            _store_out(yb, tb, lead & (tb < N), y_ptr, bias_ptr, res_ptr, HAS_BIAS, HAS_RES)
            a0, a1, a2, a3, e0, e1, e2, e3 = zero, zero, zero, zero, zero, zero, zero, zero


def _reg_cap(row_blocks: int, depth: int, pieces: int, device: torch.device) -> dict:
    """Two row blocks one step deep compile to 134 registers on sm_90 (ptxas, triton 3.6): capped at 128 (no spill
    in the SASS) so 16 warps fit an SM and a 65536-row GEMV runs in one wave."""
    return {"maxnreg": 128} if device.type == "cuda" and row_blocks * pieces == 4 and depth == 1 else {}


def prepare_xh(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The mma GEMV's input: fp16 [K], each 8 elements in the order 0, 2, 1, 3, 4, 6, 5, 7 (RMS-normalised with
    norm_weight when given). One small launch, like prepare_x8."""
    K = x.shape[-1]
    if K % 16 or x.numel() != K:
        raise ValueError(f"prepare_xh: x shape {tuple(x.shape)}: need batch 1 and K % 16 == 0")
    check_vec(norm_weight, K, x.device, "norm_weight")
    if out is None:
        out = torch.empty(K, dtype=torch.float16, device=x.device)
    elif out.shape != (K,) or out.dtype != torch.float16 or not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"prepare_xh: out must be a contiguous, 16-byte aligned fp16 [{K}], got {out.dtype} "
                         f"{tuple(out.shape)}")
    BLOCK = min(1024, triton.next_power_of_2(K))
    _xh_kernel[(triton.cdiv(K, BLOCK),)](x, norm_weight if norm_weight is not None else x, out, K, eps,
                                         HAS_NW=norm_weight is not None, BLOCK=BLOCK,
                                         BLOCK_X=min(1024, triton.next_power_of_2(K)), **launch_kw(x.device))
    return out


def gemv_nvfp4_mma(x: torch.Tensor, w: WeightHandle, *, bias: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                   norm_weight: torch.Tensor | None = None, eps: float = 1e-6, xh: torch.Tensor | None = None,
                   row_blocks: int = MMA_ROW_BLOCKS, num_warps: int = MMA_WARPS,
                   depth: int = MMA_DEPTH, l2_prefetch: int = MMA_L2_PREFETCH,
                   pieces: int = MMA_PIECES, layout: str = MMA_LAYOUT, quads_per_row: int = MMA_QUADS_PER_ROW,
                   rounds: int | None = None) -> torch.Tensor:
    """y = W @ x (+ bias) (+ residual) for one nvfp4 Linear, on the tensor cores (module docstring). Same contract as
    kernels.gemv.gemv; xh = prepare_xh(x, norm_weight, eps) when already made (else made here).
    layout "rows": each warp owns 16 * row_blocks rows (depth, l2_prefetch, pieces apply); "diag": quads_per_row
    quads share a row pair (pieces 2 or 4, one step deep; rounds = tasks per warp, None = fit one wave)."""
    if w.fmt != "nvfp4":
        raise ValueError(f"gemv_nvfp4_mma: weight format {w.fmt!r}, expected 'nvfp4'")
    if w.num_experts:
        raise ValueError("gemv_nvfp4_mma: weight handle is an expert stack")
    N, K = w.out_features, w.in_features
    if K % 32:
        raise ValueError(f"gemv_nvfp4_mma: in_features {K} is not a multiple of 32 (16-byte row pieces)")
    if w.weight.stride(-1) != 1 or w.weight.stride(-2) % 16 or w.weight.data_ptr() % 16:
        raise ValueError("gemv_nvfp4_mma: weight rows must be contiguous and 16-byte aligned")
    if w.scale.stride(-1) != 1:
        raise ValueError(f"gemv_nvfp4_mma: weight_scale must be contiguous along in_features, stride {w.scale.stride()}")
    if layout not in ("rows", "diag") or quads_per_row not in (1, 2, 4, 8):
        raise ValueError(f"gemv_nvfp4_mma: layout {layout!r} ('rows' or 'diag'), quads_per_row {quads_per_row} "
                         "(1, 2, 4, 8)")
    if (row_blocks not in (1, 2) or num_warps not in (1, 2, 4, 8) or depth not in (1, 2) or l2_prefetch < 0
            or pieces not in (2, 4) or (pieces == 4 and row_blocks == 2 and layout == "rows")):
        raise ValueError(f"gemv_nvfp4_mma: row_blocks {row_blocks} (1 or 2), num_warps {num_warps} (1, 2, 4, 8), "
                         f"depth {depth} (1 or 2), l2_prefetch {l2_prefetch} (>= 0), pieces {pieces} (2, or 4 with one row block)")
    check_x(x, K, w.device)
    check_vec(bias, N, w.device, "bias")
    check_vec(residual, N, w.device, "residual")
    y = make_out(x, N, out)
    if xh is None:
        xh = prepare_xh(x, norm_weight, eps)
    elif xh.shape != (K,) or xh.dtype != torch.float16 or not xh.is_contiguous() or xh.data_ptr() % 16:
        raise ValueError(f"xh: expected a contiguous, 16-byte aligned fp16 [{K}] (prepare_xh), got {xh.dtype} "
                         f"{tuple(xh.shape)}")
    if layout == "diag":
        n_tasks = triton.cdiv(N, 2 * (8 // quads_per_row))
        if rounds is None:  # 16 warps per SM (128 registers): as few rounds as fill the GPU once
            rounds = triton.cdiv(n_tasks, num_sms(x.device) * 16)
        grid = (triton.cdiv(n_tasks, num_warps * rounds),)
        _nvfp4_mma_diag_kernel[grid](
            xh, w.weight, w.weight.stride(-2), w.scale.view(torch.uint8), w.scale.stride(-2), w.global_scale,
            bias if bias is not None else y, residual if residual is not None else y, y, N, K, rounds,
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, NW=num_warps, GPR=quads_per_row, NP=pieces,
            num_warps=num_warps, **launch_kw(x.device), **({"maxnreg": 128} if x.device.type == "cuda" else {}))
        return y
    grid = (triton.cdiv(N, 16 * row_blocks * num_warps),)
    _nvfp4_mma_kernel[grid](
        xh, w.weight, w.weight.stride(-2), w.scale.view(torch.uint8), w.scale.stride(-2), w.global_scale,
        bias if bias is not None else y, residual if residual is not None else y, y, N, K,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, RB=row_blocks, NW=num_warps, DEPTH=depth,
        PF=l2_prefetch, NH=pieces, num_warps=num_warps, **launch_kw(x.device), **_reg_cap(row_blocks, depth, pieces, x.device))
    return y

"""fp4 GEMV (nvfp4, mxfp4) on the tensor cores: e2m1 codes decoded in registers straight into mma.sync A fragments.

Why: the CUDA-core fp4 tile (tiles.py) is issue-bound at ~61% of the read probe: each code needs its own fp32
convert and FFMA (~33 SASS instructions per u32 word of 8 codes). Here a word's 8 codes become four f16x2 registers
(the byte-plane decode of tiles.py: 7 integer ops + 4 byte permutes), the dot products run on `mma.sync.m16n8k16`
with fp32 accumulation, and the group scale is one fp32 FFMA per group and row on the mma's result: ~17 SASS
instructions per word all told (sm_90), no shared memory (a plain `tl.dot` stages its operands there and measured
2-3x slower: NOTES.md session 6). H200, 65536 x 8192 (BENCHMARKS.md session 13): 81.5-83.1% (nvfp4) / 80.4-80.9%
(mxfp4) of the read probe at 4 warps on checkpoint bytes, 86.1-86.5% / 83.9% on bytes in packing "mma"
(pack_for_mma: the low plane's decode becomes one AND), against ~62 / ~64% for the CUDA-core tile in the same
process.

Lane roles (one warp = 16 * RB weight rows; lane l has r = l // 4, q = l % 4):
- lane (r, q) holds rows `base + r` and `base + r + 8` of each 16-row block as the mma's A rows r and r + 8, and for
  each 256-code step of K two 16-byte pieces of each row: piece h = words 16h + 4q .. + 3 (one load instruction per
  piece and row covers 64 contiguous bytes of the row across the quad), with their group scales (nvfp4: a group =
  16 codes = 2 words, both groups of a piece in one u16 load; mxfp4: a group = 32 codes = the piece's 4 words).
- a word's codes land in the A fragment as f16x2 pairs {e0, e2}, {e4, e6}, {e1, e3}, {e5, e7} (the byte-plane order),
  so the input is stored per 8 elements in the order 0, 2, 1, 3, 4, 6, 5, 7 ("xh", fp16; prepare_xh).
- "own columns": B column n is non-zero only for n = 2g, where it holds the x pairs of quad lane g's word (supplied
  by lane (2g, g); every other lane passes zeros). So D[row][2q] is lane (r, q)'s own word's dot: each lane's D
  holds only its own words, a group's mma chain (nvfp4: 2 words = 4 mma, mxfp4: 4 words = 8) starts from zero and
  its result gets the group scale in one fp32 FFMA per row, and the quad is summed once at the end (two shuffles).
  (Session 12's kernel put the scale into the A fragment with 4 HMUL2 per word and kept all 8 B columns equal:
  ~21 instructions per word, 76-77%.)
Exactness: the decode gives 2^-14 x e2m1 in f16 (subnormals included); f16 x f16 products are exact in the mma's
fp32 sums, and the scales are exact fp32: nvfp4's e4m3 value (2^14 / global_scale applied once per row); mxfp4's
2^(e - 127) x 2^14 (the decode's factor folded in), exact for every E8M0 e <= 240 (2^-127 .. 2^113), inf above.
x is rounded to fp16 once (after the RMSNorm when fused): exact for bf16 inputs with 2^-14 <= |x| <= 65504; smaller
values keep fp16's 2^-24 absolute precision, larger overflow.

Lane ids come from `%laneid` / `%tid.x` and every address is built from them, so the kernel never depends on which
element of a Triton tensor a thread holds: tensors are [32 * NW], one element per thread. Under the interpreter
(or KIE_TILES_ASM=0) the same loop runs with lane = element index, the decode of tiles.py and plain fp32 FMAs over
the lane's own words; the quad's sum is the same.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl
from triton.language.target_info import cuda_capability_geq

from .gemv import check_vec, check_x, make_out
from .pdl import launch_kw, pdl_begin, reg_cap
from .device_caps import e4m3_native
from .tiles import _ASM, E2M1_F16X2_PTX, _as_f32, _normed_block, _store_out, rstd_block
from .weights import WeightHandle, mma_bytes

__all__ = ["prepare_xh", "gemv_fp4_mma", "mma_unreadable", "mma_experts_unreadable", "pack_for_mma",
           "MMA_ROW_BLOCKS", "MMA_WARPS", "MMA_MAXNREG"]

# Launch shape measured best on the H200 (NOTES.md sessions 12-13): 2 row blocks (32 rows) per warp, 4 warps per
# program, registers capped at 128 (uncapped, the device's ptxas takes more and the GEMV drops to 73%) -> 16 warps
# per SM and a 65536-row GEMV in one wave.
MMA_ROW_BLOCKS = 2
MMA_WARPS = 4
MMA_MAXNREG = 128

# A fragment {row r k0-1, row r+8 k0-1, row r k8-9, row r+8 k8-9} = {a0, b0, a2, b2}: codes {e0, e2} | {e1, e3} of
# both rows against x pairs {x0, x2} | {x1, x3}; then {a1, b1, a3, b3} = codes 4-7 against {x4, x6} | {x5, x7}.
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{d0, d1, d2, d3}}, {{{A}0, {B}0, {A}2, {B}2}}, " \
       "{{{X0}, {X1}}}, {{{C}}};\n"
_MMA_HI = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{d0, d1, d2, d3}}, {{{A}1, {B}1, {A}3, {B}3}}, " \
          "{{{X0}, {X1}}}, {{d0, d1, d2, d3}};\n"
# Weights stream through once: they skip L1 (L1::no_allocate), so the x fragments every warp of an SM re-reads stay
# there (71.0 -> 74.3% of the probe, NOTES.md session 12). KIE_MMA_L1_NA=0 loads them like any read-only data (A/B).
_W_LOAD = tl.constexpr("ld.global.nc" + (".L1::no_allocate" if os.environ.get("KIE_MMA_L1_NA", "1") == "1" else "")
                       + ".v4.u32 {$0, $1, $2, $3}, [$4];")


# Packing "mma" (pack_for_mma, weights.mma_bytes): byte b already holds code 2b as its plane byte (s at bit 7,
# e1 e0 m at bits 3..1) and code 2b+1 as e1 e0 m at bits 6..4, s at bit 0: the low plane is one AND, the high plane
# one shift pair + merge, then the same 4 PRMT (15.7 SASS per word instead of 17.7).
_E2M1_MMA_PACKED_PTX = """and.b32 lo, {W}, 0x8E8E8E8E;
shr.b32 t, {W}, 3;
and.b32 t, t, 0x0E0E0E0E;
shl.b32 u, {W}, 7;
and.b32 u, u, 0x80808080;
or.b32 hi, t, u;
""" + E2M1_F16X2_PTX[E2M1_F16X2_PTX.index("prmt.b32"):]


# One group's mma chain: each word of rows a and b decoded (E2M1_F16X2_PTX, or the packed decode) and multiplied in two
# mma (codes 0-3, then 4-7, against the lane's B registers), the first starting from zero (or from $4..$7 when chained).
def _group_ptx(words: int, chained: bool, packed: bool = False) -> str:
    """`words` words of rows a and b through 2 mma each, chained: $0..$3 out; (chained) $4..$7 in; then the words
    of row a, those of row b, and 4 x pairs per word."""
    c0 = 8 if chained else 4
    wa, wb, xs = c0, c0 + words, c0 + 2 * words
    dec = _E2M1_MMA_PACKED_PTX if packed else E2M1_F16X2_PTX
    body = "{\n.reg .b32 t, u, lo, hi, z, a<4>, b<4>;\n.reg .f32 d<4>;\nmov.b32 z, 0;\n"
    for j in range(words):
        body += dec.format(W=f"${wa + j}", P="a") + dec.format(W=f"${wb + j}", P="b")
        c = ("$4, $5, $6, $7" if chained else "0f00000000, 0f00000000, 0f00000000, 0f00000000") if j == 0 \
            else "d0, d1, d2, d3"
        body += _MMA.format(A="a", B="b", X0=f"${xs + 4 * j}", X1=f"${xs + 4 * j + 1}", C=c)
        body += _MMA_HI.format(A="a", B="b", X0=f"${xs + 4 * j + 2}", X1=f"${xs + 4 * j + 3}")
    return body + "mov.f32 $0, d0;\nmov.f32 $1, d1;\nmov.f32 $2, d2;\nmov.f32 $3, d3;\n}"


_MMA_GROUP = tl.constexpr(_group_ptx(2, False))
_MMA_GROUP_C = tl.constexpr(_group_ptx(2, True))
_MMA_GROUP_R = tl.constexpr(_group_ptx(2, False, True))
_MMA_GROUP_CR = tl.constexpr(_group_ptx(2, True, True))


@triton.jit
def _xh_kernel(x_ptr, nw_ptr, xh_ptr, K, eps, HAS_NW: tl.constexpr, BLOCK: tl.constexpr, BLOCK_X: tl.constexpr,
               PDL: tl.constexpr = False, NATURAL: tl.constexpr = False):
    """grid (cdiv(K, BLOCK),): xh[8j + slot(e)] = fp16((x * rstd * nw)[8j + e]), slot = 0, 2, 1, 3, 4, 6, 5, 7
    (NATURAL: slot = e, the fp8 mma GEMV's order)."""
    pdl_begin(PDL)
    offs, mask, x = _normed_block(x_ptr, nw_ptr, K, eps, HAS_NW, BLOCK, BLOCK_X)
    if NATURAL:
        tl.store(xh_ptr + offs, x.to(tl.float16), mask=mask)
    else:
        tl.store(xh_ptr + xh_pos(offs), x.to(tl.float16), mask=mask)


@triton.jit
def xh_pos(n):
    """Position of element n of a vector in the xh layout (each 8 in the order 0, 2, 1, 3, 4, 6, 5, 7): prepare_xh's,
    the router's xh_out (moe.route) and the expert GLU's h (fp4_mma_experts)."""
    e = n % 8
    return (n - e) + ((e & 4) | ((e & 1) << 1) | ((e >> 1) & 1))


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
def _word_dot(w, x0, x1, x2, x3, RP: tl.constexpr = False):
    """Portable: one word's 8 codes (x 2^-14) dotted with its x pairs {x0, x2} {x1, x3} {x4, x6} {x5, x7} (x0..x3
    here are those four u32 pairs; RP: w in packing "mma", read back first). The 8 codes go through at once as a
    [L, 8] tensor (element k = nibble k, the byte s 0 0 0 e1 e0 m 0 as an fp16's high byte, as tiles._e2m1_word
    decodes it): the interpreter runs ~8x fewer ops than one decode per code (a tiny nvfp4 decode 41 -> ~8 s, CI)."""
    if RP:
        w = _unpack_mma(w)
    k = tl.arange(0, 8)[None, :]
    nib = (w[:, None] >> (4 * k).to(tl.uint32)) & 0xF
    v = ((((nib & 8) << 4) | ((nib & 7) << 1)) << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    pair = ((k & 4) >> 1) | (k & 1)          # element k's x: half (k >> 1) & 1 of pair 0, 1, 0, 1, 2, 3, 2, 3
    xp = tl.where(pair == 0, x0[:, None], tl.where(pair == 1, x1[:, None], tl.where(pair == 2, x2[:, None],
                                                                                    x3[:, None])))
    xv = ((xp >> (16 * ((k >> 1) & 1)).to(tl.uint32)) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    return tl.sum(v * xv.to(tl.float32), axis=1)


# KIE_MMA_SCALE_ASM (default 1; 0: tl.load, its A/B): the group scales load through inline PTX (ld.global.nc,
# zero-extended into a 32-bit register) like the codes, instead of tl.load. Same values; the point is compile time:
# Triton's coalescing pass walks every tl.load / tl.store of the one huge monokernel function and took 16.6 of the
# nvfp4 tensor-core build's 25.5 s offline (NOTES.md session 40). H100, qwen3-30b-a3b nvfp4 monokernel (session 41):
# first launch 53.9 -> 35.1 s, 314.1 -> 314.9 tok/s, the same tokens.
_SCALE_ASM = tl.constexpr(os.environ.get("KIE_MMA_SCALE_ASM", "1") == "1")


@triton.jit
def _ld_scale(ptr, U16: tl.constexpr):
    """The u16 (nvfp4: two e4m3 group scales) or u8 (mxfp4: one E8M0) at ptr, as int32."""
    if _ASM and _SCALE_ASM:
        v = tl.inline_asm_elementwise("ld.global.nc.u16 $0, [$1];" if U16 else "ld.global.nc.u8 $0, [$1];",
                                      "=r,l", [ptr], dtype=tl.int32, is_pure=True, pack=1)
    elif U16:
        v = tl.load(ptr.to(tl.pointer_type(tl.uint16))).to(tl.int32)
    else:
        v = tl.load(ptr).to(tl.int32)
    return v


@triton.jit
def _e8m0_scale(ptr):
    """One mxfp4 group scale byte e at ptr as fp32 2^(e - 127) x 2^14: the decode's 2^-14 undone here so that a row
    whose groups all have e = 0 keeps fp32's normal range: exact for e <= 240, inf above."""
    return (tl.minimum(_ld_scale(ptr, False) + 14, 255) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _piece_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, h: tl.constexpr, MX: tl.constexpr):
    """Piece h of step st for rows ra, rb: words 32 st + 16 h + 4q .. + 3 (clamped in-row: K % 32 == 0 lets a ragged
    last step end after either piece; its missing words multiply x = 0) and their scales: (words a, words b, sa, sb),
    mxfp4 sa / sb the fp32 group scale, nvfp4 the u16 pair of e4m3 scales (words 0-1, words 2-3)."""
    w = tl.minimum(32 * st + 16 * h + 4 * q, KW - 4)
    a0, a1, a2, a3 = _ld_words(wq + ra * swn + w)
    b0, b1, b2, b3 = _ld_words(wq + rb * swn + w)
    if MX:
        g = tl.minimum(w // 4, KG - 1)
        sa = _e8m0_scale(sq + ra * stride_sn + g)
        sb = _e8m0_scale(sq + rb * stride_sn + g)
    else:  # both groups' e4m3 bytes in one u16 load per row (g is even), widened where used (_group_scale)
        g = tl.minimum(w // 2, KG - 2)
        sa = _ld_scale(sq + ra * stride_sn + g, True)
        sb = _ld_scale(sq + rb * stride_sn + g, True)
    return a0, a1, a2, a3, b0, b1, b2, b3, sa, sb


@triton.jit
def _group_scale(s, HALF: tl.constexpr, MX: tl.constexpr, E4B: tl.constexpr = False):
    """The fp32 scale of a piece's group HALF (0: words 0-1, 1: words 2-3): mxfp4 s itself, nvfp4 byte HALF of the
    u16 pair. E4B (device_caps.e4m3_native False, e.g. KIE_E4M3_BITS=1): the bits decode on any GPU too, so the
    GPU tests reach the branch an A100 takes."""
    if MX:
        return s
    elif E4B or not cuda_capability_geq(8, 9):   # no fp8e4nv before sm_89: the bits decoded as the tiles do
        return _as_f32(((s >> (8 * HALF)) & 0xFF).to(tl.uint8))
    else:
        return ((s >> (8 * HALF)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _unpack_mma(w):
    """A packing "mma" word back to the checkpoint's nibbles (portable path; weights.checkpoint_bytes per u32)."""
    return ((w >> 4) & 0x08080808) | ((w >> 1) & 0x07070707) | (w & 0x70707070) | ((w << 7) & 0x80808080)


@triton.jit
def _group(acc_a, acc_b, H, X, j: tl.constexpr, MX: tl.constexpr, RP: tl.constexpr = False,
           E4B: tl.constexpr = False):
    """Words j, j + 1 of piece H (rows a, b; mxfp4: j = 0 and all 4 words) into acc += dot x group scale. X = the 16
    x pairs of this lane's 4 words (GPU: zeros unless this lane supplies B)."""
    if _ASM:
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            _MMA_GROUP_R if RP else _MMA_GROUP, "=f,=f,=f,=f" + ",r" * 12,
            [H[j], H[j + 1], H[4 + j], H[5 + j], X[4 * j], X[4 * j + 1], X[4 * j + 2], X[4 * j + 3], X[4 * j + 4],
             X[4 * j + 5], X[4 * j + 6], X[4 * j + 7]],
            dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        if MX:  # words 2-3 continue the chain (two chains measured slower, session 16)
            d0, d1, d2, d3 = tl.inline_asm_elementwise(
                _MMA_GROUP_CR if RP else _MMA_GROUP_C, "=f,=f,=f,=f,f,f,f,f" + ",r" * 12,
                [d0, d1, d2, d3, H[2], H[3], H[6], H[7], X[8], X[9], X[10], X[11], X[12], X[13], X[14], X[15]],
                dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        acc_a += d0 * _group_scale(H[8], j // 2, MX, E4B)
        acc_b += d2 * _group_scale(H[9], j // 2, MX, E4B)
    else:
        da = _word_dot(H[j], X[4 * j], X[4 * j + 1], X[4 * j + 2], X[4 * j + 3], RP)
        da += _word_dot(H[j + 1], X[4 * j + 4], X[4 * j + 5], X[4 * j + 6], X[4 * j + 7], RP)
        db = _word_dot(H[4 + j], X[4 * j], X[4 * j + 1], X[4 * j + 2], X[4 * j + 3], RP)
        db += _word_dot(H[5 + j], X[4 * j + 4], X[4 * j + 5], X[4 * j + 6], X[4 * j + 7], RP)
        if MX:
            da += _word_dot(H[2], X[8], X[9], X[10], X[11], RP) + _word_dot(H[3], X[12], X[13], X[14], X[15], RP)
            db += _word_dot(H[6], X[8], X[9], X[10], X[11], RP) + _word_dot(H[7], X[12], X[13], X[14], X[15], RP)
        acc_a += da * _group_scale(H[8], j // 2, MX, E4B)
        acc_b += db * _group_scale(H[9], j // 2, MX, E4B)
    return acc_a, acc_b


@triton.jit
def _piece_step(a0, a1, c0, c1, H0, H1, xq, x_off, valid, RB: tl.constexpr, MX: tl.constexpr,
                RP: tl.constexpr = False, E4B: tl.constexpr = False):
    """One piece (4 words per lane) for row block 0 (H0; accumulators a0 / a1 = rows r / r + 8) and, when RB == 2,
    block 1 (H1; c0 / c1); x loaded once for both (GPU: only by the lanes that supply B, `valid` says so)."""
    X = _ld_x(xq + 4 * x_off, valid) + _ld_x(xq + 4 * x_off + 8, valid)
    a0, a1 = _group(a0, a1, H0, X, 0, MX, RP, E4B)
    if RB == 2:
        c0, c1 = _group(c0, c1, H1, X, 0, MX, RP, E4B)
    if not MX:
        a0, a1 = _group(a0, a1, H0, X, 2, MX, RP, E4B)
        if RB == 2:
            c0, c1 = _group(c0, c1, H1, X, 2, MX, RP, E4B)
    return a0, a1, c0, c1


@triton.jit
def _quad_sum(v, NW: tl.constexpr):
    """The sum over each quad of lanes, given back to all 4 (GPU: two butterfly shuffles)."""
    if _ASM:
        return tl.inline_asm_elementwise(
            "{\n.reg .f32 t;\nshfl.sync.bfly.b32 t, $1, 1, 0x1f, 0xffffffff;\nadd.f32 t, t, $1;\n"
            "shfl.sync.bfly.b32 $0, t, 2, 0x1f, 0xffffffff;\nadd.f32 $0, $0, t;\n}",
            "=f,f", [v], dtype=tl.float32, is_pure=True, pack=1)
    else:
        s = tl.sum(tl.reshape(v, (NW * 8, 4)), axis=1)
        return tl.reshape(tl.broadcast_to(s[:, None], (NW * 8, 4)), (NW * 32,))


@triton.jit
def _step_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, MX: tl.constexpr):
    return (_piece_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, 0, MX),
            _piece_load(wq, sq, ra, rb, swn, stride_sn, st, q, KW, KG, 1, MX))


@triton.jit
def fp4_rows_first(wq0, sq0, ra0, rb0, wq1, sq1, ra1, rb1, swn, stride_sn, q, KW, KG, st_lo, RB: tl.constexpr,
                   MX: tl.constexpr):
    """fp4_rows_dot's first step of loads (its `first` argument), codes and scales: weights never depend on
    activations, so a caller that must wait for its input (the monokernel's tasks, monokernel/mma8.py) issues these
    before the wait. st_lo may be a per-lane tensor (fp4_rows_dot's st_base + st_lo)."""
    P0 = _step_load(wq0, sq0, ra0, rb0, swn, stride_sn, st_lo, q, KW, KG, MX)
    P1 = P0
    if RB == 2:
        P1 = _step_load(wq1, sq1, ra1, rb1, swn, stride_sn, st_lo, q, KW, KG, MX)
    return P0, P1


@triton.jit
def fp4_rows_dot(xq, wq0, sq0, ra0, rb0, wq1, sq1, ra1, rb1, swn, stride_sn, q, KW, KG, mine, st_lo, st_hi,
                 RB: tl.constexpr, MX: tl.constexpr, RP: tl.constexpr, E4B: tl.constexpr, first, st_base=0):
    """One warp's rows against xh (u32 view xq) over 256-code steps [st_lo, st_hi) of K (all of K: 0,
    cdiv(KW, 32); an empty range gives zeros), the next step's loads issued before the current step's mma:
    block 0 = rows ra0 / rb0 of wq0 (scales sq0), block 1 (RB == 2) = rows ra1 / rb1 of wq1 / sq1 (the GEMV: the
    next 16 rows; the expert GLU: the up rows beside the gate rows); first = fp4_rows_first(...) of the same rows
    and st_base + st_lo. st_base (a per-lane tensor allowed: each warp its own K range, the loop bounds staying
    scalar) offsets every step; steps past K load clamped words against x masked to zero. Returns each lane's
    unscaled partial sums (block 0 rows a, b; block 1 rows a, b), not yet summed over the quad. (An L2 prefetch of
    the rows 2-4 steps ahead was measured 3-20 points slower: NOTES.md session 19.)"""
    zero = tl.zeros(q.shape, tl.float32)
    # Accumulators: a / c rows r, r + 8 of blocks 0 / 1 from piece 0, e / f the same from piece 1.
    a0, a1, c0, c1, e0, e1, f0, f1 = zero, zero, zero, zero, zero, zero, zero, zero
    P0, P1 = first
    for st in range(st_lo, st_hi):
        sn = st_base + tl.minimum(st + 1, st_hi - 1)
        C0 = P0
        P0 = _step_load(wq0, sq0, ra0, rb0, swn, stride_sn, sn, q, KW, KG, MX)
        if RB == 2:
            C1 = P1
            P1 = _step_load(wq1, sq1, ra1, rb1, swn, stride_sn, sn, q, KW, KG, MX)
        else:
            C1 = C0
        x_off = 32 * (st_base + st) + 4 * q
        a0, a1, c0, c1 = _piece_step(a0, a1, c0, c1, C0[0], C1[0], xq, x_off, (x_off < KW) & mine, RB, MX, RP,
                                     E4B)
        e0, e1, f0, f1 = _piece_step(e0, e1, f0, f1, C0[1], C1[1], xq, x_off + 16, (x_off + 16 < KW) & mine, RB,
                                     MX, RP, E4B)
    return a0 + e0, a1 + e1, c0 + f0, c1 + f1


@triton.jit
def _rows_dot(xq, wq0, sq0, ra0, rb0, wq1, sq1, ra1, rb1, swn, stride_sn, q, KW, KG, mine, st_lo, st_hi,
              RB: tl.constexpr, MX: tl.constexpr, RP: tl.constexpr, E4B: tl.constexpr):
    """fp4_rows_dot with its first loads issued here (the GEMV's and the expert kernels' loop)."""
    first = fp4_rows_first(wq0, sq0, ra0, rb0, wq1, sq1, ra1, rb1, swn, stride_sn, q, KW, KG, st_lo, RB, MX)
    return fp4_rows_dot(xq, wq0, sq0, ra0, rb0, wq1, sq1, ra1, rb1, swn, stride_sn, q, KW, KG, mine, st_lo, st_hi,
                        RB, MX, RP, E4B, first)


@triton.jit
def _mine(r, q):
    if _ASM:
        return r == 2 * q     # the lanes whose x goes into B (column 2q)
    else:
        return r >= 0         # portable: every lane dots its own words itself


@triton.jit
def _global_factor(gs_ptr, MX: tl.constexpr):
    """The decode's 2^-14 (mxfp4: already in the scales) and nvfp4's global scale at gs_ptr, once per row."""
    if MX:
        return 1.0
    else:
        return 16384.0 / tl.load(gs_ptr).to(tl.float32)


@triton.jit
def _fp4_mma_kernel(xh_ptr, w_ptr, stride_wn, s_ptr, stride_sn, gs_ptr, bias_ptr, res_ptr, y_ptr, N, K,
                    MX: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RB: tl.constexpr,
                    NW: tl.constexpr, RP: tl.constexpr = False, PDL: tl.constexpr = False,
                    E4B: tl.constexpr = False):
    """grid (cdiv(N, 16 * RB * NW),): y = W @ x for fp4 W [N, K/2] u8 with group scales [N, K/16] e4m3 (nvfp4) or
    [N, K/32] E8M0 (mxfp4, MX), xh from prepare_xh, K % 32 == 0; RP: W's bytes in packing "mma". Each warp owns
    16 * RB rows and the whole K (_rows_dot, module docstring)."""
    pdl_begin(PDL)
    lane, warp = _lane_warp(NW)
    r = lane >> 2
    q = lane & 3
    base = (tl.program_id(0) * NW + warp) * (16 * RB)
    wq = w_ptr.to(tl.pointer_type(tl.uint32))
    sq = s_ptr.to(tl.pointer_type(tl.uint8))
    ra0 = tl.minimum(base + r, N - 1).to(tl.int64)
    rb0 = tl.minimum(base + r + 8, N - 1).to(tl.int64)
    ra1 = tl.minimum(base + 16 + r, N - 1).to(tl.int64)
    rb1 = tl.minimum(base + 24 + r, N - 1).to(tl.int64)
    y0, y1, y2, y3 = _rows_dot(xh_ptr.to(tl.pointer_type(tl.uint32)), wq, sq, ra0, rb0, wq, sq, ra1, rb1,
                               stride_wn // 4, stride_sn, q, K // 8, K // 32 if MX else K // 16, _mine(r, q), 0,
                               tl.cdiv(K // 8, 32), RB, MX, RP, E4B)
    g = _global_factor(gs_ptr, MX)
    lead = q == 0     # one lane per quad stores
    n = base + r
    _store_out(_quad_sum(y0, NW) * g, n, lead & (n < N), y_ptr, bias_ptr, res_ptr, HAS_BIAS, HAS_RES)
    _store_out(_quad_sum(y1, NW) * g, n + 8, lead & (n + 8 < N), y_ptr, bias_ptr, res_ptr, HAS_BIAS, HAS_RES)
    if RB == 2:
        _store_out(_quad_sum(y2, NW) * g, n + 16, lead & (n + 16 < N), y_ptr, bias_ptr, res_ptr, HAS_BIAS,
                   HAS_RES)
        _store_out(_quad_sum(y3, NW) * g, n + 24, lead & (n + 24 < N), y_ptr, bias_ptr, res_ptr, HAS_BIAS,
                   HAS_RES)


def check_xh(xh: torch.Tensor | None, K: int, dev: torch.device, who: str):
    """An xh buffer (prepare_xh's layout) for a K-long vector: a contiguous, 16-byte aligned fp16 [K] on dev, K % 16
    == 0 (xh_pos moves elements within groups of 8: a ragged last group would be written past K)."""
    if xh is not None and K % 16:
        raise ValueError(f"{who}: the xh layout needs K % 16 == 0 (prepare_xh's rule), got K = {K}")
    if xh is not None and (xh.shape != (K,) or xh.dtype != torch.float16 or not xh.is_contiguous()
                           or xh.data_ptr() % 16 or xh.device != dev):
        raise ValueError(f"{who} must be a contiguous, 16-byte aligned fp16 [{K}] on {dev}, got {xh.dtype} "
                         f"{tuple(xh.shape)}")


def prepare_xh(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               out: torch.Tensor | None = None, natural: bool = False) -> torch.Tensor:
    """The mma GEMV's input: fp16 [K], each 8 elements in the order 0, 2, 1, 3, 4, 6, 5, 7 (natural: in order, for
    kernels/fp8_mma.py), RMS-normalised with norm_weight when given, then rounded to fp16 once. One small launch,
    like prepare_x8."""
    K = x.shape[-1]
    if K % 16 or x.numel() != K:
        raise ValueError(f"prepare_xh: x shape {tuple(x.shape)}: need batch 1 and K % 16 == 0")
    check_vec(norm_weight, K, x.device, "norm_weight")
    if out is None:
        out = torch.empty(K, dtype=torch.float16, device=x.device)
    check_xh(out, K, x.device, "prepare_xh: out")
    BLOCK = min(1024, triton.next_power_of_2(K))
    _xh_kernel[(triton.cdiv(K, BLOCK),)](x, norm_weight if norm_weight is not None else x, out, K, eps,
                                         HAS_NW=norm_weight is not None, BLOCK=BLOCK,
                                         BLOCK_X=rstd_block(K), NATURAL=natural, **launch_kw(x.device))
    return out


def rows_unreadable(w: WeightHandle, formats: tuple[str, ...], k_multiple: int) -> str | None:
    """The checks every tensor-core GEMV of this kind makes (this one and fp8_mma's): one of `formats`, one Linear,
    in_features a multiple of k_multiple (whole 16-byte row pieces), rows contiguous and 16-byte aligned."""
    if w.fmt not in formats:
        return f"weight format {w.fmt!r}, expected " + " or ".join(repr(f) for f in formats)
    if w.num_experts:
        return "weight handle is an expert stack"
    if w.in_features % k_multiple:
        return f"in_features {w.in_features} is not a multiple of {k_multiple} (16-byte row pieces)"
    if w.weight.stride(-1) != 1 or w.weight.stride(-2) % 16 or w.weight.data_ptr() % 16:
        return "weight rows must be contiguous and 16-byte aligned"
    return None


def xh_input(x: torch.Tensor, xh: torch.Tensor | None, K: int, norm_weight: torch.Tensor | None, eps: float,
             natural: bool = False) -> torch.Tensor:
    """A tensor-core GEMV's xh: the caller's, checked, or prepare_xh(x, norm_weight, eps, natural=natural)."""
    if xh is None:
        return prepare_xh(x, norm_weight, eps, natural=natural)
    check_xh(xh, K, x.device, "xh (prepare_xh(natural=True)'s)" if natural else "xh (prepare_xh's)")
    return xh


def mma_unreadable(w: WeightHandle) -> str | None:
    """Why the mma kernel cannot read w, or None (an nvfp4 / mxfp4 Linear, K % 32 == 0, 16-byte aligned rows)."""
    why = rows_unreadable(w, ("nvfp4", "mxfp4"), 32)
    if why:
        return why
    if w.scale.stride(-1) != 1:
        return f"weight_scale must be contiguous along in_features, stride {w.scale.stride()}"
    if w.fmt == "nvfp4" and (w.scale.data_ptr() % 2 or w.scale.stride(-2) % 2):
        return "weight_scale rows must be 2-byte aligned (one u16 load per two nvfp4 groups)"
    return None


def gemv_fp4_mma(x: torch.Tensor, w: WeightHandle, *, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6, xh: torch.Tensor | None = None,
                 row_blocks: int = MMA_ROW_BLOCKS, num_warps: int = MMA_WARPS,
                 maxnreg: int | None = MMA_MAXNREG) -> torch.Tensor:
    """y = W @ x (+ bias) (+ residual) for one nvfp4 / mxfp4 Linear on the tensor cores (module docstring). Same
    contract as kernels.gemv.gemv; xh = prepare_xh(x, norm_weight, eps) when already made (else made here).
    maxnreg: the register cap of the launch on CUDA (None: ptxas's choice)."""
    why = mma_unreadable(w)
    if why:
        raise ValueError(f"gemv_fp4_mma: {why}")
    N, K = w.out_features, w.in_features
    if row_blocks not in (1, 2) or num_warps not in (1, 2, 4, 8):
        raise ValueError(f"gemv_fp4_mma: row_blocks {row_blocks} (1 or 2), num_warps {num_warps} (1, 2, 4, 8)")
    check_x(x, K, w.device)
    check_vec(bias, N, w.device, "bias")
    check_vec(residual, N, w.device, "residual")
    y = make_out(x, N, out)
    xh = xh_input(x, xh, K, norm_weight, eps)
    cap = reg_cap(x.device, maxnreg)
    _fp4_mma_kernel[(triton.cdiv(N, 16 * row_blocks * num_warps),)](
        xh, w.weight, w.weight.stride(-2), w.scale.view(torch.uint8), w.scale.stride(-2),
        w.global_scale if w.global_scale is not None else y,
        bias if bias is not None else y, residual if residual is not None else y, y, N, K,
        MX=w.fmt == "mxfp4", HAS_BIAS=bias is not None, HAS_RES=residual is not None, RB=row_blocks, NW=num_warps,
        num_warps=num_warps, RP=w.packing == "mma", E4B=not e4m3_native(x.device),
        **launch_kw(x.device), **cap)
    return y


def mma_experts_unreadable(w: WeightHandle) -> str | None:
    """Why the tensor-core expert kernels (fp4_mma_experts) cannot read the expert stack w, or None (nvfp4 / mxfp4
    [E, out, in], in % 32 == 0, each expert's rows 16-byte aligned)."""
    if not w.num_experts:
        return "weight handle is not an expert stack"
    if w.weight.stride(0) % 16 or (w.fmt == "nvfp4" and w.scale.stride(0) % 2):
        return "expert stride not 16-byte aligned (codes) / 2-byte aligned (nvfp4 scales)"
    return mma_unreadable(w.expert(0))


def pack_for_mma(w: WeightHandle) -> WeightHandle:
    """w (nvfp4 / mxfp4, checkpoint bytes; one Linear or an expert stack) as packing "mma": a new code tensor (same
    strides) re-laid for the tensor-core loop's cheaper decode (one AND for the low plane), same scales. Done once at
    load for a weight only the tensor-core kernels read (the graph backend's lm_head and its tensor-core routed
    experts): H200, 65536 x 8192 nvfp4 83.1 -> 86.1% of the probe (NOTES.md session 13)."""
    why = mma_experts_unreadable(w) if w.num_experts else mma_unreadable(w)
    if why:
        raise ValueError(f"pack_for_mma: {why}")
    if w.packing == "mma":
        return w
    # In row chunks (per expert): mma_bytes' temporaries are a few times their input (an lm_head's codes are
    # 150-300 MB, a Mixtral layer's expert stack ~230 MB).
    out = torch.empty_like(w.weight)
    for src, dst in (zip(w.weight, out) if w.num_experts else ((w.weight, out),)):
        for r in range(0, w.out_features, _PACK_ROWS):
            dst[r:r + _PACK_ROWS] = mma_bytes(src[r:r + _PACK_ROWS])
    return dataclasses.replace(w, weight=out, packing="mma")


_PACK_ROWS = 8192

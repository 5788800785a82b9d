"""nvfp4 GEMV tile on tensor cores: the codes decoded to f16, the dot product done by mma (tl.dot), not by FMAs.

Why: the FMA tile (tiles.py `_tile_nvfp4`) is ALU-bound at ~61% of the read ceiling on an H200: per u32 word of
8 codes it spends 7 integer ops + 4 byte permutes + 8 f16->f32 converts + 8 FFMAs + sums, ~8.3 SASS instructions
per byte against ~7.4 that an SM can issue at full bandwidth. Here a pair of words costs 14 integer ops + 8 byte
permutes (the same byte-plane decode, left as f16x2) + 8 HMUL2 (the group scale); the multiply-adds and the
reduction over K go to the tensor cores (fp32 accumulation).

Same contract as `_tile_nvfp4` (tiles.py: rows n_start .. n_start + BLOCK_N, x in the x8 layout, k_lo a multiple
of BLOCK_K) -> [BLOCK_N] fp32; BLOCK_N >= 16 and BLOCK_K >= 128 (a dot needs 16 in every dimension).

Exactness: a code's f16 is 2^-14 x its e2m1 value (the byte-plane trick), the scale enters as f16 2^7 x e4m3; their
product has <= 6 significant bits and lies in [2^-17, 21]: exact in f16 (subnormals included). x enters the dot as
f16 x * 2^-6 (rounded to 11 bits like any half-precision activation; overflow only beyond |x| ~ 4e6); products are
exact in the mma and sums are fp32. The caller-visible result is scaled back by 2^13 / global scale.

Layout of one decode: the asm takes two adjacent words (pack=2: j even, so both lie in the same 16-code scale
group) and returns 8 f16x2 "planes": planes 0-3 hold pairs of word j's codes (elements (0,2), (4,6), (1,3), (5,7)),
planes 4-7 word j+1's. Plane p's element at word position i is then code ELEM[p % 4][i % 2] of word
i - i % 2 + p // 4, and x is gathered from x8 in exactly that order: each plane is one [16, KW] x [KW, BLOCK_N]
dot (the order of K inside a dot is free). The torch reference is the same as `_tile_nvfp4`'s: gemv_ref on
dequantized weights (kernels/weights.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

import os

import torch

from .tiles import _ASM, _row_ptrs

# Elements of a word in planes 0-3 (and, for the odd word of the pair, 4-7): (low half, high half) of each f16x2.
ELEM = ((0, 2), (4, 6), (1, 3), (5, 7))
X_SHIFT = 2.0 ** -6     # x enters the dot as f16 x * 2^-6 (module docstring)
# A/B switch of the measurement in benchmarks/NOTES.md: one dot over the 8 joined planes (1) or 8 dots (0).
_JOIN = tl.constexpr(os.environ.get("KIE_MMA_JOIN", "1") == "1")


def x_planes(x8: torch.Tensor) -> torch.Tensor:
    """The mma tile's input: f16 [8, K/8], xh[p, i] = x8[e, w] * 2^-6 with w = i - i % 2 + p // 4 and
    e = ELEM[p % 4][i % 2] (plane p's code at word position i). x8: prepare_x8's fp32 [8, K/8]."""
    kw = x8.shape[1]
    i = torch.arange(kw, device=x8.device)
    p = torch.arange(8, device=x8.device)[:, None]
    e = torch.tensor(ELEM, device=x8.device)[p % 4, (i % 2)[None, :]]
    w = (i - i % 2)[None, :] + p // 4
    return (x8[e, w.clamp(max=kw - 1)] * X_SHIFT).to(torch.float16)

# $0..$7 outputs (f16x2 planes), $8 / $9 words j / j+1, $10 the scale pair (f16x2, s * 2^7, same for both words).
_PLANES_PTX = tl.constexpr("""{
.reg .b32 t, u, la, ha, lb, hb, z;
mov.b32 z, 0;
shl.b32 t, $8, 4;
and.b32 t, t, 0x80808080;
shl.b32 u, $8, 1;
and.b32 u, u, 0x0E0E0E0E;
or.b32 la, t, u;
shr.b32 t, $8, 3;
and.b32 t, t, 0x0E0E0E0E;
and.b32 u, $8, 0x80808080;
or.b32 ha, t, u;
shl.b32 t, $9, 4;
and.b32 t, t, 0x80808080;
shl.b32 u, $9, 1;
and.b32 u, u, 0x0E0E0E0E;
or.b32 lb, t, u;
shr.b32 t, $9, 3;
and.b32 t, t, 0x0E0E0E0E;
and.b32 u, $9, 0x80808080;
or.b32 hb, t, u;
prmt.b32 $0, la, z, 0x1404;
prmt.b32 $1, la, z, 0x3424;
prmt.b32 $2, ha, z, 0x1404;
prmt.b32 $3, ha, z, 0x3424;
prmt.b32 $4, lb, z, 0x1404;
prmt.b32 $5, lb, z, 0x3424;
prmt.b32 $6, hb, z, 0x1404;
prmt.b32 $7, hb, z, 0x3424;
mul.rn.f16x2 $0, $0, $10;
mul.rn.f16x2 $1, $1, $10;
mul.rn.f16x2 $2, $2, $10;
mul.rn.f16x2 $3, $3, $10;
mul.rn.f16x2 $4, $4, $10;
mul.rn.f16x2 $5, $5, $10;
mul.rn.f16x2 $6, $6, $10;
mul.rn.f16x2 $7, $7, $10;
}""")


_E0 = tl.constexpr((0, 4, 1, 5))          # ELEM's columns, for the portable decode
_E1 = tl.constexpr((2, 6, 3, 7))


@triton.jit
def plane_offs(k, kw):
    """Where x[k] goes in x_planes' layout (flat offset into [8, kw]): word w = k // 8, element e = k % 8 sit in
    plane 4 (w % 2) + 2 (e % 2) + e // 4 at position w - w % 2 + (e // 2) % 2 (ELEM inverted)."""
    w = k // 8
    e = k % 8
    return (4 * (w % 2) + 2 * (e % 2) + e // 4) * kw + w - w % 2 + (e // 2) % 2


@triton.jit
def _code_f16(q, e: tl.constexpr):
    """Element e of each word as f16, 2^-14 x its e2m1 value (the portable form of the asm's byte planes)."""
    n = (q >> (4 * e)) & 0xF
    b = ((n & 0x8) << 4) | ((n & 0x7) << 1)                          # the e5m2 byte s000eem0
    return (b << 8).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _plane_ref(qe, qo, sc, p: tl.constexpr, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """Plane p of the words, portable (interpreter): qe / qo [BN, KW/2] the even / odd words of each pair."""
    if p < 4:
        src = qe
    else:
        src = qo
    v = tl.reshape(tl.join(_code_f16(src, _E0[p % 4]), _code_f16(src, _E1[p % 4])), (BLOCK_N, KW))
    return v * sc


@triton.jit
def _decode(q, sc, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """8 planes [BN, KW] f16 of words q [BN, KW] u32, each times sc [BN, KW] f16 (2^7 x the group scale)."""
    if _ASM:
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            _PLANES_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [q, sc], dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    else:
        qe, qo = tl.split(tl.reshape(q, (BLOCK_N, KW // 2, 2)))
        p0 = _plane_ref(qe, qo, sc, 0, BLOCK_N, KW)
        p1 = _plane_ref(qe, qo, sc, 1, BLOCK_N, KW)
        p2 = _plane_ref(qe, qo, sc, 2, BLOCK_N, KW)
        p3 = _plane_ref(qe, qo, sc, 3, BLOCK_N, KW)
        p4 = _plane_ref(qe, qo, sc, 4, BLOCK_N, KW)
        p5 = _plane_ref(qe, qo, sc, 5, BLOCK_N, KW)
        p6 = _plane_ref(qe, qo, sc, 6, BLOCK_N, KW)
        p7 = _plane_ref(qe, qo, sc, 7, BLOCK_N, KW)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _join8(a0, a1, a2, a3, a4, a5, a6, a7):
    """[R, C] x 8 -> [R, 8C], element (r, 8c + j) = a_j[r, c] up to a fixed permutation of j (the same for weights
    and x, so one dot covers all 8 planes)."""
    j = tl.join(tl.join(tl.join(a0, a1), tl.join(a2, a3)), tl.join(tl.join(a4, a5), tl.join(a6, a7)))
    return tl.reshape(j, (a0.shape[0], 8 * a0.shape[1]))


@triton.jit
def _x_load(xh_ptr, stride_xh, w0, w_hi, KW: tl.constexpr):
    """x of the step whose first word is w0, as [1, 8 KW] f16 in _join8's order of the planes (xh: x_planes)."""
    i = tl.multiple_of(w0, 16) + tl.arange(0, KW)
    m = i < w_hi
    x0 = tl.load(xh_ptr + i, mask=m, other=0.0)[None, :]
    x1 = tl.load(xh_ptr + stride_xh + i, mask=m, other=0.0)[None, :]
    x2 = tl.load(xh_ptr + 2 * stride_xh + i, mask=m, other=0.0)[None, :]
    x3 = tl.load(xh_ptr + 3 * stride_xh + i, mask=m, other=0.0)[None, :]
    x4 = tl.load(xh_ptr + 4 * stride_xh + i, mask=m, other=0.0)[None, :]
    x5 = tl.load(xh_ptr + 5 * stride_xh + i, mask=m, other=0.0)[None, :]
    x6 = tl.load(xh_ptr + 6 * stride_xh + i, mask=m, other=0.0)[None, :]
    x7 = tl.load(xh_ptr + 7 * stride_xh + i, mask=m, other=0.0)[None, :]
    return _join8(x0, x1, x2, x3, x4, x5, x6, x7)


@triton.jit
def _x_loads(xh_ptr, stride_xh, w0, w_hi, KW: tl.constexpr):
    """The 8 x planes of a step, [KW, 16] f16 each (the B operands of 8 separate dots)."""
    i = tl.multiple_of(w0, 16) + tl.arange(0, KW)
    m = i < w_hi
    x0 = tl.broadcast_to(tl.load(xh_ptr + i, mask=m, other=0.0)[:, None], (KW, 16))
    x1 = tl.broadcast_to(tl.load(xh_ptr + stride_xh + i, mask=m, other=0.0)[:, None], (KW, 16))
    x2 = tl.broadcast_to(tl.load(xh_ptr + 2 * stride_xh + i, mask=m, other=0.0)[:, None], (KW, 16))
    x3 = tl.broadcast_to(tl.load(xh_ptr + 3 * stride_xh + i, mask=m, other=0.0)[:, None], (KW, 16))
    x4 = tl.broadcast_to(tl.load(xh_ptr + 4 * stride_xh + i, mask=m, other=0.0)[:, None], (KW, 16))
    x5 = tl.broadcast_to(tl.load(xh_ptr + 5 * stride_xh + i, mask=m, other=0.0)[:, None], (KW, 16))
    x6 = tl.broadcast_to(tl.load(xh_ptr + 6 * stride_xh + i, mask=m, other=0.0)[:, None], (KW, 16))
    x7 = tl.broadcast_to(tl.load(xh_ptr + 7 * stride_xh + i, mask=m, other=0.0)[:, None], (KW, 16))
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _mma_step8(acc, q, s, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """_mma_step as 8 dots of K = KW (one per plane) instead of one joined dot."""
    sc = tl.reshape(tl.broadcast_to((s.to(tl.float16) * 128.0)[:, :, None], (BLOCK_N, KW // 2, 2)), (BLOCK_N, KW))
    p0, p1, p2, p3, p4, p5, p6, p7 = _decode(q, sc, BLOCK_N, KW)
    acc = tl.dot(p0, x0, acc)
    acc = tl.dot(p1, x1, acc)
    acc = tl.dot(p2, x2, acc)
    acc = tl.dot(p3, x3, acc)
    acc = tl.dot(p4, x4, acc)
    acc = tl.dot(p5, x5, acc)
    acc = tl.dot(p6, x6, acc)
    acc = tl.dot(p7, x7, acc)
    return acc


@triton.jit
def _mma_step(acc, q, s, xr, BLOCK_N: tl.constexpr, KW: tl.constexpr):
    """acc [BN, 16] += W_step . x: q [BN, KW] words, s [BN, KW // 2] e4m3 group scales, xr [1, 8 KW] (_x_load).
    The 8 decoded planes are joined along K into one [BN, 8 KW] A operand: one dot (one operand staging) a step."""
    sc = tl.reshape(tl.broadcast_to((s.to(tl.float16) * 128.0)[:, :, None], (BLOCK_N, KW // 2, 2)), (BLOCK_N, KW))
    p0, p1, p2, p3, p4, p5, p6, p7 = _decode(q, sc, BLOCK_N, KW)
    a = _join8(p0, p1, p2, p3, p4, p5, p6, p7)
    xb = tl.broadcast_to(tl.trans(xr), (8 * KW, 16))
    return tl.dot(a, xb, acc)


@triton.jit
def _tile_nvfp4_mma(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr, xh_ptr, stride_xh, n_start, N, k_lo,
                    k_hi, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPE: tl.constexpr):
    """nvfp4 rows n_start .. + BLOCK_N dotted with x8 over [k_lo, k_hi) -> [BLOCK_N] fp32 (tiles.py's contract;
    PIPE is accepted for it, the loop always loads one step ahead)."""
    KW: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 16
    w_rows = _row_ptrs(w_ptr.to(tl.pointer_type(tl.uint32)), stride_wn // 4, n_start, N, BLOCK_N)
    s_rows = (tl.minimum(n_start + tl.arange(0, BLOCK_N), N - 1) * stride_sn)[:, None]
    offs_w = tl.arange(0, KW)
    offs_g = tl.arange(0, G)
    w_hi = k_hi >> 3
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    n_steps = (k_hi - k_lo + BLOCK_K - 1) // BLOCK_K
    q_next = tl.load(w_rows + ((k_lo >> 3) + offs_w)[None, :], mask=((k_lo >> 3) + offs_w < w_hi)[None, :], other=0)
    s_next = tl.load(s_ptr + (s_rows + ((k_lo >> 4) + offs_g)[None, :] * stride_sk),
                     mask=((k_lo >> 4) + offs_g < (k_hi >> 4))[None, :], other=0.0)
    if _JOIN:
        x_next = _x_load(xh_ptr, stride_xh, k_lo >> 3, w_hi, KW)
    else:
        x0n, x1n, x2n, x3n, x4n, x5n, x6n, x7n = _x_loads(xh_ptr, stride_xh, k_lo >> 3, w_hi, KW)
    for it in range(n_steps):   # step i+1's words, scales and x load before step i's decode (PIPE or not)
        w0 = (k_lo >> 3) + it * KW
        q = q_next
        s = s_next
        wn = tl.multiple_of(w0 + KW + offs_w, 16)
        gn = tl.multiple_of((w0 + KW) // 2 + offs_g, 8)
        q_next = tl.load(w_rows + wn[None, :], mask=(wn < w_hi)[None, :], other=0)
        s_next = tl.load(s_ptr + (s_rows + gn[None, :] * stride_sk), mask=(gn < (k_hi >> 4))[None, :], other=0.0)
        if _JOIN:
            xr = x_next
            x_next = _x_load(xh_ptr, stride_xh, w0 + KW, w_hi, KW)
            acc = _mma_step(acc, q, s, xr, BLOCK_N, KW)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7 = x0n, x1n, x2n, x3n, x4n, x5n, x6n, x7n
            x0n, x1n, x2n, x3n, x4n, x5n, x6n, x7n = _x_loads(xh_ptr, stride_xh, w0 + KW, w_hi, KW)
            acc = _mma_step8(acc, q, s, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N, KW)
    y = tl.sum(tl.where((tl.arange(0, 16) == 0)[None, :], acc, 0.0), axis=1)     # every x column is the same
    # 2^13 = 2^14 (the code's f16) / 2^7 (the scale's) * 2^6 (x's); 1 / global scale per Linear
    return y * (8192.0 / tl.load(gs_ptr).to(tl.float32))

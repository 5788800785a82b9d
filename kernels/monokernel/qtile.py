"""Weight tiles of every format for the monokernel's streams (stream.py): load one [BLOCK_N, BLOCK_K] tile
(`qload`, issued a tile ahead) and do its FMAs against x (`qstep`). FMT (kernels/tiles.py's FMT_ID):

  0 float (bf16/fp16/fp32)  w [N, K]                         acc += w . x
  1 fp8 (per-row scale)     e4m3 [N, K]                      acc += w . x; the row scale in the epilogue (F)
  2 fp8-block               e4m3 [N, K], scale per (row, 128-column block): the planner stores the 128x128
                            block scales expanded to one row of ceil(K/128) per weight row (3% more bytes, any
                            row tiling); acc [BN, BK/G] += per-block dots * scale
  3 nvfp4                   packed e2m1 as u32 words [N, K/8], e4m3 group-16 scales [N, K/16]; 2^14 / global
                            scale is a per-row factor (F) in the epilogue
  4 mxfp4                   packed e2m1 words, E8M0 group-32 scales [N, K/32]: 2^(e-127) * 2^14 built as fp32 bits

fp4 reuses kernels/tiles.py's word decoder (`_e2m1_word`: 8 codes per u32 in a few integer ops, each value
times 2^-14) and broadcast loads; x is read in its natural layout with stride 8 (element e of word j is
x[8j + e]) instead of tiles.py's x8 layout, which would need every producer of x to write a second copy.
The torch reference of every format is kernels.weights.dequantize / quant.schemes (the tests compare whole
decode steps against the reference decoder on dequantized weights).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kie_moe.kernels.tiles import _as_f32, _bcast_load, _e2m1_word


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
def qzeros(FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, XB: tl.constexpr):
    """The accumulator of a row chunk (acc_total() turns it into per-row sums)."""
    if FMT >= 3:
        z = tl.zeros((BLOCK_N, BLOCK_K // (16 if FMT == 3 else 32)), dtype=tl.float32)
    elif FMT == 2:
        z = tl.zeros((BLOCK_N, BLOCK_K // min(BLOCK_K, 128)), dtype=tl.float32)
    elif XB:
        z = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    else:
        z = tl.zeros((BLOCK_N,), dtype=tl.float32)
    return z


@triton.jit
def sszeros(FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
            XB: tl.constexpr):
    """The RMSNorm sum-of-squares accumulator (x rows are replicated ss_rows() times in it)."""
    if FMT >= 3:
        z = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    elif XB:
        z = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    else:
        z = tl.zeros((1,), dtype=tl.float32)
    return z


@triton.jit
def acc_total(acc):
    """Per-row totals [R] of an accumulator ([R] already, or [R, columns])."""
    if len(acc.shape) == 2:
        t = tl.sum(acc, axis=1)
    else:
        t = acc
    return t


@triton.jit
def qload(w_ptr, s_ptr, rows, rmask, k0, K, FMT: tl.constexpr, BLOCK_K: tl.constexpr):
    """(weights, scales) of the tile at rows x [k0, k0 + BLOCK_K); masked rows / columns load nothing.
    w_ptr points at element (or byte / u32 word, for quantized formats) 0 of the matrix."""
    r64 = rows.to(tl.int64)[:, None]
    if FMT <= 2:
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + r64 * K + cols[None, :], mask=rmask[:, None] & (cols < K)[None, :], other=0.0)
        if FMT == 2:
            G: tl.constexpr = min(BLOCK_K, 128)
            nkb = (K + 127) // 128
            offs_g = k0 // 128 + tl.arange(0, BLOCK_K // G)
            s = tl.load(s_ptr + r64 * nkb + offs_g[None, :], mask=rmask[:, None] & (offs_g < nkb)[None, :],
                        other=0.0)
        else:
            s = tl.zeros((1, 1), dtype=tl.float32)     # unused
    else:
        GROUP: tl.constexpr = 16 if FMT == 3 else 32
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        w = tl.load(w_ptr + r64 * (K // 8) + offs_w[None, :], mask=rmask[:, None] & (offs_w < K // 8)[None, :],
                    other=0)
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        s_mask = rmask[:, None] & (offs_g < K // GROUP)[None, :]
        if FMT == 3:   # e4m3 scales
            s = tl.load(s_ptr + r64 * (K // GROUP) + offs_g[None, :], mask=s_mask, other=0.0)
        else:          # E8M0 bytes
            s = tl.load(s_ptr + r64 * (K // GROUP) + offs_g[None, :], mask=s_mask, other=0)
    return w, s


@triton.jit
def qdot(acc, w, s, x, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
         XB: tl.constexpr):
    """acc += W_tile . x for an already loaded x tile (float / fp8 / fp8-block): lets a gate/up pair share x."""
    p = _as_f32(w) * x
    if FMT == 2:
        G: tl.constexpr = min(BLOCK_K, 128)
        acc += tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // G, G)), axis=2) * s
    else:
        acc = mac(acc, p, VEC, XB)
    return acc


@triton.jit
def x_words(x_ptr, offs_w, wm, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[8j + e] for the words j = offs_w of an e2m1 tile, e = 0..7, each [BLOCK_N, BLOCK_K // 8] fp32 (broadcast
    over the rows): ONE contiguous [words, 8] load (two 16-byte vectors per word) split into the 8 planes, instead
    of 8 stride-8 loads (measured: those left the nvfp4 stream at 8-11% of the probe)."""
    W: tl.constexpr = BLOCK_K // 8
    offs = offs_w[:, None] * 8 + tl.arange(0, 8)[None, :]
    v = tl.load(x_ptr + offs, mask=wm[:, None] & (offs >= 0), other=0.0).to(tl.float32)       # [W, 8]
    v = tl.broadcast_to(v[None, :, :], (BLOCK_N, W, 8))
    a, b = tl.split(tl.reshape(v, (BLOCK_N, W, 4, 2)))          # e even / odd
    a0, a1 = tl.split(tl.reshape(a, (BLOCK_N, W, 2, 2)))        # e = 0, 4 | 2, 6
    b0, b1 = tl.split(tl.reshape(b, (BLOCK_N, W, 2, 2)))        # e = 1, 5 | 3, 7
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def qstep(acc, ss, w, s, x_ptr, nw_ptr, xs, k0, K, do_ss, NORM: tl.constexpr, FMT: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, XB: tl.constexpr):
    """One tile's FMAs: acc += W_tile . (xs * x[k0:k0+BLOCK_K] (* nw)); ss += x^2 when do_ss (the RMSNorm sum of
    squares, taken during the first row chunk). xs: a scalar on x (routing weight / shared gate; else 1)."""
    if FMT <= 2:
        kk = k0 + tl.arange(0, BLOCK_K)
        km = kk < K
        x = x_load(x_ptr, kk, km, BLOCK_N, XB)
        if NORM:
            if do_ss:
                ss = mac(ss, x * x, VEC, XB)
            x = x * x_load(nw_ptr, kk, km, BLOCK_N, XB)
        p = _as_f32(w) * (x * xs)
        if FMT == 2:
            G: tl.constexpr = min(BLOCK_K, 128)
            acc += tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // G, G)), axis=2) * s
        else:
            acc = mac(acc, p, VEC, XB)
    else:
        GROUP: tl.constexpr = 16 if FMT == 3 else 32
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        wm = offs_w < K // 8
        q0, q1, q2, q3, q4, q5, q6, q7 = _e2m1_word(w.to(tl.uint32, bitcast=True))
        x0, x1, x2, x3, x4, x5, x6, x7 = x_words(x_ptr, offs_w, wm, BLOCK_N, BLOCK_K)
        if NORM:
            if do_ss:
                ss += x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3 + x4 * x4 + x5 * x5 + x6 * x6 + x7 * x7
            n0, n1, n2, n3, n4, n5, n6, n7 = x_words(nw_ptr, offs_w, wm, BLOCK_N, BLOCK_K)
            x0 = x0 * n0
            x1 = x1 * n1
            x2 = x2 * n2
            x3 = x3 * n3
            x4 = x4 * n4
            x5 = x5 * n5
            x6 = x6 * n6
            x7 = x7 * n7
        p = q0 * x0 + q1 * x1 + q2 * x2 + q3 * x3 + q4 * x4 + q5 * x5 + q6 * x6 + q7 * x7   # [BN, BK/8]
        dots = tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // GROUP, GROUP // 8)), axis=2)
        if FMT == 4:
            # 2^(e - 127) * 2^14 built as fp32 bits: exponent field e + 14 (exact for every e <= 240)
            sf = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
        else:
            sf = _as_f32(s)          # e4m3 scales (fp8e4nv, or their bytes before sm_89)
        acc += dots * sf * xs
    return acc, ss


@triton.jit
def ss_total(ss, K, FMT: tl.constexpr, BLOCK_N: tl.constexpr, XB: tl.constexpr):
    """mean(x^2) from the sum-of-squares accumulator (its x rows are replicated over the tile's rows)."""
    if FMT >= 3:
        t = tl.sum(acc_total(ss), axis=0) / (BLOCK_N * K)
    elif XB:
        t = tl.sum(acc_total(ss), axis=0) / (BLOCK_N * K)
    else:
        t = tl.sum(acc_total(ss), axis=0) / K
    return t

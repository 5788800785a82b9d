"""fp8 (e4m3, per-row scale) GEMV on the tensor cores: codes converted in registers straight into mma.sync A fragments.

Why: at the monokernel's occupancy (one 8-warp program per SM) the CUDA-core fp8 loops stream 29-35% of the read
probe (NOTES.md sessions 4 and 7): each weight costs ~4-5 dependent SASS instructions (e4m3 -> f16 -> f32 convert,
FFMA, the per-step reductions) and two warps per scheduler cannot hide those chains; with the weights already in L2
they are barely faster. Here `cvt.rn.f16x2.e4m3x2` turns two codes into one f16x2 register (exact: every e4m3 value
is an f16) and one `mma.sync.m16n8k16` consumes a word (4 codes) of 16 rows: ~0.8 SASS per weight and per lane, the
products exact in the mma's fp32 sums, the row scale one FMUL per row at the end.

Lane roles are fp4_mma's (one warp = 16 * RB weight rows; lane l has r = l // 4, q = l % 4): lane (r, q) holds rows
`base + r` and `base + r + 8` of each 16-row block and, for each step of K, PIECES (2 or 4) 16-byte pieces of each row
(piece h = words 16 PIECES st + 16 h + 4q .. + 3 of the row's u32 words, one 16-byte load per piece and row; the quad covers
64 contiguous bytes). Word j's codes {c0, c1} / {c2, c3} are the A fragment's k pairs (2q, 2q + 1) / (2q + 8, 2q + 9)
of rows r and r + 8, against x pairs {x(c0), x(c1)}, {x(c2), x(c3)}; "own columns": B column 2g is non-zero only in
the rows of quad lane g's codes, supplied by lane (2g, g), so D[row][2q] is lane (r, q)'s own partial dot and the quad
is summed once at the end (two shuffles). x is the natural-order fp16 copy of the (normed) input:
fp4_mma.prepare_xh(..., natural=True); rounding x to fp16 is the only difference from the CUDA-core fp8 tile's sums
(x kept in fp32 there).

Under the interpreter (or KIE_TILES_ASM=0) the same loop runs with lane = element index, each code decoded from its
bits (tiles._as_f32) and plain fp32 FMAs over the lane's own words; the quad's sum is the same.

W16 (fp8_rows_dot's flag; the monokernel's bf16 / fp16 tasks, kernels/monokernel/mma8.py): the same loop over 16-bit
weights. A word is two weights, so a piece (4 words) is two k16 mma per 16-row block, each run twice: against x's
bf16 (fp16) rounding hi and against lo = x - hi rounded again, so x keeps ~16 bits (hi alone would cost the graph
backend's fp32-x products 8 bits). The "x16" layout holds, per 8 elements 8g..8g+7, their 4 hi pairs then their 4
lo pairs (words 8g / 2 .. : the same word addresses as fp8's x pairs of 16 codes).

PERSIST: a grid smaller than the row tiles walks them (tile = pid, pid + programs, ...): the monokernel's shape, one
or a few programs per SM, for benchmarks/fp8_mma_bench.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device_caps import has_fp8e4nv
from .fp4_mma import _lane_warp, _ld_words, _ld_x, _mine, _quad_sum, rows_unreadable, xh_input
from .gemv import check_vec, check_x, make_out
from .pdl import launch_kw, pdl_begin, reg_cap
from .tiles import _ASM, _as_f32, _store_out
from .weights import WeightHandle

__all__ = ["gemv_fp8_mma", "fp8_mma_unreadable", "FP8_MMA_ROW_BLOCKS", "FP8_MMA_WARPS"]

FP8_MMA_ROW_BLOCKS = 2
FP8_MMA_WARPS = 4


def _piece_ptx() -> str:
    """One piece (4 words of rows a and b) through 4 chained mma from the accumulators ($2, $3 = rows a, b):
    $0, $1 out (rows a, b; the odd D columns stay zero), $4..$7 words of row a, $8..$11 of row b, $12..$19 the 8 x
    pairs (2 per word)."""
    body = ("{\n.reg .b16 la, ha, lb, hb;\n.reg .b32 a<4>;\n.reg .f32 d<4>;\nmov.f32 d0, $2;\nmov.f32 d2, $3;\n"
            "mov.f32 d1, 0f00000000;\nmov.f32 d3, 0f00000000;\n")
    for j in range(4):
        body += (f"mov.b32 {{la, ha}}, ${4 + j};\nmov.b32 {{lb, hb}}, ${8 + j};\n"
                 "cvt.rn.f16x2.e4m3x2 a0, la;\ncvt.rn.f16x2.e4m3x2 a1, lb;\n"
                 "cvt.rn.f16x2.e4m3x2 a2, ha;\ncvt.rn.f16x2.e4m3x2 a3, hb;\n"
                 "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {a0, a1, a2, a3}, "
                 f"{{${12 + 2 * j}, ${13 + 2 * j}}}, {{d0, d1, d2, d3}};\n")
    return body + "mov.f32 $0, d0;\nmov.f32 $1, d2;\n}"


_PIECE = tl.constexpr(_piece_ptx())


def _piece16_ptx(ty: str) -> str:
    """W16: one piece of 16-bit weights (`ty` bf16 or f16; 4 words = 8 weights of rows a and b) through 4 chained
    mma: words 0-1 then 2-3, each against x's hi pairs and then its lo pairs ($12..$15 hi, $16..$19 lo; the rest as
    _piece_ptx)."""
    body = ("{\n.reg .f32 d<4>;\nmov.f32 d0, $2;\nmov.f32 d2, $3;\nmov.f32 d1, 0f00000000;\n"
            "mov.f32 d3, 0f00000000;\n")
    for j in (0, 2):
        for xs in (12, 16):
            body += (f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{d0, d1, d2, d3}}, "
                     f"{{${4 + j}, ${8 + j}, ${5 + j}, ${9 + j}}}, {{${xs + j}, ${xs + j + 1}}}, {{d0, d1, d2, d3}};\n")
    return body + "mov.f32 $0, d0;\nmov.f32 $1, d2;\n}"


_PIECE_BF16 = tl.constexpr(_piece16_ptx("bf16"))
_PIECE_F16 = tl.constexpr(_piece16_ptx("f16"))


@triton.jit
def _word_dot8(w, x0, x1):
    """Portable: one word's 4 codes dotted with their x pairs {x0, x1} (u32 f16x2 each), the 4 codes at once as a
    [L, 4] tensor (code k = byte k against half k % 2 of pair k // 2): the interpreter runs ~4x fewer ops (CI)."""
    k = tl.arange(0, 4)[None, :]
    c = _as_f32(((w[:, None] >> (8 * k).to(tl.uint32)) & 0xFF).to(tl.uint8))
    xp = tl.where(k < 2, x0[:, None], x1[:, None])
    xv = ((xp >> (16 * (k & 1)).to(tl.uint32)) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    return tl.sum(c * xv.to(tl.float32), axis=1)


@triton.jit
def _w16(v, HI: tl.constexpr, W16: tl.constexpr):
    """Half HI of a u32 pair as fp32: bf16 (W16 1) or fp16 (2) bits (portable path)."""
    if HI:
        v = v >> 16
    v = (v & 0xFFFF).to(tl.uint16)
    if W16 == 1:
        f = v.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        f = v.to(tl.float16, bitcast=True).to(tl.float32)
    return f


@triton.jit
def _word_dot16(w, xh, xl, W16: tl.constexpr):
    """Portable: one word's two 16-bit weights dotted with x = hi + lo of their two elements."""
    p = _w16(w, False, W16) * (_w16(xh, False, W16) + _w16(xl, False, W16))
    return p + _w16(w, True, W16) * (_w16(xh, True, W16) + _w16(xl, True, W16))


@triton.jit
def _piece(acc_a, acc_b, H, X, W16: tl.constexpr = 0):
    """acc_a / acc_b (rows a / b) += this lane's 4 words of each row (H: words a0..a3, b0..b3) dotted with X (the 8
    x words of those words; GPU: zeros unless this lane supplies B): e4m3 codes against fp16 x pairs (W16 0), or
    16-bit weight pairs (W16 1 bf16, 2 fp16) against x's hi pairs X[0..3] and lo pairs X[4..7] (x = hi + lo: x16
    layout, module docstring)."""
    if _ASM:
        ptx: tl.constexpr = _PIECE if W16 == 0 else (_PIECE_BF16 if W16 == 1 else _PIECE_F16)
        acc_a, acc_b = tl.inline_asm_elementwise(
            ptx, "=f,=f,f,f" + ",r" * 16, [acc_a, acc_b, H[0], H[1], H[2], H[3], H[4], H[5], H[6], H[7], X[0], X[1],
                                           X[2], X[3], X[4], X[5], X[6], X[7]],
            dtype=(tl.float32,) * 2, is_pure=True, pack=1)
    else:
        for j in tl.static_range(4):
            if W16 == 0:
                acc_a += _word_dot8(H[j], X[2 * j], X[2 * j + 1])
                acc_b += _word_dot8(H[4 + j], X[2 * j], X[2 * j + 1])
            else:
                acc_a += _word_dot16(H[j], X[j], X[4 + j], W16)
                acc_b += _word_dot16(H[4 + j], X[j], X[4 + j], W16)
    return acc_a, acc_b


@triton.jit
def _piece_load8(wq, ra, rb, swn, st, q, KW, h: tl.constexpr, PIECES: tl.constexpr):
    """Piece h of step st for rows ra, rb: words 16 PIECES st + 16 h + 4q .. + 3, clamped in-row (K % 16 == 0 keeps
    a clamped piece whole; its x is masked to zero)."""
    w = tl.minimum(16 * PIECES * st + 16 * h + 4 * q, KW - 4)
    return _ld_words(wq + ra * swn + w) + _ld_words(wq + rb * swn + w)


@triton.jit
def _step_load8(wq, ra, rb, swn, st, q, KW, PIECES: tl.constexpr):
    p0 = _piece_load8(wq, ra, rb, swn, st, q, KW, 0, PIECES)
    p1 = _piece_load8(wq, ra, rb, swn, st, q, KW, 1, PIECES)
    if PIECES == 4:
        return p0, p1, _piece_load8(wq, ra, rb, swn, st, q, KW, 2, PIECES), \
            _piece_load8(wq, ra, rb, swn, st, q, KW, 3, PIECES)
    else:
        return p0, p1


@triton.jit
def fp8_rows_first(wq0, ra0, rb0, wq1, ra1, rb1, swn, q, KW, st_lo, RB: tl.constexpr, PIECES: tl.constexpr = 2):
    """fp8_rows_dot's first step of loads (its `first` argument): weights never depend on activations, so a
    caller that must wait for its input (a persistent kernel's task) issues these before the wait. st_lo may be
    a per-lane tensor (fp8_rows_dot's st_base + st_lo)."""
    P0 = _step_load8(wq0, ra0, rb0, swn, st_lo, q, KW, PIECES)
    P1 = P0
    if RB == 2:
        P1 = _step_load8(wq1, ra1, rb1, swn, st_lo, q, KW, PIECES)
    return P0, P1


@triton.jit
def fp8_rows_dot(xq, wq0, ra0, rb0, wq1, ra1, rb1, swn, q, KW, mine, st_lo, st_hi, RB: tl.constexpr,
                 PIECES: tl.constexpr, first, st_base=0, W16: tl.constexpr = 0):
    """One warp's fp8 rows against x (natural-order fp16, u32 view xq) over steps [st_lo, st_hi) of 64 * PIECES bytes
    per row (all of K: 0, cdiv(KW, 16 * PIECES)), the next step's loads issued before the current step's mma:
    block 0 = rows ra0 / rb0 of wq0, block 1 (RB == 2) = rows ra1 / rb1 of wq1 (a GEMV's next 16 rows, or a GLU's
    up rows beside its gate rows); first = fp8_rows_first(...) of the same rows and st_base + st_lo. KW = K / 4 words
    per row, swn the row stride in words. st_base (a per-lane tensor allowed: each warp its own K range, the loop
    bounds staying scalar) offsets every step; steps past K load clamped rows against x masked to zero. Returns each
    lane's unscaled partial sums (block 0 rows a, b; block 1 rows a, b), not yet summed over the quad.
    W16 1 / 2: the rows are bf16 / fp16 pairs (KW = K / 2) and xq the x16 layout (module docstring)."""
    zero = tl.zeros(q.shape, tl.float32)
    a0, a1, c0, c1, e0, e1, f0, f1 = zero, zero, zero, zero, zero, zero, zero, zero
    P0, P1 = first
    for st in range(st_lo, st_hi):
        sn = st_base + tl.minimum(st + 1, st_hi - 1)
        C0 = P0
        P0 = _step_load8(wq0, ra0, rb0, swn, sn, q, KW, PIECES)
        if RB == 2:
            C1 = P1
            P1 = _step_load8(wq1, ra1, rb1, swn, sn, q, KW, PIECES)
        x_off = 16 * PIECES * (st_base + st) + 4 * q     # this lane's first word of piece 0; x pairs from 2 x_off
        for h in tl.static_range(PIECES):
            X = _ld_x(xq + 2 * x_off + 32 * h, (x_off + 16 * h < KW) & mine)
            if h % 2 == 0:   # two accumulator chains per block: even / odd pieces
                a0, a1 = _piece(a0, a1, C0[h], X, W16)
                if RB == 2:
                    c0, c1 = _piece(c0, c1, C1[h], X, W16)
            else:
                e0, e1 = _piece(e0, e1, C0[h], X, W16)
                if RB == 2:
                    f0, f1 = _piece(f0, f1, C1[h], X, W16)
    return a0 + e0, a1 + e1, c0 + f0, c1 + f1


@triton.jit
def _row_scale(s_ptr, stride_sn, n, N):
    return tl.load(s_ptr + tl.minimum(n, N - 1).to(tl.int64) * stride_sn).to(tl.float32)


@triton.jit
def _fp8_mma_kernel(xh_ptr, w_ptr, stride_wn, s_ptr, stride_sn, bias_ptr, res_ptr, y_ptr, N, K, n_tiles,
                    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, RB: tl.constexpr, NW: tl.constexpr,
                    PERSIST: tl.constexpr = False, PIECES: tl.constexpr = 2, PDL: tl.constexpr = False):
    """grid (n_tiles,) or, PERSIST, fewer programs walking the tiles: y = (W @ x) * s for fp8 W [N, K] e4m3 (or its
    bits as u8) with per-row scales s (stride_sn 0: one tensor scale), xh natural-order fp16 [K], K % 16 == 0. Each
    warp owns 16 * RB rows of a tile and the whole K (fp8_rows_dot, module docstring)."""
    pdl_begin(PDL)
    lane, warp = _lane_warp(NW)
    r = lane >> 2
    q = lane & 3
    wq = w_ptr.to(tl.pointer_type(tl.uint32))
    xq = xh_ptr.to(tl.pointer_type(tl.uint32))
    KW = K // 4
    lead = q == 0     # one lane per quad stores
    if PERSIST:
        t_lo, t_hi, t_step = tl.program_id(0), n_tiles, tl.num_programs(0)
    else:
        t_lo, t_hi, t_step = tl.program_id(0), tl.program_id(0) + 1, 1
    for t in range(t_lo, t_hi, t_step):
        base = (t * NW + warp) * (16 * RB)
        ra0 = tl.minimum(base + r, N - 1).to(tl.int64)
        rb0 = tl.minimum(base + r + 8, N - 1).to(tl.int64)
        ra1 = tl.minimum(base + 16 + r, N - 1).to(tl.int64)
        rb1 = tl.minimum(base + 24 + r, N - 1).to(tl.int64)
        first = fp8_rows_first(wq, ra0, rb0, wq, ra1, rb1, stride_wn // 4, q, KW, 0, RB, PIECES)
        y0, y1, y2, y3 = fp8_rows_dot(xq, wq, ra0, rb0, wq, ra1, rb1, stride_wn // 4, q, KW, _mine(r, q), 0,
                                      tl.cdiv(KW, 16 * PIECES), RB, PIECES, first)
        n = base + r
        _store_out(_quad_sum(y0, NW) * _row_scale(s_ptr, stride_sn, n, N), n, lead & (n < N), y_ptr, bias_ptr,
                   res_ptr, HAS_BIAS, HAS_RES)
        _store_out(_quad_sum(y1, NW) * _row_scale(s_ptr, stride_sn, n + 8, N), n + 8, lead & (n + 8 < N), y_ptr,
                   bias_ptr, res_ptr, HAS_BIAS, HAS_RES)
        if RB == 2:
            _store_out(_quad_sum(y2, NW) * _row_scale(s_ptr, stride_sn, n + 16, N), n + 16, lead & (n + 16 < N),
                       y_ptr, bias_ptr, res_ptr, HAS_BIAS, HAS_RES)
            _store_out(_quad_sum(y3, NW) * _row_scale(s_ptr, stride_sn, n + 24, N), n + 24, lead & (n + 24 < N),
                       y_ptr, bias_ptr, res_ptr, HAS_BIAS, HAS_RES)


def fp8_mma_unreadable(w: WeightHandle) -> str | None:
    """Why the fp8 mma kernel cannot read w, or None (an fp8 per-row Linear, K % 16 == 0, 16-byte aligned rows)."""
    return rows_unreadable(w, ("fp8",), 16)


def gemv_fp8_mma(x: torch.Tensor, w: WeightHandle, *, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6, xh: torch.Tensor | None = None,
                 row_blocks: int = FP8_MMA_ROW_BLOCKS, num_warps: int = FP8_MMA_WARPS, programs: int | None = None,
                 pieces: int = 2, maxnreg: int | None = None) -> torch.Tensor:
    """y = W @ x (+ bias) (+ residual) for one fp8 per-row Linear on the tensor cores (module docstring). Same
    contract as kernels.gemv.gemv; xh = prepare_xh(x, norm_weight, eps, natural=True) when already made (else made
    here). programs: a persistent grid of that many programs walking the row tiles (None: one program per tile);
    pieces: 16-byte pieces per row and step (2: 128 contiguous bytes of a row per step, 4: 256).
    maxnreg: the register cap of the launch on CUDA (None: ptxas's choice)."""
    why = fp8_mma_unreadable(w)
    if why:
        raise ValueError(f"gemv_fp8_mma: {why}")
    N, K = w.out_features, w.in_features
    if row_blocks not in (1, 2) or num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"gemv_fp8_mma: row_blocks {row_blocks} (1 or 2), num_warps {num_warps} (1, 2, 4, 8, 16)")
    if pieces not in (2, 4):
        raise ValueError(f"gemv_fp8_mma: pieces {pieces} (2 or 4)")
    if programs is not None and programs < 1:
        raise ValueError(f"gemv_fp8_mma: programs {programs}, expected >= 1")
    if x.device.type == "cuda" and not has_fp8e4nv(x.device):
        raise ValueError(f"gemv_fp8_mma: {torch.cuda.get_device_name(x.device)} has no e4m3 converts (sm_89+)")
    check_x(x, K, w.device)
    check_vec(bias, N, w.device, "bias")
    check_vec(residual, N, w.device, "residual")
    y = make_out(x, N, out)
    xh = xh_input(x, xh, K, norm_weight, eps, natural=True)
    n_tiles = triton.cdiv(N, 16 * row_blocks * num_warps)
    grid = n_tiles if programs is None else min(programs, n_tiles)
    _fp8_mma_kernel[(grid,)](
        xh, w.weight.view(torch.uint8), w.weight.stride(-2), w.scale, w.scale.stride(-2) if w.scale.dim() >= 2 else 0,
        bias if bias is not None else y, residual if residual is not None else y, y, N, K, n_tiles,
        HAS_BIAS=bias is not None, HAS_RES=residual is not None, RB=row_blocks, NW=num_warps,
        PERSIST=programs is not None, PIECES=pieces, num_warps=num_warps, **launch_kw(x.device), **reg_cap(x.device, maxnreg))
    return y

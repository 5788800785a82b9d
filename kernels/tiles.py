"""Device-side building blocks of the decode GEMVs, shared by the kernel-per-op launchers (gemv.py, moe.py) and the
persistent monokernel: per-format tile functions that compute one row tile's dot products over a K range, and the
epilogue helpers (RMSNorm scale, GLU activations, split-K reduction, bias/residual store).

Tile contract: `_tile(FMT, w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr, x_ptr, nw_ptr, stride_x8, n_start,
N, k_lo, k_hi, HAS_NW, BLOCK_N, BLOCK_K, PIPE) -> [BLOCK_N] fp32`: rows n_start .. n_start + BLOCK_N of W (rows past
N read row N-1; drop them) dotted with x[k_lo:k_hi]. k_lo is a multiple of BLOCK_K (every caller passes 0 or
pid * k_per_split; fp4 tiles tell the compiler their word loads are aligned on it). Float formats read x [K] (times
nw when HAS_NW: RMSNorm without its rstd, a scalar the caller applies); fp4 formats read x in the x8 layout (see
below). Weight and x loads interleave step by step here: a persistent kernel that wants a tile's first weights in
flight before its input is ready (DESIGN.md §3) issues that first load itself.

Why the code looks the way it does (sm_90 SASS of each loop, checked by tests/kernels/test_compile_sm90.py):
- x is loaded as a [BLOCK_N, L] broadcast tile, not a [L] vector: it then gets the weight tile's own register
  layout, so there is no shared-memory layout conversion (2 barriers) per K step;
- the accumulator keeps one value per row and 16-byte vector (the in-thread part of the reduction runs per step),
  so registers go to weights in flight rather than to a [BLOCK_N, BLOCK_K] fp32 accumulator;
- PIPE prefetches step i+1's weights while step i computes (Triton does not pipeline plain loads);
- fp4 decodes whole u32 words (8 codes: two "byte planes" in 7 integer ops, a byte permute per 2 codes, inline
  PTX on the GPU) and reads x in the x8 layout, fp32 [8, K/8] with x8[e, j] = x[8j + e]: element e of word j then
  multiplies row e of x8, a contiguous load; each thread holds whole scale groups (16 or 32 codes);
- fp8-block scales its 16-column partial sums (the step may span 128-column blocks: the fp8 tile shape).
benchmarks/sass_count.py counts each loop's instructions per weight byte offline.
"""

import os

import triton
import triton.language as tl

# Inline PTX where it can run: the interpreter has no inline asm (same switch as kccl/sync.py's USE_ASM, here a
# global because every tile signature would otherwise carry it). KIE_TILES_ASM=0 selects the portable code on the
# GPU too (A/B benchmarks; both give the same bits).
_ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("KIE_TILES_ASM", "1") != "0")

FMT_ID = {"bf16": 0, "fp16": 0, "fp32": 0, "fp8": 1, "fp8_block": 2, "nvfp4": 3, "mxfp4": 4}  # the FMT constexpr
ACT_ID = {"silu": 0, "swiglu": 0, "gpt_oss": 1}  # the ACT constexpr of _glu


# ======================================================================================================================
# Tiles
# ======================================================================================================================
@triton.jit
def _bcast_load(ptr, offs, mask, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """ptr[offs] (offs [L], contiguous) broadcast to [BLOCK_N, L] fp32. Loading it as a 2-D tile gives it the weight
    tile's own register layout (each thread loads its columns once, shared by its rows): no shared-memory layout
    conversion and no barrier per K step, which a 1-D load + broadcast costs."""
    p = tl.broadcast_to(ptr + offs[None, :], (BLOCK_N, offs.shape[0]))
    if MASKED:
        v = tl.load(p, mask=tl.broadcast_to(mask[None, :], (BLOCK_N, offs.shape[0])), other=0.0)
    else:
        v = tl.load(p)
    return v.to(tl.float32)


@triton.jit
def _load_x(x_ptr, nw_ptr, offs, mask, HAS_NW: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """x[offs] (times the RMSNorm weight when fused), broadcast over the tile's rows: [BLOCK_N, L] fp32."""
    x = _bcast_load(x_ptr, offs, mask, BLOCK_N, MASKED)
    if HAS_NW:
        x = x * _bcast_load(nw_ptr, offs, mask, BLOCK_N, MASKED)
    return x


@triton.jit
def _as_f32(v):
    """Weight values as fp32. e4m3 arrives as Triton's fp8e4nv (a native convert, sm_89+), or as uint8 holding the
    e4m3fn bits: how e4m3 tensors reach GPUs before sm_89, which have no fp8e4nv type (weight_args,
    device_caps). The bits become an fp16 with the same fields, exponent bias 15 instead of 7 (subnormals
    included), times 2^8: exact for every e4m3fn value but NaN (checkpoints hold none)."""
    if v.dtype == tl.uint8:
        h = v.to(tl.uint16)
        return (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        return v.to(tl.float32)


@triton.jit
def _x8_offs(n, K8):
    """Offset of element n of a [K] vector in the x8 layout, fp32 [8, K8 = K / 8] with x8[e, j] = x[8j + e]: what
    every producer of an fp4 GEMV's input writes (prepare_x8, the router, a GLU, attention)."""
    return (n % 8) * K8 + n // 8


@triton.jit
def _row_ptrs(w_ptr, stride_wn, n_start, N, BLOCK_N: tl.constexpr):
    # Rows past N are clamped onto row N-1 instead of masked: loads stay unpredicated, their results are dropped.
    offs_n = tl.minimum(n_start + tl.arange(0, BLOCK_N), N - 1)
    return w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]


@triton.jit
def _float_mac(acc, w, x, s_row, stride_sk, k0, k_hi, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_SCALED: tl.constexpr, MASKED: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K // VEC] += w * x for a loaded weight tile w and x = _load_x(...) [BLOCK_N, BLOCK_K]
    (columns k0 : k0 + BLOCK_K), summed over each thread's VEC contiguous columns. BLOCK_SCALED (fp8-block): each
    VEC-column partial sum lies in one 128-column block (VEC divides 128, k0 is a multiple of VEC) and the tile's
    rows share one scale row, so the block scale multiplies the partial sum: an FFMA where the unscaled formats add,
    any BLOCK_K (a step may span blocks)."""
    VEC: tl.constexpr = BLOCK_K // acc.shape[1]
    p = _as_f32(w) * x
    # A thread's 16-byte vector holds VEC consecutive columns: summing them is register-local and shrinks the
    # accumulator VEC-fold, leaving registers for weights in flight.
    part = tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // VEC, VEC)), axis=2)
    if BLOCK_SCALED:
        # The step's ceil(BLOCK_K / 128) block scales as uniform scalar loads, picked per vector by a select: a
        # [BLOCK_K // VEC] tensor made of scalars takes any register layout (a loaded one got its own layout and
        # cost a shared-memory conversion per step). Blocks past k_hi (ragged tail) read scale 0.
        NB: tl.constexpr = (BLOCK_K + 127) // 128
        blk = (k0 % 128 + tl.arange(0, BLOCK_K // VEC) * VEC) // 128  # block of each vector, relative to k0's
        sv = tl.zeros((BLOCK_K // VEC,), dtype=tl.float32)
        for b in tl.static_range(NB):
            kb = k0 // 128 + b
            if MASKED:
                sb = tl.load(s_row + kb * stride_sk, mask=kb * 128 < k_hi, other=0.0).to(tl.float32)
            else:
                sb = tl.load(s_row + kb * stride_sk).to(tl.float32)
            sv = tl.where(blk == b, sb, sv)
        acc = acc + part * sv[None, :]
    else:
        acc = acc + part
    return acc


@triton.jit
def _float_step(acc, acc2, w, w2, x_ptr, nw_ptr, s_row, s2_row, stride_sk, k0, k_hi, HAS_NW: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SCALED: tl.constexpr, MASKED: tl.constexpr,
                PAIR: tl.constexpr):
    """One K step of _tile_float: x[k0 : k0 + BLOCK_K] loaded once, into acc (w) and, PAIR, acc2 (w2)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = _load_x(x_ptr, nw_ptr, offs_k, offs_k < k_hi, HAS_NW, BLOCK_N, MASKED)  # [BLOCK_N, BLOCK_K]
    acc = _float_mac(acc, w, x, s_row, stride_sk, k0, k_hi, BLOCK_N, BLOCK_K, BLOCK_SCALED, MASKED)
    if PAIR:
        acc2 = _float_mac(acc2, w2, x, s2_row, stride_sk, k0, k_hi, BLOCK_N, BLOCK_K, BLOCK_SCALED, MASKED)
    return acc, acc2


@triton.jit
def _tile_float(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, x_ptr, nw_ptr, n_start, N, k_lo, k_hi,
                HAS_NW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                PIPE: tl.constexpr, w2_ptr=None, s2_ptr=None, PAIR: tl.constexpr = False):
    """Row sums of w [N, K] . x over [k_lo, k_hi) for rows n_start + [0, BLOCK_N); PAIR: also those of w2 (same
    shape, strides and scale layout as w: a GLU's up rows beside its gate rows), returned as (w's, w2's), each
    step's x (and norm weight) loaded once for both."""
    w_rows = _row_ptrs(w_ptr, stride_wn, n_start, N, BLOCK_N)
    s_row = s_ptr + (n_start // 128) * stride_sn
    w2_rows = w_rows
    s2_row = s_row
    if PAIR:
        w2_rows = _row_ptrs(w2_ptr, stride_wn, n_start, N, BLOCK_N)
        s2_row = s2_ptr + (n_start // 128) * stride_sn
    offs = tl.arange(0, BLOCK_K)
    VEC: tl.constexpr = min(BLOCK_K, 128 // w_ptr.dtype.element_ty.primitive_bitwidth)  # columns per 16-B load
    # The cross-thread reduction happens once, after the loop.
    acc = tl.zeros((BLOCK_N, BLOCK_K // VEC), dtype=tl.float32)
    acc2 = acc
    # Whole steps first, unmasked. PIPE: software-pipelined one deep, step i+1's weights in flight while step i
    # computes (Triton does not pipeline plain loads by itself); the last prefetch re-reads the last step
    # (clamped, an L2 hit) instead of predicating every load. Costs the registers of a second weight tile.
    k_full = k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K
    if PIPE:
        first = tl.full((BLOCK_N, BLOCK_K), k_lo < k_full, tl.int1)
        w_next = tl.load(w_rows + (k_lo + offs)[None, :], mask=first, other=0.0)
        w2_next = w_next
        if PAIR:
            w2_next = tl.load(w2_rows + (k_lo + offs)[None, :], mask=first, other=0.0)
        for k0 in range(k_lo, k_full, BLOCK_K):
            w = w_next
            w2 = w2_next
            k_n = tl.minimum(k0 + BLOCK_K, k_full - BLOCK_K)
            w_next = tl.load(w_rows + (k_n + offs)[None, :])
            if PAIR:
                w2_next = tl.load(w2_rows + (k_n + offs)[None, :])
            acc, acc2 = _float_step(acc, acc2, w, w2, x_ptr, nw_ptr, s_row, s2_row, stride_sk, k0, k_hi, HAS_NW,
                                    BLOCK_N, BLOCK_K, BLOCK_SCALED, False, PAIR)
    else:
        for k0 in range(k_lo, k_full, BLOCK_K):
            w = tl.load(w_rows + (k0 + offs)[None, :])
            w2 = w
            if PAIR:
                w2 = tl.load(w2_rows + (k0 + offs)[None, :])
            acc, acc2 = _float_step(acc, acc2, w, w2, x_ptr, nw_ptr, s_row, s2_row, stride_sk, k0, k_hi, HAS_NW,
                                    BLOCK_N, BLOCK_K, BLOCK_SCALED, False, PAIR)
    for k0 in range(k_full, k_hi, BLOCK_K):  # the ragged tail: 0 or 1 step, masked
        tail = (k0 + offs < k_hi)[None, :]
        w = tl.load(w_rows + (k0 + offs)[None, :], mask=tail, other=0.0)
        w2 = w
        if PAIR:
            w2 = tl.load(w2_rows + (k0 + offs)[None, :], mask=tail, other=0.0)
        acc, acc2 = _float_step(acc, acc2, w, w2, x_ptr, nw_ptr, s_row, s2_row, stride_sk, k0, k_hi, HAS_NW,
                                BLOCK_N, BLOCK_K, BLOCK_SCALED, True, PAIR)
    if PAIR:
        return tl.sum(acc, axis=1), tl.sum(acc2, axis=1)
    else:
        return tl.sum(acc, axis=1)


@triton.jit
def _tile_bf16(w_ptr, stride_wn, x_ptr, nw_ptr, n_start, N, k_lo, k_hi,
               HAS_NW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPE: tl.constexpr):
    """Float weights (bf16 / fp16 / fp32) [N, K]."""
    return _tile_float(w_ptr, stride_wn, w_ptr, 0, 0, x_ptr, nw_ptr, n_start, N, k_lo, k_hi,
                       HAS_NW, BLOCK_N, BLOCK_K, False, PIPE)


@triton.jit
def _tile_fp8(w_ptr, stride_wn, s_ptr, stride_sn, x_ptr, nw_ptr, n_start, N, k_lo, k_hi,
              HAS_NW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPE: tl.constexpr):
    """e4m3 [N, K] with a per-row scale [N, 1]: the scale factors out of the dot product, one multiply per row."""
    acc = _tile_float(w_ptr, stride_wn, w_ptr, 0, 0, x_ptr, nw_ptr, n_start, N, k_lo, k_hi,
                      HAS_NW, BLOCK_N, BLOCK_K, False, PIPE)
    return _row_scaled(acc, s_ptr, stride_sn, n_start, N, BLOCK_N)


@triton.jit
def _row_scaled(acc, s_ptr, stride_sn, n_start, N, BLOCK_N: tl.constexpr):
    """acc [BLOCK_N] times fp8's per-row scales of rows n_start + [0, BLOCK_N) (clamped to N - 1)."""
    offs_n = tl.minimum(n_start + tl.arange(0, BLOCK_N), N - 1)
    return acc * tl.load(s_ptr + offs_n * stride_sn).to(tl.float32)


@triton.jit
def _tile_fp8_block(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, x_ptr, nw_ptr, n_start, N, k_lo, k_hi,
                    HAS_NW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPE: tl.constexpr):
    """e4m3 [N, K] with one scale per 128x128 block [ceil(N/128), ceil(K/128)]. Needs BLOCK_N dividing 128 and
    n_start a multiple of it (the tile's rows share one scale row); any power-of-two BLOCK_K (scales apply to
    16-column partial sums, so a 512-column step reads its 4 block scales, once per thread)."""
    return _tile_float(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, x_ptr, nw_ptr, n_start, N, k_lo, k_hi,
                       HAS_NW, BLOCK_N, BLOCK_K, True, PIPE)


# ---- fp4 (nvfp4 / mxfp4) -----------------------------------------------------------------------------------------
# Packed rows are read as u32 words, 8 e2m1 codes each. Element e of word j multiplies x[8j + e], so the fp4 tiles
# read x in the "x8" layout: fp32 [8, K/8] with x8[e, j] = x[8j + e] (prepare_x8). Then all 8 x operands of a word
# are contiguous [BLOCK_N, BLOCK_K/8] loads with the weight tile's own layout (vectorised, shared by a thread's
# rows, no layout conversion); x in its natural order would be 8 stride-8 gathers per word.
@triton.jit
def _byte_f32(v, SHIFT: tl.constexpr):
    """Byte SHIFT/8 of each u32 in v, as the high byte of an fp16 (low byte 0), converted to fp32."""
    return (((v >> SHIFT) & 0xFF) << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


# The decode in PTX (GPU): ptxas turns the shift/and/or lines into ~7 SHF/LOP3/IMAD.SHL, each `prmt` places two
# planes' bytes as the high bytes of an f16x2 (one PRMT per 2 codes; the portable code's byte shifts compile to
# more). E2M1_F16X2_PTX is that much, a template: word {W} -> f16x2 {P}0 = {e0, e2}, {P}1 = {e4, e6}, {P}2 = {e1, e3},
# {P}3 = {e5, e7}, each 2^-14 x its value (needs .b32 registers t, u, lo, hi and z = 0); the tensor-core GEMV
# (fp4_mma.py) feeds those pairs to mma as they are. Here `cvt.f32.f16` (one HADD2.F32 each) widens them:
# $8 = the word; $0..$7 = elements 0..7.
E2M1_F16X2_PTX = """shl.b32 t, {W}, 4;
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
"""
_E2M1_WORD_PTX = tl.constexpr("""{
.reg .b32 t, u, lo, hi, z, h0, h1, h2, h3;
.reg .b16 f<8>;
mov.b32 z, 0;
""" + E2M1_F16X2_PTX.format(W="$8", P="h") + """mov.b32 {f0, f1}, h0;
mov.b32 {f2, f3}, h1;
mov.b32 {f4, f5}, h2;
mov.b32 {f6, f7}, h3;
cvt.f32.f16 $0, f0;
cvt.f32.f16 $1, f4;
cvt.f32.f16 $2, f1;
cvt.f32.f16 $3, f5;
cvt.f32.f16 $4, f2;
cvt.f32.f16 $5, f6;
cvt.f32.f16 $6, f3;
cvt.f32.f16 $7, f7;
}""")


@triton.jit
def _e2m1_word(q):
    """8 e2m1 codes in a u32 word (byte b holds elements 2b | 2b+1 << 4) -> 8 fp32, each 2^-14 times its value.

    A nibble s|e1 e0|m rewritten as the byte s 0 0 0 e1 e0 m 0 (an e5m2 byte) is the high byte of an fp16 whose
    value is exactly 2^-14 x the e2m1 value (e = 0 lands on fp16 subnormals, which the f16 -> f32 convert handles
    exactly). Two "byte planes" hold those bytes for the four low nibbles (elements 0, 2, 4, 6) and the four high
    nibbles (1, 3, 5, 7): 7 integer ops per word for all 8 codes (the sign and the e|m bits move by different
    shifts, and a LOP3 takes one mask, so each plane costs shift + mask + merge). One byte permute per 2 codes
    turns a plane into f16x2, one convert per code gives fp32: ~19 instructions per word (was ~28: four
    fp16-pair decodes at 4 ops each plus packing PRMTs). The 2^-14 is folded into the scale by the caller.
    Returns elements 0..7 of the word, in order."""
    if _ASM:
        w0, w1, w2, w3, w4, w5, w6, w7 = tl.inline_asm_elementwise(
            _E2M1_WORD_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [q], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        lo = ((q << 4) & 0x80808080) | ((q << 1) & 0x0E0E0E0E)  # byte b: element 2b as s000 eem0
        hi = (q & 0x80808080) | ((q >> 3) & 0x0E0E0E0E)  # byte b: element 2b + 1
        w0 = _byte_f32(lo, 0)
        w1 = _byte_f32(hi, 0)
        w2 = _byte_f32(lo, 8)
        w3 = _byte_f32(hi, 8)
        w4 = _byte_f32(lo, 16)
        w5 = _byte_f32(hi, 16)
        w6 = _byte_f32(lo, 24)
        w7 = _byte_f32(hi, 24)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _word_offs(k, KW: tl.constexpr, GROUP: tl.constexpr):
    """Word offsets k/8 .. k/8 + KW of a step at element k. Callers start steps at multiples of BLOCK_K (the tile
    contract), so runs of GROUP/8 words are aligned: with rows on 16-byte boundaries (Triton sees the stride)
    a thread then loads a whole scale group as one vector (mxfp4: 16 B; its group sum stays in registers)."""
    return tl.multiple_of((k >> 3) + tl.arange(0, KW), GROUP // 8)  # k >= 0: a shift, not a signed division


@triton.jit
def _fp4_mac(acc, q, s, x8_ptr, stride_x8, k0, k_hi, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GROUP: tl.constexpr, MX: tl.constexpr, MASKED: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K // GROUP] += group dots of loaded words q [BLOCK_N, BLOCK_K/8] times their scales s
    [BLOCK_N, BLOCK_K // GROUP] (all x 2^-14)."""
    KW: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // GROUP
    offs_w = _word_offs(k0, KW, GROUP)
    w_mask = offs_w < (k_hi >> 3)
    w0, w1, w2, w3, w4, w5, w6, w7 = _e2m1_word(q)
    # One multiply-add chain per word; masked-off words read x = 0 (their codes are 0 too).
    p = w0 * _bcast_load(x8_ptr, offs_w, w_mask, BLOCK_N, MASKED)
    p += w1 * _bcast_load(x8_ptr + stride_x8, offs_w, w_mask, BLOCK_N, MASKED)
    p += w2 * _bcast_load(x8_ptr + 2 * stride_x8, offs_w, w_mask, BLOCK_N, MASKED)
    p += w3 * _bcast_load(x8_ptr + 3 * stride_x8, offs_w, w_mask, BLOCK_N, MASKED)
    p += w4 * _bcast_load(x8_ptr + 4 * stride_x8, offs_w, w_mask, BLOCK_N, MASKED)
    p += w5 * _bcast_load(x8_ptr + 5 * stride_x8, offs_w, w_mask, BLOCK_N, MASKED)
    p += w6 * _bcast_load(x8_ptr + 6 * stride_x8, offs_w, w_mask, BLOCK_N, MASKED)
    p += w7 * _bcast_load(x8_ptr + 7 * stride_x8, offs_w, w_mask, BLOCK_N, MASKED)
    # GROUP elements = GROUP/8 consecutive words, all in one thread's vector: sum them, then one scale multiply.
    dots = tl.sum(tl.reshape(p, (BLOCK_N, G, GROUP // 8)), axis=2)
    if MX:
        # 2^(e - 127) * 2^14 built as fp32 bits: exponent field e + 14 (exact for every e <= 240, incl. e = 0).
        sf = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    else:
        sf = _as_f32(s)
    return acc + dots * sf


@triton.jit
def _tile_fp4(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, x8_ptr, stride_x8, n_start, N, k_lo, k_hi,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, MX: tl.constexpr,
              PIPE: tl.constexpr):
    KW: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // GROUP
    # Row stride in bytes is a multiple of 8 (K % 16 == 0), so rows start on u32 words.
    w_rows = _row_ptrs(w_ptr.to(tl.pointer_type(tl.uint32)), stride_wn // 4, n_start, N, BLOCK_N)
    # Scale offsets in int32 (one scale tensor of one Linear: N * K / 16 < 2^31): a scale load then costs one
    # 32-bit add + IMAD.WIDE instead of a 64-bit pointer add per row.
    s_rows = (tl.minimum(n_start + tl.arange(0, BLOCK_N), N - 1) * stride_sn)[:, None]
    GS: tl.constexpr = 4 if GROUP == 16 else 5  # k >> GS == k // GROUP for k >= 0
    offs_g = tl.arange(0, G)
    acc = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    # Whole steps first, unmasked; PIPE: pipelined one deep as in _tile_float (words and scales of step i+1).
    k_full = k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K
    if PIPE:
        q_next = tl.load(w_rows + _word_offs(k_lo, KW, GROUP)[None, :],
                         mask=tl.full((BLOCK_N, KW), k_lo < k_full, tl.int1), other=0)
        s_next = tl.load(s_ptr + (s_rows + ((k_lo >> GS) + offs_g)[None, :] * stride_sk),
                         mask=tl.full((BLOCK_N, G), k_lo < k_full, tl.int1), other=0.0)
        for k0 in range(k_lo, k_full, BLOCK_K):
            q = q_next
            s = s_next
            k_n = tl.minimum(k0 + BLOCK_K, k_full - BLOCK_K)  # clamped: the last prefetch re-reads (L2 hit)
            q_next = tl.load(w_rows + _word_offs(k_n, KW, GROUP)[None, :])
            s_next = tl.load(s_ptr + (s_rows + ((k_n >> GS) + offs_g)[None, :] * stride_sk))
            acc = _fp4_mac(acc, q, s, x8_ptr, stride_x8, k0, k_hi, BLOCK_N, BLOCK_K, GROUP, MX, False)
    else:
        for k0 in range(k_lo, k_full, BLOCK_K):
            q = tl.load(w_rows + _word_offs(k0, KW, GROUP)[None, :])
            s = tl.load(s_ptr + (s_rows + ((k0 >> GS) + offs_g)[None, :] * stride_sk))
            acc = _fp4_mac(acc, q, s, x8_ptr, stride_x8, k0, k_hi, BLOCK_N, BLOCK_K, GROUP, MX, False)
    for k0 in range(k_full, k_hi, BLOCK_K):  # the ragged tail: 0 or 1 step, masked
        offs_t = _word_offs(k0, KW, GROUP)
        q = tl.load(w_rows + offs_t[None, :], mask=(offs_t < (k_hi >> 3))[None, :], other=0)
        s = tl.load(s_ptr + (s_rows + ((k0 >> GS) + offs_g)[None, :] * stride_sk),
                    mask=((k0 >> GS) + offs_g < (k_hi >> GS))[None, :], other=0.0)
        acc = _fp4_mac(acc, q, s, x8_ptr, stride_x8, k0, k_hi, BLOCK_N, BLOCK_K, GROUP, MX, True)
    return tl.sum(acc, axis=1)


@triton.jit
def _tile_nvfp4(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr, x8_ptr, stride_x8, n_start, N, k_lo, k_hi,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPE: tl.constexpr):
    """nvfp4: packed u8 [N, K/2], e4m3 group-16 scale [N, K/16], fp32 global scale: w = e2m1 * scale / global.
    x8: the input in x8 layout (prepare_x8), RMSNorm already applied."""
    acc = _tile_fp4(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, x8_ptr, stride_x8, n_start, N, k_lo, k_hi,
                    BLOCK_N, BLOCK_K, 16, False, PIPE)
    # 2^14 undoes the nibble trick's exponent shift; 1/global is per Linear: both once per row, after the loop.
    return acc * (16384.0 / tl.load(gs_ptr).to(tl.float32))


@triton.jit
def _tile_mxfp4(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, x8_ptr, stride_x8, n_start, N, k_lo, k_hi,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPE: tl.constexpr):
    """mxfp4: packed u8 [N, K/2], E8M0 group-32 scale [N, K/32]: w = e2m1 * 2^(e - 127). x8 as for nvfp4."""
    return _tile_fp4(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, x8_ptr, stride_x8, n_start, N, k_lo, k_hi,
                     BLOCK_N, BLOCK_K, 32, True, PIPE)


@triton.jit
def _tile(FMT: tl.constexpr, w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr, x_ptr, nw_ptr, stride_x8,
          n_start, N, k_lo, k_hi, HAS_NW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PIPE: tl.constexpr):
    """Format dispatch (constexpr: one variant compiled per format); unused pointers may be any tensor.
    Float formats read x [K] (times nw when HAS_NW); fp4 formats read x_ptr as x8 [8, K/8] with row stride
    stride_x8 and ignore nw (prepare_x8 applies the norm)."""
    if FMT == 0:
        acc = _tile_bf16(w_ptr, stride_wn, x_ptr, nw_ptr, n_start, N, k_lo, k_hi, HAS_NW, BLOCK_N, BLOCK_K, PIPE)
    elif FMT == 1:
        acc = _tile_fp8(w_ptr, stride_wn, s_ptr, stride_sn, x_ptr, nw_ptr, n_start, N, k_lo, k_hi,
                        HAS_NW, BLOCK_N, BLOCK_K, PIPE)
    elif FMT == 2:
        acc = _tile_fp8_block(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, x_ptr, nw_ptr, n_start, N, k_lo, k_hi,
                              HAS_NW, BLOCK_N, BLOCK_K, PIPE)
    elif FMT == 3:
        acc = _tile_nvfp4(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr, x_ptr, stride_x8, n_start, N,
                          k_lo, k_hi, BLOCK_N, BLOCK_K, PIPE)
    else:
        acc = _tile_mxfp4(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, x_ptr, stride_x8, n_start, N, k_lo, k_hi,
                          BLOCK_N, BLOCK_K, PIPE)
    return acc


@triton.jit
def _tile_pair(FMT: tl.constexpr, w_ptr, w2_ptr, stride_wn, s_ptr, s2_ptr, stride_sn, stride_sk, x_ptr, nw_ptr,
               n_start, N, k_lo, k_hi, HAS_NW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PIPE: tl.constexpr):
    """_tile over two float-format weights of one shape, strides and scale layout (a GLU's gate and up rows), each
    step's x loaded once for both (FMT 0-2 only): (w's row sums, w2's)."""
    a, b = _tile_float(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, x_ptr, nw_ptr, n_start, N, k_lo, k_hi,
                       HAS_NW, BLOCK_N, BLOCK_K, FMT == 2, PIPE, w2_ptr, s2_ptr, True)
    if FMT == 1:   # fp8: one scale per row, after the dot
        a = _row_scaled(a, s_ptr, stride_sn, n_start, N, BLOCK_N)
        b = _row_scaled(b, s2_ptr, stride_sn, n_start, N, BLOCK_N)
    return a, b


# ======================================================================================================================
# Epilogue helpers
# ======================================================================================================================
def rstd_block(K: int) -> int:
    """_rstd's BLOCK_X for an input of K elements: 1024-wide steps. One load of all of x (up to 32 values per
    thread) was timed in session 25: no gain on q/k/v (7.35 -> 7.34 us, H100; the scale's loads are L2 hits behind
    the tile loop's DRAM stream)."""
    return min(1024, triton.next_power_of_2(K))


# A single-split normed GEMV / GLU loads x for its RMSNorm scale before its tile loop and reduces it after (NX =
# rstd_early_steps > 0): the scale's L2 round trip and barrier then overlap the weight stream instead of extending
# every program's tail (NOTES.md session 28). KIE_RSTD_EARLY=0: computed after the loop, as before (same bits).
RSTD_EARLY = os.environ.get("KIE_RSTD_EARLY", "1") != "0"
RSTD_EARLY_MAX_PER_THREAD = 16    # fp32 x values a thread holds through the loop (registers)


def rstd_early_steps(K: int, num_warps: int) -> int:
    """NX for _rstd_pre: the number of rstd_block(K)-wide loads of x, or 0 (late _rstd) when off or when a thread
    would hold more than RSTD_EARLY_MAX_PER_THREAD values or 4 loads."""
    bx = rstd_block(K)
    nx = -(-K // bx)
    if not RSTD_EARLY or nx > 4 or nx * bx > RSTD_EARLY_MAX_PER_THREAD * 32 * num_warps:
        return 0
    return nx


@triton.jit
def _rstd_pre(x_ptr, K, BLOCK_X: tl.constexpr, NX: tl.constexpr):
    """_rstd's NX (1-4) loads of x, issued now and reduced later by _rstd_post (nothing waits for them here)."""
    offs = tl.arange(0, BLOCK_X)
    x0 = tl.load(x_ptr + offs, mask=offs < K, other=0.0)
    x1 = x0
    x2 = x0
    x3 = x0
    if NX > 1:
        x1 = tl.load(x_ptr + BLOCK_X + offs, mask=BLOCK_X + offs < K, other=0.0)
    if NX > 2:
        x2 = tl.load(x_ptr + 2 * BLOCK_X + offs, mask=2 * BLOCK_X + offs < K, other=0.0)
    if NX > 3:
        x3 = tl.load(x_ptr + 3 * BLOCK_X + offs, mask=3 * BLOCK_X + offs < K, other=0.0)
    return x0, x1, x2, x3


@triton.jit
def _rstd_post(xs, K, eps, BLOCK_X: tl.constexpr, NX: tl.constexpr):
    """_rstd's value from _rstd_pre's loads: the same sums in the same order (bit-equal)."""
    ss = tl.zeros((BLOCK_X,), dtype=tl.float32)
    for i in tl.static_range(NX):
        x = xs[i].to(tl.float32)
        ss += x * x
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _rstd(x_ptr, K, eps, BLOCK_X: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) over the whole input (every program recomputes it: x is a few KB, in L2)."""
    ss = tl.zeros((BLOCK_X,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_X):
        offs = k0 + tl.arange(0, BLOCK_X)
        x = tl.load(x_ptr + offs, mask=offs < K, other=0.0).to(tl.float32)
        ss += x * x
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _normed_block(x_ptr, nw_ptr, K, eps, HAS_NW: tl.constexpr, BLOCK: tl.constexpr, BLOCK_X: tl.constexpr):
    """(offs, mask, x) of this program's BLOCK elements of x [K] in fp32, RMS-normalised (times nw) when HAS_NW:
    the body of the small launches that write a GEMV input layout (prepare_x8, prepare_xh)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NW:
        x = x * _rstd(x_ptr, K, eps, BLOCK_X) * tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return offs, mask, x


@triton.jit
def _glu(g, u, limit, alpha, ACT: tl.constexpr):
    """ACT 0: silu(g) * u.  ACT 1 (gpt-oss): g <= limit, |u| <= limit, (u + 1) * g * sigmoid(alpha * g)."""
    if ACT == 0:
        return g * tl.sigmoid(g) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return (u + 1.0) * (g * tl.sigmoid(alpha * g))


@triton.jit
def _split_reduce(acc, part_ptr, cnt_ptr, tile_id, split_id, offs_n, n_mask, N, SPLIT: tl.constexpr):
    """Split-K without a second launch: every split stores its partial [N] row, bumps the tile's counter; the split
    that bumps it last sums all partials in split order (deterministic) and resets the counter for the next launch.
    Returns (sum, is_last)."""
    tl.store(part_ptr + split_id * N + offs_n, acc, mask=n_mask)
    tl.debug_barrier()  # every thread's partial store precedes the (release) counter bump
    ticket = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == SPLIT - 1
    total = tl.zeros_like(acc)
    if is_last:
        for s in range(SPLIT):
            # .cg: read L2, never a stale L1 line of another SM's partial.
            total += tl.load(part_ptr + s * N + offs_n, mask=n_mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr + tile_id, 0)
    return total, is_last


@triton.jit
def _store_out(acc, offs_n, n_mask, y_ptr, bias_ptr, res_ptr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
    """y = acc (+ bias) (+ residual). (Loading bias / residual before the tile loop instead, KIE_EPILOGUE_EARLY,
    measured -0.4% / +0.4% on an H100 in session 28-29 and was removed.)"""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(res_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)



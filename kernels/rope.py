"""Fused "q/k norm + RoPE + KV-cache append" for one decode token, GQA and MLA.

Cache layouts (one layer; the engine keeps one tensor per layer, or a stacked [L, ...] tensor and passes views):

    GQA  k_cache, v_cache  [max_len, Hkv, Dh]   token-major: one token's K for all kv heads is one contiguous
                                                row, so the append is one contiguous store; attention reads a kv
                                                head's keys as Dh-long runs at stride Hkv*Dh (>= 128 B, whole lines)
    MLA  cache             [max_len, r + rope]  [:r] the RMS-normed latent (kv_a output), [r:] the rotated k_pe

The position is a device int32 tensor [1] (`pos`), never a Python int: a CUDA graph (or the monokernel's next step)
replays with whatever position the device holds, and nothing syncs with the host. A position outside the cache
(pos >= max_len) writes nothing and reads no memory outside the tables (which must cover the cache); the engine
bounds the generation length when it allocates the cache.

cos / sin tables [max_pos, rotary_dim / 2] float32 come from `models.rope.cos_sin` (YaRN / llama3 frequencies and
the attention factor are already in them); `rope_tables` builds them.

Numerics mirror models/reference.py step by step: each stage (full norm, clip, head norm, rotation) rounds to the
activation dtype exactly where the reference does. All arithmetic is fp32 with explicit round-to-nearest casts:
Triton's interpreter stores bf16 as raw uint16, so bf16 arithmetic (and truncating default casts) must not
appear in a kernel that the CPU tests run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..models.rope import apply_rope, cos_sin
from ..models.spec import RopeSpec
from .pdl import launch_kw, pdl_begin

__all__ = ["rope_tables", "rope_append", "mla_rope_append", "rope_append_task", "mla_rope_append_task",
           "rope_append_ref", "mla_rope_append_ref", "round_to", "cast_to", "check_rope_args", "NORM_NONE", "NORM_HEAD", "NORM_FULL"]

NORM_NONE, NORM_HEAD, NORM_FULL = 0, 1, 2
_NORM_CODES = {None: NORM_NONE, "head": NORM_HEAD, "full": NORM_FULL}


# ---- device functions ------------------------------------------------------------------------------------------

@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 -> the nearest DTYPE value (ties to even), still held in fp32: what torch does when it casts.

    bf16 rounds by bit arithmetic because Triton's interpreter truncates fp32 -> bf16 casts (even with
    fp_downcast_rounding="rtne"); on the GPU the same three integer ops cost nothing next to the loads.
    """
    x = x.to(tl.float32)
    if DTYPE == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536          # -65536 == 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def cast_to(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE with round-to-nearest-even, for stores into bf16 / fp16 / fp32 buffers."""
    return round_to(x, DTYPE).to(DTYPE)


@triton.jit
def _rope_partner(offs_d, ROT: tl.constexpr, PAIR: tl.constexpr):
    """For each dim d of a head: (index of its rotation partner, frequency index, is-first-of-pair, rotated?).

    half: pairs (j, j + ROT/2); pair: pairs (2j, 2j + 1). Dims >= ROT (partial rotary) are their own partner.
    """
    if PAIR:
        partner = offs_d ^ 1
        freq = offs_d // 2
        first = (offs_d % 2) == 0
    else:
        first = offs_d < ROT // 2
        partner = tl.where(first, offs_d + ROT // 2, offs_d - ROT // 2)
        freq = tl.where(first, offs_d, offs_d - ROT // 2)
    in_rot = offs_d < ROT
    return tl.where(in_rot, partner, offs_d), tl.where(in_rot, freq, 0), first, in_rot


@triton.jit
def _norm_rope_rows(src_ptr, row0, n_rows, stride_row, w_ptr, cos_row_ptr, sin_row_ptr, eps, clip,
                    DH: tl.constexpr, ROT: tl.constexpr, PAIR: tl.constexpr, NORM: tl.constexpr,
                    CLIP: tl.constexpr, DTYPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [row0, row0 + n_rows) of a [rows, DH] head matrix -> normed, clipped, rotated fp32 [BLOCK_H, BLOCK_D].

    The rotation needs each element's partner, so the rows are loaded twice (own and partner order): a decode token
    is a few KB, cheaper than a register shuffle. NORM_FULL normalises over all n_rows * DH values (OLMoE), so its
    caller must pass every head in one call; the weight is then [n_rows * DH] and indexed by row * DH + d.
    """
    rows = _rope_rows_load(src_ptr, row0, n_rows, stride_row, w_ptr, DH, ROT, PAIR, NORM, BLOCK_H, BLOCK_D)
    return _norm_rope_loaded(rows, n_rows, cos_row_ptr, sin_row_ptr, eps, clip, DH, ROT, PAIR, NORM, CLIP, DTYPE)


@triton.jit
def _rope_rows_load(src_ptr, row0, n_rows, stride_row, w_ptr, DH: tl.constexpr, ROT: tl.constexpr,
                    PAIR: tl.constexpr, NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """_norm_rope_rows' loads (rows in own and partner order, the norm weight likewise), none of which depends on the
    position: a caller issues them all before waiting on anything (rope_gqa_split_task). -> (x, xp, w, wp, offs_h,
    offs_d, mask)."""
    offs_h = row0 + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    partner, freq, first, in_rot = _rope_partner(offs_d, ROT, PAIR)
    mask_h = offs_h < row0 + n_rows
    mask = mask_h[:, None] & (offs_d < DH)[None, :]
    x = tl.load(src_ptr + offs_h[:, None] * stride_row + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src_ptr + offs_h[:, None] * stride_row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    w = x
    wp = xp
    if NORM == 2:       # full: weight [n_rows * DH]
        w_offs = (offs_h - row0)[:, None] * DH
        w = tl.load(w_ptr + w_offs + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + w_offs + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    elif NORM == 1:     # head: weight [DH]
        w = tl.load(w_ptr + offs_d, mask=offs_d < DH, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=offs_d < DH, other=0.0).to(tl.float32)[None, :]
    return x, xp, w, wp, offs_h, offs_d, mask


@triton.jit
def _norm_rope_loaded(rows, n_rows, cos_row_ptr, sin_row_ptr, eps, clip, DH: tl.constexpr, ROT: tl.constexpr,
                      PAIR: tl.constexpr, NORM: tl.constexpr, CLIP: tl.constexpr, DTYPE: tl.constexpr):
    """_norm_rope_rows' math on _rope_rows_load's result; the cos / sin row (it depends on the position) is loaded
    first, so its round trip overlaps the rows' if they are still in flight."""
    x, xp, w, wp, offs_h, offs_d, mask = rows
    partner, freq, first, in_rot = _rope_partner(offs_d, ROT, PAIR)
    c = tl.load(cos_row_ptr + freq, mask=in_rot, other=1.0)[None, :]
    s = tl.load(sin_row_ptr + freq, mask=in_rot, other=0.0)[None, :]
    if NORM == 2:       # full: RMS over the whole projection
        r = tl.rsqrt(tl.sum(tl.sum(x * x, axis=1), axis=0) / (n_rows * DH) + eps)
        x = round_to(round_to(x * r, DTYPE) * w, DTYPE)
        xp = round_to(round_to(xp * r, DTYPE) * wp, DTYPE)
    if CLIP:            # the clamped value is rounded to DTYPE, as torch's clamp of a bf16 tensor does
        x = round_to(tl.minimum(tl.maximum(x, -clip), clip), DTYPE)
        xp = round_to(tl.minimum(tl.maximum(xp, -clip), clip), DTYPE)
    if NORM == 1:       # head: RMS over each head's DH values
        r = tl.rsqrt(tl.sum(x * x, axis=1) / DH + eps)[:, None]
        x = round_to(round_to(x * r, DTYPE) * w, DTYPE)
        xp = round_to(round_to(xp * r, DTYPE) * wp, DTYPE)
    s = tl.where(first, -s, s)                          # x1' = x1 c - x2 s ; x2' = x2 c + x1 s
    return tl.where(in_rot[None, :], x * c + xp * s, x), offs_h, offs_d, mask


@triton.jit
def rope_append_task(pid, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr,
                     q_norm_ptr, k_norm_ptr, n_q_heads, n_kv_heads, max_len, eps, clip,
                     stride_qh, stride_kh, stride_vh, stride_kct, stride_kch, stride_vct, stride_vch, stride_cos,
                     DH: tl.constexpr, ROT: tl.constexpr, PAIR: tl.constexpr, NORM: tl.constexpr,
                     CLIP: tl.constexpr, KV_PER_PROG: tl.constexpr, REP: tl.constexpr,
                     BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program's share of the GQA rope+append: kv heads [pid*KV_PER_PROG, +KV_PER_PROG) and their q heads.

    q [Hq, DH], k / v [Hkv, DH] (one token, any float dtype, last dim contiguous) are rotated in place; k and v
    go to cache[pos]. REP = Hq / Hkv. NORM_FULL needs KV_PER_PROG = Hkv (one program sees the whole projection).
    """
    pos = tl.load(pos_ptr)
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    row = tl.minimum(pos, max_len - 1)          # the tables cover the cache; never read past them
    cos_row = cos_ptr + row * stride_cos
    sin_row = sin_ptr + row * stride_cos
    hq0 = pid * KV_PER_PROG * REP
    nq = tl.minimum(n_q_heads - hq0, KV_PER_PROG * REP)
    q, offs_h, offs_d, mask = _norm_rope_rows(q_ptr, hq0, nq, stride_qh, q_norm_ptr, cos_row, sin_row, eps, clip,
                                              DH, ROT, PAIR, NORM, CLIP, DTYPE, BLOCK_HQ, BLOCK_D)
    # in place: every thread must have read its partners before any thread overwrites them
    tl.debug_barrier()
    tl.store(q_ptr + offs_h[:, None] * stride_qh + offs_d[None, :], cast_to(q, DTYPE),
             mask=mask)

    hk0 = pid * KV_PER_PROG
    nk = tl.minimum(n_kv_heads - hk0, KV_PER_PROG)
    k, offs_h, offs_d, mask = _norm_rope_rows(k_ptr, hk0, nk, stride_kh, k_norm_ptr, cos_row, sin_row, eps, clip,
                                              DH, ROT, PAIR, NORM, CLIP, DTYPE, BLOCK_HK, BLOCK_D)
    k = cast_to(k, DTYPE)
    tl.debug_barrier()
    tl.store(k_ptr + offs_h[:, None] * stride_kh + offs_d[None, :], k, mask=mask)
    in_cache = pos < max_len
    tl.store(k_cache_ptr + pos * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :],
             cast_to(k, k_cache_ptr.dtype.element_ty), mask=mask & in_cache)
    v = tl.load(v_ptr + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if CLIP:
        v = round_to(tl.minimum(tl.maximum(v, -clip), clip), DTYPE)
        tl.store(v_ptr + offs_h[:, None] * stride_vh + offs_d[None, :], cast_to(v, DTYPE), mask=mask)
    tl.store(v_cache_ptr + pos * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :],
             cast_to(v, v_cache_ptr.dtype.element_ty), mask=mask & in_cache)


@triton.jit
def _rope_append_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr,
                        q_norm_ptr, k_norm_ptr, n_q_heads, n_kv_heads, max_len, eps, clip,
                        stride_qh, stride_kh, stride_vh, stride_kct, stride_kch, stride_vct, stride_vch, stride_cos,
                        DH: tl.constexpr, ROT: tl.constexpr, PAIR: tl.constexpr, NORM: tl.constexpr,
                        CLIP: tl.constexpr, KV_PER_PROG: tl.constexpr, REP: tl.constexpr,
                        BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl_begin(PDL)
    rope_append_task(tl.program_id(0), q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr,
                     q_norm_ptr, k_norm_ptr, n_q_heads, n_kv_heads, max_len, eps, clip,
                     stride_qh, stride_kh, stride_vh, stride_kct, stride_kch, stride_vct, stride_vch, stride_cos,
                     DH, ROT, PAIR, NORM, CLIP, KV_PER_PROG, REP, BLOCK_HQ, BLOCK_HK, BLOCK_D)


@triton.jit
def mla_rope_append_task(pid, q_ptr, kv_ptr, cache_ptr, pos_ptr, cos_ptr, sin_ptr, kv_norm_ptr,
                         n_heads, max_len, eps, stride_qh, stride_ct, stride_cos,
                         NOPE: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr, PAIR: tl.constexpr,
                         HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    """One program's share of the MLA rope+append: q heads [pid*BLOCK_H, +BLOCK_H); program 0 also appends.

    q [H, NOPE + ROPE]: its rope part q[:, NOPE:] is rotated in place. kv [R + ROPE] is the raw kv_a output of
    this token: cache[pos, :R] = rms_norm(kv[:R]) * kv_norm, cache[pos, R:] = rotate(kv[R:]) (shared by all heads).
    """
    pos = tl.load(pos_ptr)
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    row = tl.minimum(pos, max_len - 1)          # the tables cover the cache; never read past them
    cos_row = cos_ptr + row * stride_cos
    sin_row = sin_ptr + row * stride_cos
    h0 = pid * BLOCK_H
    q, offs_h, offs_p, mask = _norm_rope_rows(q_ptr + NOPE, h0, tl.minimum(n_heads - h0, BLOCK_H), stride_qh,
                                              q_ptr, cos_row, sin_row, eps, eps, ROPE, ROPE, PAIR, 0, False,
                                              DTYPE, BLOCK_H, BLOCK_P)
    tl.debug_barrier()                          # in place (see rope_append_task)
    tl.store(q_ptr + NOPE + offs_h[:, None] * stride_qh + offs_p[None, :],
             cast_to(q, DTYPE), mask=mask)
    if pid == 0:
        in_cache = pos < max_len
        CDTYPE: tl.constexpr = cache_ptr.dtype.element_ty
        # (new names: Triton's compiler rejects re-binding a tensor to another shape inside an `if`)
        kpe, row1, offs_p1, mask1 = _norm_rope_rows(kv_ptr + R, 0, 1, 0, kv_ptr, cos_row, sin_row, eps, eps,
                                                    ROPE, ROPE, PAIR, 0, False, DTYPE, 1, BLOCK_P)
        kpe = round_to(kpe, DTYPE)                  # the reference rounds k_pe to the activation dtype
        tl.store(cache_ptr + pos * stride_ct + R + offs_p1[None, :] + row1[:, None] * 0,
                 cast_to(kpe, CDTYPE), mask=mask1 & in_cache)
        offs_r = tl.arange(0, BLOCK_R)
        lat = tl.load(kv_ptr + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)
        if HAS_NORM:
            r = tl.rsqrt(tl.sum(lat * lat, axis=0) / R + eps)
            w = tl.load(kv_norm_ptr + offs_r, mask=offs_r < R, other=0.0).to(tl.float32)
            lat = round_to(round_to(lat * r, DTYPE) * w, DTYPE)
        tl.store(cache_ptr + pos * stride_ct + offs_r, cast_to(lat, CDTYPE),
                 mask=(offs_r < R) & in_cache)


@triton.jit
def _mla_rope_append_kernel(q_ptr, kv_ptr, cache_ptr, pos_ptr, cos_ptr, sin_ptr, kv_norm_ptr,
                            n_heads, max_len, eps, stride_qh, stride_ct, stride_cos,
                            NOPE: tl.constexpr, ROPE: tl.constexpr, R: tl.constexpr, PAIR: tl.constexpr,
                            HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
                            BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    pdl_begin(PDL)
    mla_rope_append_task(tl.program_id(0), q_ptr, kv_ptr, cache_ptr, pos_ptr, cos_ptr, sin_ptr, kv_norm_ptr,
                         n_heads, max_len, eps, stride_qh, stride_ct, stride_cos,
                         NOPE, ROPE, R, PAIR, HAS_NORM, BLOCK_H, BLOCK_P, BLOCK_R)


# ---- launchers ---------------------------------------------------------------------------------------------------

def rope_tables(rope: RopeSpec, max_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_len, rotary_dim / 2] float32 on `device` (attention factor folded in)."""
    cos, sin = cos_sin(rope, torch.arange(max_len))
    return cos.to(device).contiguous(), sin.to(device).contiguous()


def _style_pair(style: str) -> bool:
    if style not in ("half", "pair"):
        raise ValueError(f"rope style must be 'half' or 'pair', got {style!r}")
    return style == "pair"


def _check_pos(pos: torch.Tensor, device):
    if pos.dtype != torch.int32 or pos.numel() != 1 or pos.device != device:
        raise ValueError(f"pos must be a device int32 tensor with one element on {device}, got "
                         f"{pos.dtype} {tuple(pos.shape)} on {pos.device}")


def _check_tables(cos, sin, device, rot_max: int, max_len: int):
    if cos.shape != sin.shape or cos.dim() != 2 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32 [max_pos, rotary_dim/2] of one shape, got cos {tuple(cos.shape)} "
                         f"{cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}")
    if cos.device != device or sin.device != device or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError("cos/sin must be row-contiguous tables on the activations' device")
    if cos.shape[0] < max_len:
        raise ValueError(f"cos/sin: {cos.shape[0]} positions do not cover the cache's {max_len}")
    if 2 * cos.shape[1] > rot_max:
        raise ValueError(f"cos/sin: rotary_dim {2 * cos.shape[1]} exceeds the head's rotated size {rot_max}")


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...], device):
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    if t.device != device or t.stride(-1) != 1:
        raise ValueError(f"{name}: must be on {device} with a contiguous last dim")


def rope_append(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, style: str = "half",
                qk_norm: str | None = None, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                eps: float = 1e-6, clip_qkv: float | None = None, kv_per_prog: int = 1) -> None:
    """GQA decode: q [Hq, Dh], k / v [Hkv, Dh] of one token -> q, k rotated in place; k, v written at cache[pos].

    k_cache / v_cache [max_len, Hkv, Dh]; pos device int32 [1]; cos / sin [max_pos, rotary_dim/2] float32.
    qk_norm: None | "head" (q_norm / k_norm [Dh], Qwen3) | "full" (q_norm [Hq*Dh], k_norm [Hkv*Dh], OLMoE; runs
    as one program). clip_qkv clamps q, k, v (OLMoE) after a full norm, as the reference does. Launches only.
    """
    norm = check_rope_args(q, k, v, k_cache, v_cache, pos, cos, sin, qk_norm, q_norm, k_norm)
    Hq, Dh = q.shape
    Hkv = k.shape[0]
    dev = q.device
    if norm == NORM_FULL:
        kv_per_prog = Hkv
    kv_per_prog = max(1, min(kv_per_prog, Hkv))
    rep = Hq // Hkv
    grid = (triton.cdiv(Hkv, kv_per_prog),)
    block_hq, block_d = triton.next_power_of_2(kv_per_prog * rep), triton.next_power_of_2(Dh)
    # ~16 elements per thread and array: the row + partner + weight copies of a full-norm program spill otherwise
    warps = max(1, min(8, block_hq * block_d // 512))
    _rope_append_kernel[grid](
        q, k, v, k_cache, v_cache, pos, cos, sin, q_norm if norm else q, k_norm if norm else k,
        Hq, Hkv, k_cache.shape[0], float(eps), float(clip_qkv or 0.0),
        q.stride(0), k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), cos.stride(0),
        DH=Dh, ROT=2 * cos.shape[1], PAIR=_style_pair(style), NORM=norm, CLIP=clip_qkv is not None,
        KV_PER_PROG=kv_per_prog, REP=rep, BLOCK_HQ=block_hq, BLOCK_HK=triton.next_power_of_2(kv_per_prog),
        BLOCK_D=block_d, num_warps=warps, **launch_kw(dev))


def check_rope_args(q, k, v, k_cache, v_cache, pos, cos, sin, qk_norm, q_norm, k_norm) -> int:
    """rope_append's (and attention.rope_gqa_decode's) argument checks -> the NORM code."""
    if q.dim() != 2 or k.dim() != 2:
        raise ValueError(f"q must be [Hq, Dh] and k [Hkv, Dh], got q {tuple(q.shape)}, k {tuple(k.shape)}")
    Hq, Dh = q.shape
    Hkv = k.shape[0]
    dev = q.device
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q heads {Hq} must be a multiple of k heads {Hkv}")
    _check_rows("q", q, (Hq, Dh), dev)
    _check_rows("k", k, (Hkv, Dh), dev)
    _check_rows("v", v, (Hkv, Dh), dev)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k_cache.dim() != 3 or tuple(k_cache.shape[1:]) != (Hkv, Dh) or k_cache.stride(-1) != 1 or k_cache.device != dev:
        raise ValueError(f"k_cache: expected [max_len, {Hkv}, {Dh}] contiguous in Dh on {dev}, "
                         f"got {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.stride(-1) != 1 or v_cache.device != dev:
        raise ValueError(f"v_cache: expected the shape of k_cache {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    _check_pos(pos, dev)
    _check_tables(cos, sin, dev, Dh, k_cache.shape[0])
    norm = _NORM_CODES.get(qk_norm, -1)
    if norm < 0:
        raise ValueError(f"qk_norm must be None, 'head' or 'full', got {qk_norm!r}")
    if norm:
        want_q, want_k = ((Dh,), (Dh,)) if norm == NORM_HEAD else ((Hq * Dh,), (Hkv * Dh,))
        for name, w, want in (("q_norm", q_norm, want_q), ("k_norm", k_norm, want_k)):
            if w is None or tuple(w.shape) != want or not w.is_contiguous() or w.device != dev:
                raise ValueError(f"{name}: qk_norm={qk_norm!r} needs a contiguous {want} weight on {dev}, "
                                 f"got {None if w is None else tuple(w.shape)}")
    return norm


def mla_rope_append(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, *, nope: int, style: str = "pair", kv_norm: torch.Tensor | None = None,
                    eps: float = 1e-6, block_h: int = 16) -> None:
    """MLA decode: q [H, nope + rope] (rope part rotated in place); kv [r + rope] = this token's kv_a output ->
    cache[pos] = (rms_norm(kv[:r]) * kv_norm, rotate(kv[r:])) in the cache [max_len, r + rope]."""
    if q.dim() != 2 or q.shape[1] <= nope:
        raise ValueError(f"q must be [H, nope + rope] with nope={nope}, got {tuple(q.shape)}")
    H, rope = q.shape[0], q.shape[1] - nope
    dev = q.device
    _check_rows("q", q, (H, nope + rope), dev)
    if kv.dim() != 1 or kv.shape[0] <= rope or not kv.is_contiguous() or kv.device != dev or kv.dtype != q.dtype:
        raise ValueError(f"kv must be a contiguous [r + {rope}] vector of q's dtype on {dev}, got {tuple(kv.shape)}")
    r = kv.shape[0] - rope
    if cache.dim() != 2 or cache.shape[1] != r + rope or cache.stride(1) != 1 or cache.device != dev:
        raise ValueError(f"cache: expected [max_len, {r + rope}] contiguous in the last dim, got {tuple(cache.shape)}")
    if kv_norm is not None and (tuple(kv_norm.shape) != (r,) or not kv_norm.is_contiguous() or kv_norm.device != dev):
        raise ValueError(f"kv_norm: expected a contiguous [{r}] weight on {dev}, got {tuple(kv_norm.shape)}")
    _check_pos(pos, dev)
    _check_tables(cos, sin, dev, rope, cache.shape[0])
    if 2 * cos.shape[1] != rope:
        raise ValueError(f"cos/sin: MLA rotates the whole rope part ({rope}), tables give {2 * cos.shape[1]}")
    block_h = triton.next_power_of_2(max(1, min(block_h, H)))
    _mla_rope_append_kernel[(triton.cdiv(H, block_h),)](
        q, kv, cache, pos, cos, sin, kv_norm if kv_norm is not None else kv, H, cache.shape[0], float(eps),
        q.stride(0), cache.stride(0), cos.stride(0),
        NOPE=nope, ROPE=rope, R=r, PAIR=_style_pair(style), HAS_NORM=kv_norm is not None, BLOCK_H=block_h,
        BLOCK_P=triton.next_power_of_2(rope), BLOCK_R=triton.next_power_of_2(r), num_warps=1, **launch_kw(dev))


# ---- references (torch, same semantics as models/reference.py) --------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope_append_ref(q, k, v, k_cache, v_cache, pos: int, cos, sin, *, style="half", qk_norm=None, q_norm=None,
                    k_norm=None, eps=1e-6, clip_qkv=None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q, k) rotated (new tensors); writes k, v into the caches at `pos` (a Python int)."""
    Hq, Dh = q.shape
    Hkv = k.shape[0]
    if qk_norm == "full":
        q, k = _rms(q.reshape(1, -1), q_norm, eps).view(Hq, Dh), _rms(k.reshape(1, -1), k_norm, eps).view(Hkv, Dh)
    if clip_qkv is not None:
        q, k, v = (t.clamp(-clip_qkv, clip_qkv) for t in (q, k, v))
    if qk_norm == "head":
        q, k = _rms(q, q_norm, eps), _rms(k, k_norm, eps)
    c, s = cos[pos:pos + 1], sin[pos:pos + 1]
    q = apply_rope(q[None].float(), c, s, style)[0].to(q.dtype)
    k = apply_rope(k[None].float(), c, s, style)[0].to(k.dtype)
    if pos < k_cache.shape[0]:
        k_cache[pos], v_cache[pos] = k, v
    return q, k


def mla_rope_append_ref(q, kv, cache, pos: int, cos, sin, *, nope, style="pair", kv_norm=None, eps=1e-6):
    """-> q with its rope part rotated (new tensor); writes (latent, k_pe) into cache[pos]."""
    rope = q.shape[1] - nope
    r = kv.shape[0] - rope
    c, s = cos[pos:pos + 1], sin[pos:pos + 1]
    q_pe = apply_rope(q[None, :, nope:].float(), c, s, style)[0].to(q.dtype)
    k_pe = apply_rope(kv[None, None, r:].float(), c, s, style)[0, 0].to(kv.dtype)
    lat = _rms(kv[:r], kv_norm, eps) if kv_norm is not None else kv[:r]
    if pos < cache.shape[0]:
        cache[pos, :r], cache[pos, r:] = lat, k_pe
    return torch.cat([q[:, :nope], q_pe], dim=1)

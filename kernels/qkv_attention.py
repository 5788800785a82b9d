"""q/k/v GEMV + RoPE + KV append + decode attention in one launch (the graph backend's KIE_QKV_ATTN, session 27).

Why: the graph step runs q/k/v (one fused GEMV) and then RoPE + attention (attention.rope_gqa_decode: one program
per kv head at short contexts) as two launches, and a launch boundary costs ~0.55 us in the step (H100, NOTES.md
session 27) besides the second launch's ramp. Here the GEMV's row tiles are grouped by kv head (the head's REP q
heads, its k and its v rows); each tile stores its rows, then takes a ticket on its head's counter, and the tile
that takes the last ticket runs that head's RoPE + append + attention (attention.rope_gqa_split_task, one split) on
rows the others wrote. No program waits for another, so no residency assumption; the counter is reset by the last
ticket holder for the next launch. One split only: at long contexts (attention.default_num_splits > 1) the graph
keeps the two launches.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kie_moe.kccl.sync import ld_acquire

from .attention import _dot_dtype, _dot_prec, _gqa_out, default_num_splits, rope_gqa_split_task
from .gemv import FMT_ID, counters, gemv_tiles, input_args, make_out, weight_args
from .pdl import launch_kw, pdl_begin
from .rope import NORM_FULL, _style_pair, check_rope_args
from .tiles import _rstd, _store_out, _tile, rstd_block
from .weights import WeightHandle

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ATTN_BLOCK_N = 64   # keys per step of the attention part (rope_gqa_decode's default)


@triton.jit
def _qkv_attention_kernel(
    x_ptr, nw_ptr, w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr, bias_ptr, y_ptr, cnt_ptr,
    N, K, eps, stride_x8,
    k_cache_ptr, v_cache_ptr, pos_ptr, cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, sinks_ptr, out_ptr,
    max_len, window, qk_scale, clip, stride_kt, stride_kch, stride_vt, stride_vch, stride_cos, stride_oh,
    FMT: tl.constexpr, HAS_NW: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_X: tl.constexpr, PIPE: tl.constexpr,
    HKV: tl.constexpr, DH: tl.constexpr, ROT: tl.constexpr, PAIR: tl.constexpr, NORM: tl.constexpr,
    CLIP: tl.constexpr, REP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_R: tl.constexpr, ATTN_N: tl.constexpr,
    BLOCK_D: tl.constexpr, X8: tl.constexpr = 0, USE_ASM: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """grid (N / BLOCK_N,): y [N] = (rstd *) W (nw * x) (+ bias), rows [q heads (HKV * REP * DH) | k (HKV * DH) |
    v (HKV * DH)], DH % BLOCK_N == 0 (a tile never straddles two heads); then per kv head, the tile with the last
    ticket runs rope_gqa_split_task(head, split 0 of 1) on y's q / k / v -> out (and the cache row at pos)."""
    pdl_begin(PDL)
    pid = tl.program_id(0)
    n_start = pid * BLOCK_N
    acc = _tile(FMT, w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr, x_ptr, nw_ptr, stride_x8, n_start, N, 0,
                K, HAS_NW, BLOCK_N, BLOCK_K, PIPE)
    if HAS_NW:
        acc = acc * _rstd(x_ptr, K, eps, BLOCK_X)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    _store_out(acc, offs_n, offs_n < N, y_ptr, bias_ptr, y_ptr, HAS_BIAS, False)
    NQ: tl.constexpr = HKV * REP * DH
    NKV: tl.constexpr = HKV * DH
    head = tl.where(n_start < NQ, n_start // (REP * DH),
                    tl.where(n_start < NQ + NKV, (n_start - NQ) // DH, (n_start - NQ - NKV) // DH))
    TILES: tl.constexpr = (REP + 2) * DH // BLOCK_N       # a kv head's tiles: its q heads', its k's and its v's
    tl.debug_barrier()     # every thread's stores of this tile precede the ticket (a release)
    ticket = tl.atomic_add(cnt_ptr + head, 1, sem="acq_rel", scope="gpu")
    if ticket == TILES - 1:
        if USE_ASM:        # every thread acquires (one thread took the ticket): the other tiles' rows are visible
            ld_acquire(cnt_ptr + head)
        tl.debug_barrier()
        tl.atomic_xchg(cnt_ptr + head, 0)                 # zero again for the next launch
        rope_gqa_split_task(head, 0, y_ptr, y_ptr + NQ, y_ptr + NQ + NKV, k_cache_ptr, v_cache_ptr, pos_ptr,
                            cos_ptr, sin_ptr, q_norm_ptr, k_norm_ptr, sinks_ptr, out_ptr, out_ptr, out_ptr,
                            max_len, window, qk_scale, eps, clip, DH, DH, DH, stride_kt, stride_kch, stride_vt,
                            stride_vch, stride_cos, stride_oh, 0, 0, 0,
                            DH, ROT, PAIR, NORM, CLIP, REP, 1, HAS_WINDOW, HAS_SINKS, DOT_DTYPE, DOT_PREC,
                            BLOCK_R, ATTN_N, BLOCK_D, X8)


def qkv_attention_unfit(w: WeightHandle, q_heads: int, k_cache: torch.Tensor, window: int | None,
                        qk_norm: str | None, config=None) -> str | None:
    """Why qkv_rope_gqa_decode cannot take this layer (None: it can): a float-format fused q/k/v of
    (q_heads + 2 kv heads) x head_dim rows whose row tiles divide head_dim, a per-head (or no) q/k norm, and one
    attention split at this cache length."""
    if w.num_experts or FMT_ID[w.fmt] > 2:
        return f"{w.fmt} q/k/v (float formats only)"
    max_len, hkv, dh = k_cache.shape
    if q_heads % hkv or w.out_features != (q_heads + 2 * hkv) * dh:
        return f"q/k/v has {w.out_features} rows, not ({q_heads} + 2 x {hkv}) x {dh}"
    bn = gemv_tiles(w, config).block_n
    if dh % bn:
        return f"head_dim {dh} is not a multiple of the GEMV's {bn}-row tiles"
    if qk_norm == "full":
        return "a full-projection q/k norm needs every head in one program"
    span = min(max_len, window) if window is not None else max_len
    if default_num_splits(hkv, span, k_cache.device, ATTN_BLOCK_N) > 1:
        return f"{span} cached positions take more than one attention split"
    return None


def qkv_rope_gqa_decode(x: torch.Tensor, w: WeightHandle, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, q_heads: int, softmax_scale: float,
                        bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                        style: str = "half", qk_norm: str | None = None, q_norm: torch.Tensor | None = None,
                        k_norm: torch.Tensor | None = None, clip_qkv: float | None = None, window: int | None = None,
                        sinks: torch.Tensor | None = None, out_x8: bool = False, qkv_out: torch.Tensor | None = None,
                        config=None) -> tuple[torch.Tensor, torch.Tensor]:
    """gemv(x, w, bias=, norm_weight=, eps=) then attention.rope_gqa_decode on its q / k / v rows with one split, in
    one launch -> (o, qkv): the same values as the two launches (the same tile and task code). w: the fused q/k/v
    handle [(q_heads + 2 Hkv) * Dh, K]; caches [max_len, Hkv, Dh]; eps: the input RMSNorm's and the per-head q/k
    norms' (a model has one). qkv_attention_unfit must be None."""
    why = qkv_attention_unfit(w, q_heads, k_cache, window, qk_norm, config)
    if why:
        raise ValueError(f"qkv_rope_gqa_decode: {why}")
    max_len, hkv, dh = k_cache.shape
    dev = w.device
    N, K = w.out_features, w.in_features
    y = make_out(x, N, qkv_out, "qkv_out")
    nq = q_heads * dh
    q, k, v = y[:nq].view(q_heads, dh), y[nq:nq + hkv * dh].view(hkv, dh), y[nq + hkv * dh:].view(hkv, dh)
    norm = check_rope_args(q, k, v, k_cache, v_cache, pos, cos, sin, qk_norm, q_norm, k_norm)
    assert norm != NORM_FULL   # qkv_attention_unfit refused it
    if sinks is not None and (tuple(sinks.shape) != (q_heads,) or not sinks.is_contiguous() or sinks.device != dev):
        raise ValueError(f"sinks: expected a contiguous [{q_heads}] tensor on {dev}, got {tuple(sinks.shape)}")
    out, x8 = _gqa_out(q, None, out_x8, dev)
    cfg = gemv_tiles(w, config)
    x_in, nw_in, has_nw, stride_x8 = input_args(x, w.fmt, norm_weight, eps, None, K)
    rep = q_heads // hkv
    _qkv_attention_kernel[(triton.cdiv(N, cfg.block_n),)](
        x_in, nw_in, *weight_args(w), bias if bias is not None else y, y, counters(dev, hkv), N, K, eps, stride_x8,
        k_cache, v_cache, pos, cos, sin, q_norm if norm else q, k_norm if norm else k,
        sinks if sinks is not None else q, out, max_len, int(window or 0), softmax_scale * 1.4426950408889634,
        float(clip_qkv or 0.0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        cos.stride(0), out.stride(0),
        FMT=FMT_ID[w.fmt], HAS_NW=has_nw, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_X=rstd_block(K), PIPE=cfg.prefetch, HKV=hkv, DH=dh, ROT=2 * cos.shape[1], PAIR=_style_pair(style),
        NORM=norm, CLIP=clip_qkv is not None, REP=rep, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        DOT_DTYPE=_dot_dtype(k_cache.dtype), DOT_PREC=_dot_prec(k_cache.dtype),
        BLOCK_R=max(16, triton.next_power_of_2(rep)), ATTN_N=ATTN_BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(dh)),
        X8=x8, USE_ASM=dev.type == "cuda" and not _INTERPRET, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_kw(dev)
    )
    return out, y

"""Batch-1 decode GEMV for every weight format: y[N] = W[N, K] @ x[K] (+ bias, + residual), fp32 accumulation.

Decode is memory-bound: each weight byte is read once per token, so the kernels are built around streaming
[BLOCK_N, BLOCK_K] weight tiles at HBM speed and doing as little ALU per byte as possible.

Layers:
- per-format `@triton.jit` tile functions (`_tile_bf16`, `_tile_fp8`, `_tile_fp8_block`, `_tile_nvfp4`,
  `_tile_mxfp4`, dispatched by `_tile(FMT, ...)`; defined in tiles.py, re-exported here) compute one row tile's dot
  products over a K range. They take plain pointers + strides, so the monokernel and the MoE kernels call the very
  same inner loops;
- thin kernels over a grid of row tiles (x split-K) with fused epilogues: RMSNorm of the input in front, bias,
  residual, SwiGLU / gpt-oss clamped GLU of a gate/up pair;
- launchers (`gemv`, `rmsnorm_gemv`, `gemv_glu`, `gemv_swiglu`) that check, allocate, launch; torch references
  (`*_ref`) beside them.

fp4 weights (nvfp4, mxfp4) read their input as "x8", fp32 [8, K/8] with x8[e, j] = x[8j + e] (tiles.py says why).
The launchers make it with `prepare_x8` (one small launch, the RMSNorm folded in) unless the caller passes one:
route(x8_out=) writes it for the experts, the expert gate/up kernel writes h that way for an fp4 down projection.
Split-K (short-and-wide shapes) and the router finish in the same launch: the program that completes a row tile
last reduces the partials in a fixed order (deterministic) through counters that reset themselves.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .device_caps import e4m3_arg
from .pdl import launch_kw, pdl_begin
from .tiles import (ACT_ID, FMT_ID, _glu, _normed_block, _rstd, _rstd_post, _rstd_pre,  # noqa: F401
                    _split_reduce, _store_out, _tile, rstd_early_steps,
                    _tile_bf16, _tile_fp8, _tile_fp8_block, _tile_mxfp4, _tile_nvfp4, _tile_pair, _x8_offs,
                    rstd_block)
from .weights import FP8_BLOCK, WeightHandle, dequantize

__all__ = [
    "WeightHandle", "TileConfig", "DEFAULT_TILES", "DEFAULT_GLU_TILES", "FMT_ID",
    "gemv", "rmsnorm_gemv", "gemv_glu", "gemv_swiglu", "prepare_x8",
    "gemv_ref", "rmsnorm_gemv_ref", "gemv_glu_ref", "gemv_swiglu_ref", "glu_ref",
]


@dataclass(frozen=True)
class TileConfig:
    """Launch shape of one kernel. block_k counts weight ELEMENTS (fp4: 2 per byte); split_k None = from the shape."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int | None = None
    prefetch: bool = True  # software-pipeline the weight loads one K step deep (PIPE constexpr)


# H200 defaults (132 SMs, ~4.5 TB/s, ~17 B/clk/SM: an SM issuing 128 thread-instructions per clock affords ~7.4 per
# byte at full bandwidth). Picked from the sm_90 SASS of each loop (benchmarks/sass_count.py: instructions per
# weight + scale byte, registers -> resident programs per SM); benchmarks/kernels_micro.py --sweep times them.
# Per step and program: bf16 8 KB (8x512x2, 2.0 instr/B, 56 regs, prefetched); fp8 8 KB (3.3 instr/B, 64 regs;
# prefetching fp8 costs byte repacking: 5.5 instr/B); fp8-block 8 KB, the fp8 shape (3.6 instr/B, 56 regs; was
# 64x128: 128-byte row pieces); nvfp4 4 KB + scales (16x512/2, 8.3 instr/B, 80 regs); mxfp4 the same shape (8.5
# instr/B, 71 regs: each thread holds whole 32-element groups, so 16x1024 would need 159). fp4 is ALU-bound on CUDA
# cores: per u32 word of 8 codes 7 integer ops + 4 byte permutes + 8 f16->f32 converts + 8 FMAs (tiles.py).
DEFAULT_TILES = {
    "bf16": TileConfig(8, 512), "fp16": TileConfig(8, 512), "fp32": TileConfig(4, 512),
    "fp8": TileConfig(16, 512, prefetch=False), "fp8_block": TileConfig(16, 512, prefetch=False),
    "nvfp4": TileConfig(16, 512), "mxfp4": TileConfig(16, 512),
}
# Gate/up kernels hold the gate tile's result and the up tile's prologue at once, the expert down kernel loops over
# slots around the tile loop: same loops, half the tile keeps them at <= ~128 registers (sm_90 SASS).
DEFAULT_GLU_TILES = {
    **DEFAULT_TILES,
    "fp8": TileConfig(8, 512, prefetch=False), "fp8_block": TileConfig(8, 512, prefetch=False),
    "nvfp4": TileConfig(8, 512), "mxfp4": TileConfig(16, 512),
}
_MIN_BLOCK_K = {"nvfp4": 16, "mxfp4": 32}
PROGRAMS_PER_SM = 4  # split-K / slot-split target: enough resident programs per SM to cover HBM latency
# A default-tiled GEMV that would split K (fewer than 2 row tiles per SM: o_proj, dense down projections) takes
# narrower row tiles with 1024-wide K steps instead, so no program waits on a split-K reduction. The qwen3-30b-a3b
# fp8 o_proj layer sweep timed 4 x 1024 without a split at 5.12 us against 6.18 us for 16 x 512 split 4; end to end
# (H200, separate processes, results/2026-12-04-h200-s10-rows-first-ab) qwen3-30b-a3b graph fp8 450.8 -> 460.2
# tok/s, llama-3.2-1b bf16 1,032.5 -> 1,078.6. On by default since; KIE_GEMV_ROWS_FIRST=0 restores split-K.
ROWS_FIRST = os.environ.get("KIE_GEMV_ROWS_FIRST", "1") == "1"
# An nvfp4 / mxfp4 GEMV of >= MMA_MIN_ROWS rows whose caller has no x8 runs on the tensor cores (kernels/fp4_mma.py).
# H200, same process (results/2026-12-04-h200-s13-mma): 65536 x 8192 nvfp4 62.0 -> 83.2%, mxfp4 63.9 -> 80.8% of the
# probe; 151936 x 2048 (a quantized lm_head) 57.6 -> 73.8% / 60.2 -> 74.2%; 32768 x 4096 52.1 -> 57.1% / 54.2 ->
# 59.5%; at 16384 rows and fewer it loses (each warp walks its 32 rows' whole K: too few warps). Session 12 kept
# mxfp4 off (its HMUL2 scale was exact only for E8M0 2^-19 .. 2^5); the scale is an fp32 FFMA since session 13. A
# handle in packing "mma" (fp4_mma.pack_for_mma; the graph backend's quantized lm_head) must take this path: 86.1%
# nvfp4 / 83.9% mxfp4 on 65536 x 8192.
# KIE_GEMV_MMA=0 turns the dispatch off (A/B).
MMA_MIN_ROWS = 32768
MMA_GEMV = os.environ.get("KIE_GEMV_MMA", "1") == "1"


# ======================================================================================================================
# Kernels
# ======================================================================================================================
@triton.jit
def _x8_kernel(x_ptr, nw_ptr, x8_ptr, K, eps, HAS_NW: tl.constexpr, BLOCK: tl.constexpr, BLOCK_X: tl.constexpr,
               PDL: tl.constexpr = False):
    """grid (cdiv(K, BLOCK),): x8[e, j] = (x * rstd * nw)[8j + e], fp32 [8, K/8]."""
    pdl_begin(PDL)
    offs, mask, x = _normed_block(x_ptr, nw_ptr, K, eps, HAS_NW, BLOCK, BLOCK_X)
    tl.store(x8_ptr + _x8_offs(offs, K // 8), x, mask=mask)


@triton.jit
def _gemv_kernel(
    x_ptr, nw_ptr, w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr,
    bias_ptr, res_ptr, y_ptr, part_ptr, cnt_ptr,
    N, K, k_per_split, eps, stride_x8,
    FMT: tl.constexpr, HAS_NW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_X: tl.constexpr,
    PIPE: tl.constexpr, PDL: tl.constexpr = False, NX: tl.constexpr = 0,
):
    """grid (cdiv(N, BLOCK_N), SPLIT_K): y[N] = (rstd *) W[N, K] @ (nw *) x[K] (+ bias) (+ residual).
    fp4 formats: x_ptr is x8 (prepare_x8, norm applied there) and HAS_NW is False. NX > 0 (SPLIT_K 1): rstd's
    loads issued before the tile loop (tiles.rstd_early_steps)."""
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if NX > 0:
        xs = _rstd_pre(x_ptr, K, BLOCK_X, NX)
    acc = _tile(FMT, w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr, x_ptr, nw_ptr, stride_x8,
                pid_n * BLOCK_N, N, k_lo, k_hi, HAS_NW, BLOCK_N, BLOCK_K, PIPE)
    if SPLIT_K == 1:
        if NX > 0:
            acc = acc * _rstd_post(xs, K, eps, BLOCK_X, NX)
        elif HAS_NW:
            acc = acc * _rstd(x_ptr, K, eps, BLOCK_X)
        _store_out(acc, offs_n, n_mask, y_ptr, bias_ptr, res_ptr, HAS_BIAS, HAS_RES)
    else:
        acc, is_last = _split_reduce(acc, part_ptr, cnt_ptr, pid_n, pid_k, offs_n, n_mask, N, SPLIT_K)
        if is_last:
            if HAS_NW:
                acc = acc * _rstd(x_ptr, K, eps, BLOCK_X)
            _store_out(acc, offs_n, n_mask, y_ptr, bias_ptr, res_ptr, HAS_BIAS, HAS_RES)


@triton.jit
def _glu_kernel(
    x_ptr, nw_ptr,
    wg_ptr, stride_wgn, sg_ptr, stride_sgn, stride_sgk, gsg_ptr,
    wu_ptr, stride_wun, su_ptr, stride_sun, stride_suk, gsu_ptr,
    bg_ptr, stride_bg, bu_ptr, stride_bu, y_ptr,
    N, K, eps, limit, alpha, stride_x8,
    FMT: tl.constexpr, HAS_NW: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_X: tl.constexpr, PIPE: tl.constexpr,
    Y_X8: tl.constexpr = False, PDL: tl.constexpr = False, PAIR: tl.constexpr = False, NX: tl.constexpr = 0,
):
    """grid (cdiv(N, BLOCK_N),): y[N] = glu(Wg x + bg, Wu x + bu), x optionally RMS-normed in front; Y_X8: y stored
    as fp32 [8, N/8] in the x8 layout; PAIR: gate and up rows in one K loop (tiles._tile_pair)."""
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    n_start = pid_n * BLOCK_N
    if NX > 0:
        xs = _rstd_pre(x_ptr, K, BLOCK_X, NX)
    if PAIR:
        g, u = _tile_pair(FMT, wg_ptr, wu_ptr, stride_wgn, sg_ptr, su_ptr, stride_sgn, stride_sgk, x_ptr, nw_ptr,
                          n_start, N, 0, K, HAS_NW, BLOCK_N, BLOCK_K, PIPE)
    else:
        g = _tile(FMT, wg_ptr, stride_wgn, sg_ptr, stride_sgn, stride_sgk, gsg_ptr, x_ptr, nw_ptr, stride_x8,
                  n_start, N, 0, K, HAS_NW, BLOCK_N, BLOCK_K, PIPE)
        u = _tile(FMT, wu_ptr, stride_wun, su_ptr, stride_sun, stride_suk, gsu_ptr, x_ptr, nw_ptr, stride_x8,
                  n_start, N, 0, K, HAS_NW, BLOCK_N, BLOCK_K, PIPE)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if HAS_NW:
        if NX > 0:
            r = _rstd_post(xs, K, eps, BLOCK_X, NX)
        else:
            r = _rstd(x_ptr, K, eps, BLOCK_X)
        g = g * r
        u = u * r
    if HAS_BIAS:
        g += tl.load(bg_ptr + offs_n * stride_bg, mask=n_mask, other=0.0).to(tl.float32)
        u += tl.load(bu_ptr + offs_n * stride_bu, mask=n_mask, other=0.0).to(tl.float32)
    y_offs = _x8_offs(offs_n, N // 8) if Y_X8 else offs_n
    tl.store(y_ptr + y_offs, _glu(g, u, limit, alpha, ACT).to(y_ptr.dtype.element_ty), mask=n_mask)


# ======================================================================================================================
# Host side
# ======================================================================================================================
_NUM_SMS: dict = {}
_COUNTERS: dict = {}
_RETIRED: list = []  # grown-out counter buffers stay alive: a captured CUDA graph may still point at them


def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device; 1 on CPU (the interpreter gains nothing from more programs)."""
    if device.type != "cuda":
        return 1
    if device not in _NUM_SMS:
        _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _NUM_SMS[device]


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters shared by all split-K / last-program-finishes kernels on `device`. Each launch leaves
    the ones it used at zero again, so launches on one stream (or in one CUDA graph) can share them."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def weight_args(w: WeightHandle) -> tuple:
    """(w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr) of a handle, in the tile functions' order."""
    if w.packing != "checkpoint":
        raise ValueError(f"{w.fmt} weight [{w.out_features}, {w.in_features}] is packed for the tensor-core GEMV "
                         f"(packing {w.packing!r}): only gemv() on >= {MMA_MIN_ROWS} rows without x8 or a tile config "
                         f"reads it (kernels/fp4_mma.py)")
    wt, s = e4m3_arg(w.weight), e4m3_arg(w.scale)      # sm < 89: e4m3 as its bytes (device_caps)
    has_s = s is not None
    s = s if has_s else wt                        # unused pointers: any tensor of an allowed type
    gs = w.global_scale if w.global_scale is not None else wt
    return (wt, wt.stride(-2), s, s.stride(-2) if has_s else 0, s.stride(-1) if has_s else 0, gs)


def pick_block_k(K: int, block_k: int, fmt: str) -> int:
    """Halve block_k while the masked tail of the last K step exceeds 1/8 of K (K=768: 512 -> 256; K=2880 keeps 512).
    Masked lanes load no bytes, but they still cost issue slots, which the fp4 paths are short of."""
    lo = _MIN_BLOCK_K.get(fmt, 16)
    bk = max(block_k, lo)
    while bk // 2 >= lo and (triton.cdiv(K, bk) * bk - K) * 8 > K:
        bk //= 2
    return bk


def resolve_config(w: WeightHandle, config: TileConfig | None, table: dict | None = None) -> TileConfig:
    """config as given (checked), or the format's default from `table` with block_k fitted to K."""
    cfg = config or (table or DEFAULT_TILES)[w.fmt]
    if not isinstance(cfg, TileConfig):
        raise TypeError(f"config: expected a TileConfig, got {type(cfg).__name__}")
    g = _MIN_BLOCK_K.get(w.fmt, 1)
    if cfg.block_k % g or cfg.block_k & (cfg.block_k - 1) or cfg.block_n & (cfg.block_n - 1):
        raise ValueError(f"TileConfig {cfg}: block_n / block_k must be powers of two, block_k a multiple of {g}")
    if w.fmt == "fp8_block" and FP8_BLOCK % cfg.block_n:
        raise ValueError(f"TileConfig {cfg}: fp8_block needs block_n dividing {FP8_BLOCK} (one scale row per tile)")
    if config is None:
        cfg = dataclasses.replace(cfg, block_k=pick_block_k(w.in_features, cfg.block_k, w.fmt))
    return cfg


def plan_split(n_tiles: int, K: int, block_k: int, split_k: int | None, device: torch.device) -> tuple[int, int]:
    """(split, k_per_split). Auto: with fewer than 2 row tiles per SM (o_proj, kv projections, routers), split K so
    that about PROGRAMS_PER_SM programs per SM keep loads in flight; each split covers whole BLOCK_K steps."""
    steps = triton.cdiv(K, block_k)
    if split_k is None:
        split_k = auto_split(n_tiles, steps, device)
    split_k = max(1, min(split_k, steps))
    k_per_split = triton.cdiv(steps, split_k) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


def auto_split(n_tiles: int, max_split: int, device: torch.device) -> int:
    sms = num_sms(device)
    if n_tiles >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, n_tiles), max_split, 32))


def check_x(x: torch.Tensor, K: int, device: torch.device, name: str = "x"):
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: dtype {x.dtype}, expected bf16 / fp16 / fp32")
    if x.shape[-1] != K or x.numel() != K:
        raise ValueError(f"{name}: shape {tuple(x.shape)}, expected [{K}] or [1, {K}] (batch-1 decode)")
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if x.device != device:
        raise ValueError(f"{name}: on {x.device}, weights on {device}")


def check_vec(t: torch.Tensor | None, n: int, device: torch.device, name: str, contiguous: bool = True):
    if t is None:
        return
    if not t.is_floating_point():
        raise TypeError(f"{name}: dtype {t.dtype}, expected a float dtype")
    if t.numel() != n or (t.dim() and t.shape[-1] != n):
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {n} elements")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, weights on {device}")


def make_out(x: torch.Tensor, n: int, out: torch.Tensor | None, name: str = "out") -> torch.Tensor:
    if out is None:
        return torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    check_vec(out, n, x.device, name)
    return out


def is_fp4(fmt: str) -> bool:
    return FMT_ID[fmt] >= 3


def prepare_x8(x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp4 kernels' input layout: fp32 [8, K/8], x8[e, j] = x[8j + e] (RMS-normalised with norm_weight when
    given). One small launch; callers that feed several fp4 GEMVs from one x (q/k/v, gate/up, all experts) make it
    once and pass it as `x8=`."""
    K = x.shape[-1]
    if K % 8 or x.numel() != K:
        raise ValueError(f"prepare_x8: x shape {tuple(x.shape)}: need batch 1 and K % 8 == 0")
    check_vec(norm_weight, K, x.device, "norm_weight")
    if out is None:
        out = torch.empty((8, K // 8), dtype=torch.float32, device=x.device)
    elif out.shape != (8, K // 8) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"prepare_x8: out must be a contiguous fp32 [8, {K // 8}], got {out.dtype} {tuple(out.shape)}")
    BLOCK = min(1024, triton.next_power_of_2(K))
    _x8_kernel[(triton.cdiv(K, BLOCK),)](x, norm_weight if norm_weight is not None else x, out, K, eps,
                                         HAS_NW=norm_weight is not None, BLOCK=BLOCK,
                                         BLOCK_X=rstd_block(K), **launch_kw(x.device))
    return out


def input_args(x: torch.Tensor | None, fmt: str, norm_weight: torch.Tensor | None, eps: float,
               x8: torch.Tensor | None, K: int | None = None) -> tuple:
    """(x_ptr, nw_ptr, HAS_NW, stride_x8) for a kernel reading x: float formats read x (norm fused in the GEMV);
    fp4 formats read x8, made here unless given (the norm then happens in prepare_x8). K: the weight's in_features
    (default x's length; given, an x8 without x is checked against it)."""
    K = x.shape[-1] if K is None else K
    if not is_fp4(fmt):
        return x, (norm_weight if norm_weight is not None else x), norm_weight is not None, 0
    if x8 is None:
        x8 = prepare_x8(x, norm_weight, eps)
    elif x8.shape != (8, K // 8) or x8.dtype != torch.float32 or not x8.is_contiguous():
        raise ValueError(f"x8: expected a contiguous fp32 [8, {K // 8}] (prepare_x8), got {x8.dtype} {tuple(x8.shape)}")
    return x8, x8, False, K // 8


def gemv(x: torch.Tensor, w: WeightHandle, *, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
         out: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
         x8: torch.Tensor | None = None, config: TileConfig | None = None) -> torch.Tensor:
    """y = W @ x (+ bias) (+ residual) for a batch-1 x [K] or [1, K]; y has x's leading shape and dtype (or out's).
    With norm_weight, x is RMS-normalised first: W @ (x * rstd(x) * norm_weight) (see rmsnorm_gemv).
    fp4 weights: x8 = prepare_x8(x, norm_weight, eps) if already made (else made here, one extra launch), x may
    then be None (with `out` given: e.g. gemv_glu(out_x8=True)'s output feeding an fp4 down projection); a large
    nvfp4 / mxfp4 GEMV without x8 runs on the tensor cores instead (use_mma)."""
    if w.num_experts:
        raise ValueError("gemv: weight handle is an expert stack; use kie_moe.kernels.moe.moe_experts")
    N, K = w.out_features, w.in_features
    if x is None:
        if x8 is None or not is_fp4(w.fmt) or out is None:
            raise ValueError(f"gemv: x is None: only an fp4 weight (this is {w.fmt}) given x8 and out can do "
                             "without it")
        check_vec(out, N, w.device, "out")
    elif use_mma(w, x8, config):
        from .fp4_mma import gemv_fp4_mma  # fp4_mma imports this module's checks
        return gemv_fp4_mma(x, w, bias=bias, residual=residual, out=out, norm_weight=norm_weight, eps=eps)
    else:
        check_x(x, K, w.device)
    check_vec(bias, N, w.device, "bias")
    check_vec(residual, N, w.device, "residual")
    check_vec(norm_weight, K, w.device, "norm_weight")
    y = make_out(x, N, out) if x is not None else out
    cfg = gemv_tiles(w, config)
    n_tiles = triton.cdiv(N, cfg.block_n)
    split, k_per_split = plan_split(n_tiles, K, cfg.block_k, cfg.split_k, w.device)
    part = torch.empty((split, N), dtype=torch.float32, device=w.device) if split > 1 else y
    cnt = counters(w.device, n_tiles) if split > 1 else y
    x_in, nw_in, has_nw, stride_x8 = input_args(x, w.fmt, norm_weight, eps, x8, K)
    _gemv_kernel[(n_tiles, split)](
        x_in, nw_in, *weight_args(w),
        bias if bias is not None else y, residual if residual is not None else y, y, part, cnt,
        N, K, k_per_split, eps, stride_x8,
        FMT=FMT_ID[w.fmt], HAS_NW=has_nw, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        SPLIT_K=split, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_X=rstd_block(K),
        PIPE=cfg.prefetch, NX=rstd_early_steps(K, cfg.num_warps) if has_nw and split == 1 else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kw(w.device)
    )
    return y


def use_mma(w: WeightHandle, x8: torch.Tensor | None, config: TileConfig | None) -> bool:
    """gemv's dispatch to the tensor-core fp4 kernel (MMA_MIN_ROWS): nvfp4 / mxfp4, no caller x8 or tile config,
    >= 32768 rows, K % 32 == 0 and aligned rows (mma_unreadable)."""
    if (not MMA_GEMV or w.fmt not in ("nvfp4", "mxfp4") or x8 is not None or config is not None
            or w.out_features < MMA_MIN_ROWS):
        return False
    from .fp4_mma import mma_unreadable  # fp4_mma imports this module's checks
    return mma_unreadable(w) is None


def gemv_tiles(w: WeightHandle, config: TileConfig | None) -> TileConfig:
    """A GEMV's tiles: config as given, else the format's default with the rows-first rule (ROWS_FIRST). Small fp8 /
    fp8-block launches keep their tiles without the weight prefetch: with it, qwen3-30b-a3b fp8 lost 2.7% (H200,
    NOTES.md session 23)."""
    cfg = resolve_config(w, config)
    if config is not None:
        return cfg
    if ROWS_FIRST:
        cfg = rows_first(cfg, w.out_features, w.in_features, w.fmt, w.device)
    return cfg


def rows_first(cfg: TileConfig, N: int, K: int, fmt: str, device: torch.device) -> TileConfig:
    """The rows-first tile rule (ROWS_FIRST): halve block_n (down to 4) while there are fewer than 2 row tiles per SM,
    with K steps of 1024 (fitted to K) once it narrowed, and no split-K when that reaches 2 row tiles per SM."""
    sms, bn = num_sms(device), cfg.block_n
    while bn > 4 and triton.cdiv(N, bn) < 2 * sms:
        bn //= 2
    if bn == cfg.block_n:
        return cfg
    return dataclasses.replace(cfg, block_n=bn, block_k=pick_block_k(K, max(cfg.block_k, 1024), fmt),
                               split_k=1 if triton.cdiv(N, bn) >= 2 * sms else cfg.split_k)


def rmsnorm_gemv(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: WeightHandle, **kw) -> torch.Tensor:
    """W @ rmsnorm(x) in one launch (fp32 norm, no rounding of the normed x). Gemma-style (1 + w) norms: pass 1 + w."""
    return gemv(x, w, norm_weight=norm_weight, eps=eps, **kw)


# Float gate and up rows of a GLU (gemv_glu, moe_experts) in one K loop that loads each step's x (and RMSNorm weight)
# once for both instead of once per matrix. On by default since session 20 measured it on an H100 (NOTES.md): routed
# experts 85.7 -> 89.9% of the probe (fp8), qwen3-30b-a3b fp8 decode +1.3%, llama-3.2-1b bf16 +2.5%; KIE_GLU_PAIR=0
# turns it off (A/B), glu_pair= per call.
GLU_PAIR = os.environ.get("KIE_GLU_PAIR", "1") != "0"


def glu_pair_choice(fmt: str, ga: tuple, ua: tuple, glu_pair: bool | None, who: str) -> bool:
    """Whether a GLU launch runs PAIR (tiles._tile_pair): asked for (glu_pair, None: GLU_PAIR) and possible (a float
    format, gate and up with one stride layout: weight_args' row and scale strides equal). Asking for it where it is
    not possible is an error."""
    can = FMT_ID[fmt] <= 2 and (ga[1], ga[3], ga[4]) == (ua[1], ua[3], ua[4])
    if glu_pair and not can:
        raise ValueError(f"{who}: glu_pair needs float gate / up weights of one stride layout ({fmt}; row strides "
                         f"{ga[1]} / {ua[1]}, scale strides {ga[3:5]} / {ua[3:5]})")
    return can and (GLU_PAIR if glu_pair is None else glu_pair)


def gemv_glu(x: torch.Tensor, w_gate: WeightHandle, w_up: WeightHandle, *, act: str = "silu", limit: float = 7.0,
             alpha: float = 1.702, gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
             norm_weight: torch.Tensor | None = None, eps: float = 1e-6, out: torch.Tensor | None = None,
             x8: torch.Tensor | None = None, config: TileConfig | None = None, out_x8: bool = False,
             glu_pair: bool | None = None) -> torch.Tensor:
    """glu(W_gate x + b_g, W_up x + b_u): act "silu" -> silu(g) * u; "gpt_oss" -> g, u clamped at `limit`, then
    (u + 1) * g * sigmoid(alpha g). Interleaved gate/up (gpt-oss): pass w.rows(0, None, 2), w.rows(1, None, 2) and bias[0::2], bias[1::2].
    out_x8: the result as fp32 [8, N/8] in the x8 layout, what an fp4 down projection reads (gemv(None, w_down,
    x8=y, out=...)): no prepare_x8 launch between the two, and no rounding of h to x's dtype. glu_pair: gate and up
    in one K loop (glu_pair_choice)."""
    if act not in ACT_ID:
        raise ValueError(f"gemv_glu: act {act!r}, expected one of {sorted(ACT_ID)}")
    if w_gate.fmt != w_up.fmt and FMT_ID[w_gate.fmt] != FMT_ID[w_up.fmt]:
        raise ValueError(f"gemv_glu: w_gate is {w_gate.fmt}, w_up is {w_up.fmt}; they must share a format")
    if (w_gate.out_features, w_gate.in_features) != (w_up.out_features, w_up.in_features):
        raise ValueError(f"gemv_glu: w_gate [{w_gate.out_features}, {w_gate.in_features}] vs w_up "
                         f"[{w_up.out_features}, {w_up.in_features}]")
    if w_gate.num_experts or w_up.num_experts:
        raise ValueError("gemv_glu: expert stacks go through kie_moe.kernels.moe.moe_experts")
    N, K = w_gate.out_features, w_gate.in_features
    check_x(x, K, w_gate.device)
    check_vec(norm_weight, K, w_gate.device, "norm_weight")
    if (gate_bias is None) != (up_bias is None):
        raise ValueError("gemv_glu: pass both gate_bias and up_bias or neither")
    check_vec(gate_bias, N, w_gate.device, "gate_bias", contiguous=False)
    check_vec(up_bias, N, w_gate.device, "up_bias", contiguous=False)
    if out_x8:
        if N % 8:
            raise ValueError(f"gemv_glu: out_x8 needs out_features % 8 == 0, got {N}")
        if out is None:
            out = torch.empty((8, N // 8), dtype=torch.float32, device=x.device)
        elif out.shape != (8, N // 8) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"gemv_glu: out with out_x8 must be a contiguous fp32 [8, {N // 8}], got {out.dtype} "
                             f"{tuple(out.shape)}")
        y = out
    else:
        y = make_out(x, N, out)
    cfg = resolve_config(w_gate, config, DEFAULT_GLU_TILES)
    x_in, nw_in, has_nw, stride_x8 = input_args(x, w_gate.fmt, norm_weight, eps, x8)
    ga, ua = weight_args(w_gate), weight_args(w_up)
    pair = glu_pair_choice(w_gate.fmt, ga, ua, glu_pair, "gemv_glu")
    _glu_kernel[(triton.cdiv(N, cfg.block_n),)](
        x_in, nw_in, *ga, *ua,
        gate_bias if gate_bias is not None else y, gate_bias.stride(-1) if gate_bias is not None else 0,
        up_bias if up_bias is not None else y, up_bias.stride(-1) if up_bias is not None else 0, y,
        N, K, eps, limit, alpha, stride_x8,
        FMT=FMT_ID[w_gate.fmt], HAS_NW=has_nw, HAS_BIAS=gate_bias is not None, ACT=ACT_ID[act],
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_X=rstd_block(K),
        PIPE=cfg.prefetch, Y_X8=out_x8, PAIR=pair, NX=rstd_early_steps(K, cfg.num_warps) if has_nw else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_kw(x.device)
    )
    return y


def gemv_swiglu(x: torch.Tensor, w_gate: WeightHandle, w_up: WeightHandle, **kw) -> torch.Tensor:
    """silu(W_gate x) * (W_up x) in one launch."""
    return gemv_glu(x, w_gate, w_up, act="silu", **kw)


# ======================================================================================================================
# Torch references (fp32 math on dequantized weights; the oracle for the kernels)
# ======================================================================================================================
def _normed(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float().reshape(-1)
    if norm_weight is None:
        return xf
    return xf * torch.rsqrt(xf.pow(2).mean() + eps) * norm_weight.float().reshape(-1)


def gemv_ref(x, w: WeightHandle, *, bias=None, residual=None, out_dtype=None, norm_weight=None, eps=1e-6):
    y = dequantize(w) @ _normed(x, norm_weight, eps)
    if bias is not None:
        y = y + bias.float().reshape(-1)
    if residual is not None:
        y = y + residual.float().reshape(-1)
    return y.reshape(*x.shape[:-1], -1).to(out_dtype or x.dtype)


def rmsnorm_gemv_ref(x, norm_weight, eps, w: WeightHandle, **kw):
    return gemv_ref(x, w, norm_weight=norm_weight, eps=eps, **kw)


def glu_ref(g: torch.Tensor, u: torch.Tensor, act: str = "silu", limit: float = 7.0, alpha: float = 1.702):
    if ACT_ID[act] == 0:
        return torch.nn.functional.silu(g) * u
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(alpha * g))


def gemv_glu_ref(x, w_gate: WeightHandle, w_up: WeightHandle, *, act="silu", limit=7.0, alpha=1.702,
                 gate_bias=None, up_bias=None, norm_weight=None, eps=1e-6, out_dtype=None):
    xn = _normed(x, norm_weight, eps)
    g, u = dequantize(w_gate) @ xn, dequantize(w_up) @ xn
    if gate_bias is not None:
        g, u = g + gate_bias.float().reshape(-1), u + up_bias.float().reshape(-1)
    return glu_ref(g, u, act, limit, alpha).reshape(*x.shape[:-1], -1).to(out_dtype or x.dtype)


def gemv_swiglu_ref(x, w_gate, w_up, **kw):
    return gemv_glu_ref(x, w_gate, w_up, act="silu", **kw)

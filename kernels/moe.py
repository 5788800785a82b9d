"""MoE decode kernels: the router (logits -> scores -> top-k on the device) and the routed experts, which read the
top-k ids from device memory and stream ONLY those experts' rows (no host sync, CUDA-graph safe).

route():       one launch. Row tiles (x split-K) of the router GEMV write partial logits; the program that finishes
               last does the scoring and top-k: softmax / sigmoid / gpt-oss "softmax over the top-k logits",
               e_score_correction bias (choice only), group-limited top-k, renormalisation, routed_scaling_factor.
moe_experts(): two launches. (1) grid (row tiles of I, top-k slot): h[slot] = glu(Wg[e] x, Wu[e] x);
               (2) grid (row tiles of H, slot groups): y = sum_slot w[slot] * (Wd[e] h[slot] + bd[e]) (+ residual).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .fp4_mma import check_xh, xh_pos
from .gemv import (DEFAULT_GLU_TILES, TileConfig, check_vec, check_x, counters, gemv_tiles, glu_pair_choice,
                   glu_ref, input_args, is_fp4, make_out, num_sms, plan_split, resolve_config, weight_args)
from .pdl import launch_kw, pdl_begin, reg_cap
from .tiles import (ACT_ID, FMT_ID, _glu, _rstd, _split_reduce, _store_out, _tile,
                    _tile_bf16, _tile_pair, _x8_offs,
                    rstd_block)
from .weights import WeightHandle, dequantize

__all__ = ["RouterConfig", "Routing", "PendingRouting", "route", "route_ref", "fold_router", "fold_router_bias",
           "gemv_route", "moe_experts", "moe_experts_ref"]

SCORE_ID = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}

# Expert launches are small (qwen3-30b-a3b fp8: 25 MB of gate/up and 12.6 MB of down rows per token and layer), so
# their time is mostly per-program latency, not bytes. `kernels_micro.py --layer-sweep qwen3-30b-a3b:fp8` on the
# H200 (results/2026-12-03-h200-s8-layer-sweep-qwen3-fp8.json, both launches timed together): fp8 tiles with 2
# warps instead of 4 took the gate/up + down pair from 24.1 to 22.1 us; the down launch with one slot per program
# (expert_down_split) from 24.1 to 20.3-20.8 us.
# fp8 and fp8-block experts: 8 x 512 tiles at 2 warps (fp8: session 8). fp8-block took the GLU GEMV's 16 x 512 at 4
# warps until session 19: 55.0% of the probe over 302 MB of active experts against 77.6% in these tiles (H200).
# One warp (session 26's KIE_EXPERT_WARPS=1, removed): no barrier in the selecting GLU's top-k, but twice the loads
# and FMAs per thread; H100, session 27: GLU 13.29 -> 14.63 us, down 6.43 -> 6.75, qwen3-30b-a3b graph fp8 -5.0%.
_FP8_EXPERT_TILE = TileConfig(8, 512, num_warps=2, prefetch=False)
DEFAULT_EXPERT_TILES = {**DEFAULT_GLU_TILES, "fp8": _FP8_EXPERT_TILE, "fp8_block": _FP8_EXPERT_TILE}
EXPERT_DOWN_PROGRAMS_PER_SM = 16
# The down launch adds each program's rows into an fp32 y with relaxed atomics (y set to the residual by the GLU
# launch) instead of partials + a counter + the last program's ordered sum. That tail is a release fence, an atomic
# round trip and a re-read on every row tile's critical path; the atomics make the sum's order the hardware's, so y
# is not bit-reproducible run to run (fp32 rounding of SPLIT terms). H100: down 8.57 -> 6.44 us (session 25),
# qwen3-30b-a3b graph fp8 467.8 -> 490.6 tok/s (+4.9%, session 26); the GPU parity stages (graph vs the fp32
# reference, every family, bf16 and the quantized formats in fp32) pass with it. KIE_EXPERT_DOWN_ATOMIC=0 restores
# the ordered sum (bit-reproducible decode). A bf16 y always takes the ordered sum.
EXPERT_DOWN_ATOMIC = os.environ.get("KIE_EXPERT_DOWN_ATOMIC", "1") != "0"
# A softmax router renormalised over its top-k picks on the logits and exponentiates only the k picks (select_score;
# the same picks, bit-equal weights). H100, session 27: the selecting GLU 13.56 -> 13.29 us, qwen3-30b-a3b graph fp8
# +0.15-0.19%. KIE_ROUTER_SOFTMAX_ON_PICKS=0 scores all E first.
SOFTMAX_ON_PICKS = os.environ.get("KIE_ROUTER_SOFTMAX_ON_PICKS", "1") != "0"
# The router tail's / the selecting GLU launch's top-k takes 4 picks per block-wide reduction (tl.reduce over sorted
# lists, _top4) instead of one: qwen3-30b-a3b's 8 rounds, each a chain of shuffles and a barrier on every GLU
# program's critical path, become 2. Same picks, same weights (bit-equal). H100, session 25: the GLU picking the
# top-k 13.60 -> 13.26 us (13.77 -> 13.42 after the folded o_proj), qwen3-30b-a3b graph fp8 464.6 -> 468.4 tok/s
# with the same 128 greedy tokens. KIE_TOPK_PER_ROUND=1: one pick per round (as before), 2: two.
TOPK_PER_ROUND = int(os.environ.get("KIE_TOPK_PER_ROUND", "4"))
if TOPK_PER_ROUND not in (1, 2, 4):
    raise ValueError(f"KIE_TOPK_PER_ROUND={TOPK_PER_ROUND}: must be 1, 2 or 4")
# Active fp4 expert bytes per token (top_k experts' gate + up + down) from which moe_experts runs on the tensor cores
# (use_mma_experts), per format; a format not named: never. Measured on an H100 (session 18, benchmarks/NOTES.md),
# tensor-core vs CUDA-core % of the read probe: nvfp4 56 MB 47 vs 37, 198 MB 74 vs 37, 283 MB 74 vs 44; mxfp4 53 MB
# 41 vs 49 (the CUDA-core tiles win), 187 MB 69 vs 62, 294 MB 69 vs 67. nvfp4's crossover lies below 56 MB (smaller
# launches not measured: qwen3-30b-a3b's 21 MB stays on the tiles), mxfp4's somewhere in 53-187 MB.
# KIE_MMA_EXPERTS=0: never (the CUDA-core tiles everywhere; an A/B switch, graph-ab:KIE_MMA_EXPERTS).
MMA_EXPERT_MIN_BYTES: dict[str, int] = ({} if os.environ.get("KIE_MMA_EXPERTS", "1") == "0"
                                        else {"nvfp4": 50 << 20, "mxfp4": 128 << 20})
# Register cap of the CUDA-core expert GLU launch, per format. mxfp4 (gpt-oss: I = H = 2880, 16-row tiles of 4
# warps, top-4: 720 programs) needs 74 registers as a plain launch, 84 when it picks the top-k itself (SELECT, sm_90
# offline); at 84 (allocated 88) 5 programs fit an SM, 660 on 132 SMs, so a second wave of 60 programs made the launch
# 20.8 -> 30.5 us (H200, session 23). At 80 six fit (792), no spills (NOTES.md session 23).
# KIE_EXPERT_GLU_CAP=0: no cap.
EXPERT_GLU_MAXNREG: dict[str, int] = {} if os.environ.get("KIE_EXPERT_GLU_CAP", "1") == "0" else {"mxfp4": 80}


@dataclass(frozen=True)
class RouterConfig:
    """How a model family picks its experts (from config.json).

    scoring: "softmax" (Qwen3-MoE, Mixtral, DeepSeek-V2), "sigmoid" (DeepSeek-V3, GLM-4.5), "softmax_topk" (gpt-oss:
    top-k on the logits, then softmax over those k). Group-limited top-k keeps the topk_group best of n_group
    groups, scored by their best expert ("max", V2) or the sum of their 2 best ("top2", V3)."""

    top_k: int
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2"

    def __post_init__(self):
        if self.scoring not in SCORE_ID:
            raise ValueError(f"RouterConfig.scoring {self.scoring!r}, expected one of {sorted(SCORE_ID)}")
        if self.group_score not in ("top2", "max"):
            raise ValueError(f"RouterConfig.group_score {self.group_score!r}, expected 'top2' or 'max'")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"RouterConfig: topk_group {self.topk_group} not in [1, n_group={self.n_group}]")


class Routing(NamedTuple):
    ids: torch.Tensor  # int32 [top_k], best first
    weights: torch.Tensor  # fp32 [top_k]
    logits: torch.Tensor  # fp32 [E] (router bias included)


class PendingRouting(NamedTuple):
    """route(defer=True): the router launch left partial logits; the experts' GLU launch (moe_experts(select=))
    scores them, picks the top-k and fills ids / weights / logits (its program (0, 0) writes them)."""
    ids: torch.Tensor  # int32 [top_k], filled by moe_experts(select=)
    weights: torch.Tensor  # fp32 [top_k], the same
    logits: torch.Tensor  # fp32 [E], the same
    part: torch.Tensor  # fp32 [split * (E + 1)]: partial logits [split, E], then each split's sum of x^2
    split: int
    normed: bool  # the router RMS-normed x: part holds the sums of x^2 (the experts reuse that scale)
    cfg: RouterConfig
    router_bias: torch.Tensor | None
    correction_bias: torch.Tensor | None
    eps: float
    # gemv_route: the logits come without the RMSNorm scale (normed is True, part holds no sums of x^2); the GLU
    # launch takes the scale of its own x, which must be this tensor (the GEMV's output: the MoE input)
    rstd_x: torch.Tensor | None = None
    x8: torch.Tensor | None = None   # gemv_route(x8_out=): fp4 experts' input, nw * y without y's scale


def select_score(cfg: RouterConfig, has_corr: bool) -> int:
    """_route_topk's SCORE for cfg. A softmax over all experts renormalised over the top-k, without a correction
    bias or groups (Qwen3-MoE, Mixtral), is the softmax over the k picked logits: exp(l_i - M) / sum_j exp(l_j - M)
    with M the largest logit, which is pick 0's, so the weights are the same bits and the picks the same experts (the
    exp's order is the logits'; ties rank by id on either). SCORE 2 picks on the logits themselves: no block-wide
    max and no exp over all E in front of the top-k (every selecting GLU program's critical path)."""
    if (cfg.scoring == "softmax" and cfg.norm_topk_prob and not has_corr and cfg.n_group == 1
            and SOFTMAX_ON_PICKS):
        return SCORE_ID["softmax_topk"]
    return SCORE_ID[cfg.scoring]


def _select_meta(cfg: RouterConfig, E: int, split: int, has_corr: bool) -> dict:
    """_route_topk's constexprs for a router of E experts whose partial logits come in `split` pieces."""
    group_size = E // cfg.n_group
    return dict(SCORE=select_score(cfg, has_corr), NORM_TOPK=cfg.norm_topk_prob, N_GROUP=cfg.n_group,
                GROUP_SIZE=group_size, TOPK_GROUP=cfg.topk_group, GROUP_TOP2=cfg.group_score == "top2",
                TOP_K=cfg.top_k, SPLIT_K=split,
                BLOCK_G=triton.next_power_of_2(cfg.n_group), BLOCK_S=triton.next_power_of_2(group_size),
                BLOCK_TOPK=triton.next_power_of_2(cfg.top_k),
                PER_ROUND=min(TOPK_PER_ROUND, triton.next_power_of_2(cfg.top_k)))


# ======================================================================================================================
# Router
# ======================================================================================================================
@triton.jit
def _order_bits(b):
    """fp32 bits (int32) <-> a signed int with the floats' order (negatives: magnitude bits flipped); its own
    inverse."""
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _topk_key(v, e_idx, BIG: tl.constexpr):
    """int64 keys whose max is the largest v, the lowest id among equal v: v's order-mapped bits (_order_bits) in
    the high word, BIG - id in the low word."""
    return (_order_bits(v.to(tl.int32, bitcast=True)).to(tl.int64) << 32) | (BIG - e_idx).to(tl.int64)


@triton.jit
def _top2(a0, a1, b0, b1):
    """The 2 largest of two descending pairs, descending (tl.reduce's combine; keys are unique)."""
    return tl.maximum(a0, b0), tl.maximum(tl.minimum(a0, b0), tl.maximum(a1, b1))


@triton.jit
def _top4(a0, a1, a2, a3, b0, b1, b2, b3):
    """The 4 largest of two descending 4-lists, descending: max(a_i, b_3-i) holds them as a bitonic sequence,
    which two compare-exchange stages sort (tl.reduce's combine)."""
    c0 = tl.maximum(a0, b3)
    c1 = tl.maximum(a1, b2)
    c2 = tl.maximum(a2, b1)
    c3 = tl.maximum(a3, b0)
    d0 = tl.maximum(c0, c2)
    d2 = tl.minimum(c0, c2)
    d1 = tl.maximum(c1, c3)
    d3 = tl.minimum(c1, c3)
    return tl.maximum(d0, d1), tl.minimum(d0, d1), tl.maximum(d2, d3), tl.minimum(d2, d3)


@triton.jit
def _route_topk(part_ptr, rstd, b_ptr, corr_ptr, scaling, E,
                HAS_BIAS: tl.constexpr, HAS_CORR: tl.constexpr, SCORE: tl.constexpr, NORM_TOPK: tl.constexpr,
                N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
                GROUP_TOP2: tl.constexpr, TOP_K: tl.constexpr, SPLIT_K: tl.constexpr,
                BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_TOPK: tl.constexpr, PER_ROUND: tl.constexpr = 1):
    """(ids int32 [BLOCK_TOPK], weights fp32 [BLOCK_TOPK] (times scaling), logits fp32 [BLOCK_G, BLOCK_S]) from the
    router's partial logits part[SPLIT_K, E] times the RMSNorm scale rstd (1.0 without a norm): scores +
    (group-limited) top-k over all E experts, held as [BLOCK_G groups, BLOCK_S experts per group]. Top-k is
    cdiv(TOP_K, PER_ROUND) rounds of one reduction over (score, id) keys (_topk_key), each giving PER_ROUND picks
    (an int64 max for 1): no sort, ties go to the lower id. Each block-wide reduction (warp shuffles, then a
    shared-memory round behind a barrier) is on the critical path of whoever runs this: one per round, not three
    (max, argmin, sum)."""
    NEG: tl.constexpr = float("-inf")
    BIG: tl.constexpr = 0x7FFFFFFF
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    e_idx = offs_g[:, None] * GROUP_SIZE + offs_s[None, :]  # [BLOCK_G, BLOCK_S] expert id
    valid = (offs_g[:, None] < N_GROUP) & (offs_s[None, :] < GROUP_SIZE)
    logit = tl.zeros((BLOCK_G, BLOCK_S), dtype=tl.float32)
    for s in range(SPLIT_K):
        logit += tl.load(part_ptr + s * E + e_idx, mask=valid, other=0.0, cache_modifier=".cg")
    logit = logit * rstd
    if HAS_BIAS:
        logit += tl.load(b_ptr + e_idx, mask=valid, other=0.0).to(tl.float32)

    if SCORE == 0:  # softmax over all experts
        lm = tl.where(valid, logit, NEG)
        score = tl.exp(lm - tl.max(tl.max(lm, axis=1), axis=0))
        if HAS_CORR or not NORM_TOPK:  # renormalised weights need no global sum: p_i / sum_topk p_j
            score = score / tl.sum(tl.sum(score, axis=1), axis=0)
    elif SCORE == 1:
        score = tl.sigmoid(logit)
    else:
        score = logit
    choice = score
    if HAS_CORR:  # e_score_correction_bias steers the choice only; weights come from `score`
        choice += tl.load(corr_ptr + e_idx, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, NEG)

    if N_GROUP > 1:
        best = tl.max(choice, axis=1)  # [BLOCK_G]
        if GROUP_TOP2:
            first = tl.min(tl.where(choice == best[:, None], offs_s[None, :], BLOCK_S), axis=1)
            gscore = best + tl.max(tl.where(offs_s[None, :] == first[:, None], NEG, choice), axis=1)
        else:
            gscore = best
        gscore = tl.where(offs_g < N_GROUP, gscore, NEG)
        keep = offs_g < 0
        for _ in tl.static_range(TOPK_GROUP):
            gm = tl.max(gscore, axis=0)
            gi = tl.min(tl.where(gscore == gm, offs_g, BLOCK_G), axis=0)
            keep = keep | (offs_g == gi)
            gscore = tl.where(offs_g == gi, NEG, gscore)
        choice = tl.where(keep[:, None], choice, NEG)  # -inf, not 0: a biased choice can be negative

    key = _topk_key(choice, e_idx, BIG)
    offs_t = tl.arange(0, BLOCK_TOPK)
    ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)
    wts = tl.zeros((BLOCK_TOPK,), dtype=tl.float32)
    # the top-k's normaliser summed one scalar per pick, in rank order: a tl.sum's order follows the launch's
    # warps, and the router and the expert GLU launch (route(defer=True)) must give bit-equal weights
    top = 0.0
    tot = 0.0
    KMIN: tl.constexpr = -9223372036854775808  # int64 min: below every key
    # PER_ROUND (1, 2 or 4; a correction bias still costs a score lookup per pick): the keys of that many picks from
    # one block-wide reduction of sorted PER_ROUND-lists (_top2 / _top4), then every key at or above the round's
    # last pick retired (keys are unique), so TOP_K picks take cdiv(TOP_K, PER_ROUND) reductions.
    for j0 in tl.static_range(0, TOP_K, PER_ROUND):
        if PER_ROUND == 4:
            lo = tl.full((BLOCK_G, BLOCK_S), KMIN, tl.int64)
            r0, r1, r2, r3 = tl.reduce((key, lo, lo, lo), 1, _top4)
            m0, m1, m2, m3 = tl.reduce((r0, r1, r2, r3), 0, _top4)
        elif PER_ROUND == 2:
            lo = tl.full((BLOCK_G, BLOCK_S), KMIN, tl.int64)
            r0, r1 = tl.reduce((key, lo), 1, _top2)
            m0, m1 = tl.reduce((r0, r1), 0, _top2)
            m2 = m1
            m3 = m1
        else:
            m0 = tl.max(tl.max(key, axis=1), axis=0)
            m1 = m0
            m2 = m0
            m3 = m0
        for t in tl.static_range(PER_ROUND):
            if j0 + t < TOP_K:
                m = m0
                if t == 1:
                    m = m1
                elif t == 2:
                    m = m2
                elif t == 3:
                    m = m3
                i = BIG - m.to(tl.int32)  # the low word (non-negative)
                if HAS_CORR:  # the key holds score + correction: take the score itself
                    wv = tl.sum(tl.sum(tl.where(e_idx == i, score, 0.0), axis=1), axis=0)
                else:  # the key's high word is the score's bits, order-mapped: map back
                    wv = _order_bits((m >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
                if j0 + t == 0:
                    top = wv
                if SCORE == 2 and not HAS_CORR:  # pick 0 holds the largest logit: softmax's shift
                    tot += tl.exp(wv - top)
                else:
                    tot += wv
                ids = tl.where(offs_t == j0 + t, i, ids)
                wts = tl.where(offs_t == j0 + t, wv, wts)
                if PER_ROUND == 1:
                    key = tl.where(e_idx == i, tl.full((BLOCK_G, BLOCK_S), KMIN, tl.int64), key)
                elif t == PER_ROUND - 1:
                    key = tl.where(key >= m, tl.full((BLOCK_G, BLOCK_S), KMIN, tl.int64), key)
    t_mask = offs_t < TOP_K
    if SCORE == 2 and HAS_CORR:  # the choice's order is not the logits': shift by their max
        p = tl.where(t_mask, tl.exp(wts - tl.max(tl.where(t_mask, wts, NEG), axis=0)), 0.0)
        wts = p / tl.sum(p, axis=0)
    elif SCORE == 2:
        wts = tl.where(t_mask, tl.exp(wts - top), 0.0) / tot
    elif NORM_TOPK:
        wts = wts / (tot + 1e-20)
    return ids, wts * scaling, logit


@triton.jit
def _route_store(ids, wts, logit, logits_ptr, ids_ptr, wts_ptr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
                 TOP_K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """Routing's three outputs from _route_topk's values."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    valid = (offs_g[:, None] < N_GROUP) & (offs_s[None, :] < GROUP_SIZE)
    tl.store(logits_ptr + offs_g[:, None] * GROUP_SIZE + offs_s[None, :], logit, mask=valid)
    offs_t = tl.arange(0, BLOCK_TOPK)
    tl.store(ids_ptr + offs_t, ids, mask=offs_t < TOP_K)
    tl.store(wts_ptr + offs_t, wts, mask=offs_t < TOP_K)


@triton.jit
def _route_rstd(part_ptr, E, K, eps, SPLIT_K: tl.constexpr):
    """The RMSNorm scale of the router's input from its splits' sums of x^2 (part[SPLIT_K * E + split])."""
    ss = 0.0
    for s in tl.static_range(SPLIT_K):  # in split order, not a tl.sum's warp order (see _route_topk's normaliser)
        ss += tl.load(part_ptr + SPLIT_K * E + s, cache_modifier=".cg")
    return 1.0 / tl.sqrt(ss / K + eps)


@triton.jit
def _router_kernel(
    x_ptr, nw_ptr, w_ptr, stride_wn, b_ptr, corr_ptr, part_ptr, cnt_ptr, logits_ptr, ids_ptr, wts_ptr, x8_ptr,
    E, K, k_per_split, eps, scaling,
    WRITE_X8: tl.constexpr, HAS_NW: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CORR: tl.constexpr, SCORE: tl.constexpr,
    NORM_TOPK: tl.constexpr, N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    GROUP_TOP2: tl.constexpr, TOP_K: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_X: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_TOPK: tl.constexpr,
    PIPE: tl.constexpr, PDL: tl.constexpr = False, X8_LAYOUT: tl.constexpr = True, SELECT: tl.constexpr = True,
    PER_ROUND: tl.constexpr = 1, XH_LAYOUT: tl.constexpr = False,
):
    """grid (cdiv(E, BLOCK_N), SPLIT_K): partial logits part[SPLIT_K, E] and (row tile 0) each split's sum of x^2
    part[SPLIT_K * E + split]; the last program to finish selects (SELECT; else the experts' GLU launch does,
    route(defer=True)).
    WRITE_X8: the programs also write the (normed) input, a chunk each, into x8_ptr: in the x8 layout for fp4 experts
    (X8_LAYOUT), as fp16 in the xh layout for the tensor-core fp4 experts (XH_LAYOUT: fp4_mma.prepare_xh's), else as
    a plain fp32 [K] vector for float experts (route's xn_out)."""
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if WRITE_X8:
        n_prog = tl.num_programs(0) * tl.num_programs(1)
        r8 = 1.0
        if HAS_NW:
            r8 = _rstd(x_ptr, K, eps, BLOCK_X)
        for c0 in range((pid_n * tl.num_programs(1) + pid_k) * BLOCK_X, K, n_prog * BLOCK_X):
            offs = c0 + tl.arange(0, BLOCK_X)
            m = offs < K
            xv = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32) * r8
            if HAS_NW:
                xv = xv * tl.load(nw_ptr + offs, mask=m, other=0.0).to(tl.float32)
            if XH_LAYOUT:
                tl.store(x8_ptr + xh_pos(offs), xv.to(tl.float16), mask=m)
            else:
                tl.store(x8_ptr + (_x8_offs(offs, K // 8) if X8_LAYOUT else offs), xv, mask=m)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = _tile_bf16(w_ptr, stride_wn, x_ptr, nw_ptr, pid_n * BLOCK_N, E, k_lo, k_hi, HAS_NW, BLOCK_N, BLOCK_K, PIPE)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(part_ptr + pid_k * E + offs_n, acc, mask=offs_n < E)
    if HAS_NW:
        if pid_n == 0:  # this split's sum of x^2, for the RMSNorm scale (not a re-read of x in the tail)
            ss = tl.zeros((BLOCK_X,), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_X):
                offs = k0 + tl.arange(0, BLOCK_X)
                xv = tl.load(x_ptr + offs, mask=offs < k_hi, other=0.0).to(tl.float32)
                ss += xv * xv
            tl.store(part_ptr + SPLIT_K * E + pid_k, tl.sum(ss, axis=0))
    if SELECT:
        tl.debug_barrier()  # all partial stores precede the release below
        ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
            tl.atomic_xchg(cnt_ptr, 0)  # leave the counter at zero for the next launch
            rstd = 1.0
            if HAS_NW:
                rstd = _route_rstd(part_ptr, E, K, eps, SPLIT_K)
            ids, wts, logit = _route_topk(part_ptr, rstd, b_ptr, corr_ptr, scaling, E,
                                          HAS_BIAS, HAS_CORR, SCORE, NORM_TOPK, N_GROUP, GROUP_SIZE, TOPK_GROUP,
                                          GROUP_TOP2, TOP_K, SPLIT_K, BLOCK_G, BLOCK_S, BLOCK_TOPK, PER_ROUND)
            _route_store(ids, wts, logit, logits_ptr, ids_ptr, wts_ptr, N_GROUP, GROUP_SIZE, TOP_K, BLOCK_G,
                         BLOCK_S, BLOCK_TOPK)


def route(x: torch.Tensor, router_weight: torch.Tensor, cfg: RouterConfig, *, router_bias: torch.Tensor | None = None,
          correction_bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
          out: Routing | None = None, x8_out: torch.Tensor | None = None, xn_out: torch.Tensor | None = None,
          xh_out: torch.Tensor | None = None, config: TileConfig | None = None,
          defer: bool = False) -> Routing | PendingRouting:
    """Top-k experts of a batch-1 token, computed and left on the device: Routing(ids int32 [k], weights fp32 [k],
    logits fp32 [E]). router_weight: float [E, H] (kept bf16 by the converter). norm_weight: RMSNorm x in front.
    defer: the launch only writes partial logits and returns a PendingRouting; moe_experts(select=) picks the top-k
    at the start of its GLU launch (no last-program ticket and selection tail on this launch's critical path).
    x8_out: fp32 [8, H/8] filled with the (normed) x in the x8 layout, for fp4 experts (saves prepare_x8); xn_out:
    fp32 [H] filled with the (normed) x as it is, for float experts (moe_experts(xn, norm_weight=None): no RMSNorm
    in every expert program); xh_out: fp16 [H] filled as fp4_mma.prepare_xh would (normed, xh layout), for the
    tensor-core fp4 experts (moe_experts(xh=): saves prepare_xh's launch). At most one of the three."""
    if router_weight.dim() != 2 or not router_weight.is_floating_point() or router_weight.stride(-1) != 1:
        raise ValueError(f"route: router_weight must be a float [E, H] with contiguous rows, got "
                         f"{router_weight.dtype} {tuple(router_weight.shape)}")
    E, K = router_weight.shape
    dev = router_weight.device
    check_x(x, K, dev)
    check_vec(router_bias, E, dev, "router_bias")
    check_vec(correction_bias, E, dev, "correction_bias")
    check_vec(norm_weight, K, dev, "norm_weight")
    out = _routing_out(cfg, E, dev, out, "route")
    if sum(t is not None for t in (x8_out, xn_out, xh_out)) > 1:
        raise ValueError("route: pass at most one of x8_out, xn_out, xh_out")
    _check_x8_out(x8_out, K, dev, "route")
    check_xh(xh_out, K, dev, "route: xh_out")
    if xn_out is not None and (xn_out.shape != (K,) or xn_out.dtype != torch.float32 or not xn_out.is_contiguous()
                               or xn_out.device != dev):
        raise ValueError(f"route: xn_out must be a contiguous fp32 [{K}] on {dev}, got {xn_out.dtype} "
                         f"{tuple(xn_out.shape)}")
    x_out = next((t for t in (x8_out, xn_out, xh_out) if t is not None), None)
    cfg_t = config or TileConfig(8, 512)
    n_tiles = triton.cdiv(E, cfg_t.block_n)
    split, k_per_split = plan_split(n_tiles, K, cfg_t.block_k, cfg_t.split_k, dev)
    part = torch.empty(split * (E + 1), dtype=torch.float32, device=dev)  # partial logits [split, E], sum x^2 [split]
    _router_kernel[(n_tiles, split)](
        x, norm_weight if norm_weight is not None else x, router_weight, router_weight.stride(0),
        router_bias if router_bias is not None else part, correction_bias if correction_bias is not None else part,
        part, counters(dev, 1), out.logits, out.ids, out.weights, x_out if x_out is not None else part,
        E, K, k_per_split, eps, float(cfg.routed_scaling_factor),
        WRITE_X8=x_out is not None, X8_LAYOUT=x8_out is not None, XH_LAYOUT=xh_out is not None,
        HAS_NW=norm_weight is not None,
        HAS_BIAS=router_bias is not None, HAS_CORR=correction_bias is not None, SELECT=not defer,
        **_select_meta(cfg, E, split, correction_bias is not None),
        BLOCK_N=cfg_t.block_n, BLOCK_K=cfg_t.block_k, BLOCK_X=rstd_block(K),
        PIPE=cfg_t.prefetch, num_warps=cfg_t.num_warps, num_stages=cfg_t.num_stages, **launch_kw(dev)
    )
    if defer:
        return PendingRouting(out.ids, out.weights, out.logits, part, split, norm_weight is not None, cfg, router_bias,
                              correction_bias, eps)
    return out


def _check_x8_out(x8_out: torch.Tensor | None, K: int, dev: torch.device, who: str):
    """An x8_out buffer for a K-long vector: a contiguous fp32 [8, K / 8] on dev (K % 8 == 0)."""
    if x8_out is not None and (x8_out.shape != (8, K // 8) or x8_out.dtype != torch.float32 or K % 8
                               or not x8_out.is_contiguous() or x8_out.device != dev):
        raise ValueError(f"{who}: x8_out must be a contiguous fp32 [8, {K // 8}] on {dev}, got {x8_out.dtype} "
                         f"{tuple(x8_out.shape)}")


def _routing_out(cfg: RouterConfig, E: int, dev: torch.device, out: Routing | None, who: str) -> Routing:
    """cfg checked against E experts; out, or new ids / weights / logits buffers."""
    if cfg.top_k > E or E % cfg.n_group:
        raise ValueError(f"{who}: top_k {cfg.top_k} / n_group {cfg.n_group} do not fit {E} experts")
    group_size = E // cfg.n_group
    if cfg.n_group > 1 and cfg.group_score == "top2" and group_size < 2:
        raise ValueError(f"{who}: group_score 'top2' needs >= 2 experts per group, got {group_size}")
    if cfg.n_group > 1 and cfg.topk_group * group_size < cfg.top_k:
        raise ValueError(f"{who}: topk_group {cfg.topk_group} x {group_size} experts < top_k {cfg.top_k}")
    if out is None:
        return Routing(torch.empty(cfg.top_k, dtype=torch.int32, device=dev),
                       torch.empty(cfg.top_k, dtype=torch.float32, device=dev),
                       torch.empty(E, dtype=torch.float32, device=dev))
    for name, t, n, dt in (("ids", out.ids, cfg.top_k, torch.int32), ("weights", out.weights, cfg.top_k, torch.float32),
                           ("logits", out.logits, E, torch.float32)):
        if t.dtype != dt or t.numel() != n or not t.is_contiguous() or t.device != dev:
            raise ValueError(f"{who}: out.{name} must be a contiguous {dt} [{n}] on {dev}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    return out


# ---- the router folded into the GEMV in front of it (o_proj) ----------------------------------------------------
@triton.jit
def _gemv_route_kernel(
    a_ptr, w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr, bias_ptr, res_ptr, y_ptr,
    wf_ptr, stride_wfn, wr_ptr, stride_wrn, nw_ptr, fb_ptr, part_ptr, u8_ptr,
    N, K, E, r_tiles, r_programs, a_splits, k_per_split,
    FMT: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_U8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PIPE: tl.constexpr, R_BLOCK_N: tl.constexpr, R_BLOCK_K: tl.constexpr, R_PIPE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """grid (r_programs + cdiv(N, BLOCK_N),): the first r_programs write the router's partial logits of y without
    its RMSNorm scale, part[s, E]: splits s < a_splits over K ranges of W_f a (W_f [E, K] = W_r diag(nw) W,
    fold_router), the rest over N ranges of W_r (nw * res) (HAS_BIAS: the first of those adds W_r (nw * bias),
    fold_router_bias); the others are the GEMV's row tiles, y[N] = W[N, K] a[K] (+ bias) + res, as gemv's split-free
    launch (a float-format W). WRITE_U8: they also write nw * y, without y's RMSNorm scale, in the x8 layout (u8_ptr:
    fp32 [8, N / 8]), the input of fp4 experts that scale their sums by it."""
    pdl_begin(PDL)
    pid = tl.program_id(0)
    if pid < r_programs:
        n0 = (pid % r_tiles) * R_BLOCK_N
        s = pid // r_tiles
        if s < a_splits:
            k_lo = s * k_per_split
            lg = _tile_bf16(wf_ptr, stride_wfn, a_ptr, a_ptr, n0, E, k_lo, tl.minimum(k_lo + k_per_split, K), False,
                            R_BLOCK_N, R_BLOCK_K, R_PIPE)
        else:
            k_lo = (s - a_splits) * k_per_split
            lg = _tile_bf16(wr_ptr, stride_wrn, res_ptr, nw_ptr, n0, E, k_lo, tl.minimum(k_lo + k_per_split, N),
                            True, R_BLOCK_N, R_BLOCK_K, R_PIPE)
            if HAS_BIAS:
                if s == a_splits:
                    offs_b = n0 + tl.arange(0, R_BLOCK_N)
                    lg += tl.load(fb_ptr + offs_b, mask=offs_b < E, other=0.0)
        offs_e = n0 + tl.arange(0, R_BLOCK_N)
        tl.store(part_ptr + s * E + offs_e, lg, mask=offs_e < E)
    else:
        n_start = (pid - r_programs) * BLOCK_N
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = _tile(FMT, w_ptr, stride_wn, s_ptr, stride_sn, stride_sk, gs_ptr, a_ptr, a_ptr, 0, n_start, N, 0, K,
                    False, BLOCK_N, BLOCK_K, PIPE)
        _store_out(acc, offs_n, n_mask, y_ptr, bias_ptr, res_ptr, HAS_BIAS, True)
        if WRITE_U8:   # y as stored (its dtype's rounding), times the norm weight
            yv = tl.load(y_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            nwv = tl.load(nw_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            tl.store(u8_ptr + _x8_offs(offs_n, N // 8), yv * nwv, mask=n_mask)


def fold_router(router_weight: torch.Tensor, norm_weight: torch.Tensor, w: WeightHandle,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """W_f [E, K] = W_r diag(nw) W for gemv_route: the router's logits of y = W a + x (before y's RMSNorm scale) are
    W_f a + W_r (nw * x). W is taken as the GEMV reads it (dequantized), the product in fp32, kept in dtype (default:
    the router's; bf16 rounds each folded weight once, ~2^-9 relative: the size of rounding y to bf16)."""
    E, N = router_weight.shape
    if w.num_experts or w.out_features != N or is_fp4(w.fmt):
        raise ValueError(f"fold_router: w must be a float-format [{N}, K] matrix (the router reads its {N} outputs), "
                         f"got {w.fmt} [{w.out_features}, {w.in_features}]" + (" experts" if w.num_experts else ""))
    check_vec(norm_weight, N, router_weight.device, "norm_weight")
    wf = (router_weight.float() * norm_weight.float()) @ dequantize(w).float()
    return wf.to(dtype or router_weight.dtype).contiguous()


def fold_router_bias(router_weight: torch.Tensor, norm_weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The logit term of a GEMV bias b for gemv_route(bias=b): W_r (nw * b), fp32 [E] (before y's RMSNorm scale)."""
    E, N = router_weight.shape
    check_vec(norm_weight, N, router_weight.device, "norm_weight")
    check_vec(bias, N, router_weight.device, "bias")
    return ((router_weight.float() * norm_weight.float()) @ bias.float().reshape(-1)).contiguous()


def gemv_route(a: torch.Tensor, w: WeightHandle, residual: torch.Tensor, w_fold: torch.Tensor,
               router_weight: torch.Tensor, norm_weight: torch.Tensor, cfg: RouterConfig, *,
               bias: torch.Tensor | None = None, fold_bias: torch.Tensor | None = None,
               router_bias: torch.Tensor | None = None, correction_bias: torch.Tensor | None = None,
               eps: float = 1e-6, out: torch.Tensor | None = None, x8_out: torch.Tensor | None = None,
               routing: Routing | None = None, config: TileConfig | None = None,
               router_config: TileConfig = TileConfig(8, 512), router_k_steps: int = 2
               ) -> tuple[torch.Tensor, PendingRouting]:
    """y = W a + residual, and in the same launch the router's partial logits of RMSNorm(y): the router
    launch between this GEMV and the experts folded away (o_proj in front of a MoE layer). Returns (y, a
    PendingRouting for moe_experts(y, select=)), whose GLU launch scales the logits by y's RMSNorm scale (computed
    there, as the experts' own norm) and picks the top-k. w_fold = fold_router(router_weight, norm_weight, w).
    W: bf16 / fp16 / fp32 / fp8 / fp8_block (an fp4 W reads a in the x8 layout: not here). bias: y's (gpt-oss's
    o_proj), with fold_bias = fold_router_bias(router_weight, norm_weight, bias), its logit term. The GEMV's row
    tiles are gemv's (gemv_tiles) without split-K; the router rows run router_config's tiles over K ranges of
    router_k_steps K steps each (W_f over a, then W_r over the residual). x8_out: fp32 [8, N / 8] filled with
    norm_weight * y in the x8 layout, without y's RMSNorm scale: fp4 experts' input (moe_experts(y, x8=x8_out,
    select=) scales their gate / up sums by y's scale)."""
    if w.num_experts or is_fp4(w.fmt):
        raise ValueError(f"gemv_route: w must be one float-format matrix (bf16 / fp16 / fp32 / fp8 / fp8_block), got "
                         f"{w.fmt}" + (" experts" if w.num_experts else ""))
    N, K = w.out_features, w.in_features
    dev = w.device
    check_x(a, K, dev, "a")
    check_vec(residual, N, dev, "residual")
    if (router_weight.dim() != 2 or router_weight.shape[1] != N or not router_weight.is_floating_point()
            or router_weight.stride(-1) != 1 or router_weight.device != dev):
        raise ValueError(f"gemv_route: router_weight must be a float [E, {N}] with contiguous rows on {dev}, got "
                         f"{router_weight.dtype} {tuple(router_weight.shape)} on {router_weight.device}")
    E = router_weight.shape[0]
    if (tuple(w_fold.shape) != (E, K) or not w_fold.is_floating_point() or w_fold.stride(-1) != 1
            or w_fold.device != dev):
        raise ValueError(f"gemv_route: w_fold must be fold_router's float [{E}, {K}] on {dev}, got {w_fold.dtype} "
                         f"{tuple(w_fold.shape)} on {w_fold.device}")
    check_vec(norm_weight, N, dev, "norm_weight")
    if (bias is None) != (fold_bias is None):
        raise ValueError("gemv_route: pass bias with fold_bias (fold_router_bias: its logit term) or neither")
    check_vec(bias, N, dev, "bias")
    check_vec(fold_bias, E, dev, "fold_bias")
    if fold_bias is not None and fold_bias.dtype != torch.float32:
        raise ValueError(f"gemv_route: fold_bias must be fold_router_bias's fp32 [{E}], got {fold_bias.dtype}")
    check_vec(router_bias, E, dev, "router_bias")
    check_vec(correction_bias, E, dev, "correction_bias")
    if not isinstance(router_k_steps, int) or router_k_steps < 1:
        raise ValueError(f"gemv_route: router_k_steps {router_k_steps!r}: expected an int >= 1")
    _check_x8_out(x8_out, N, dev, "gemv_route")
    routing = _routing_out(cfg, E, dev, routing, "gemv_route")
    y = make_out(a, N, out)
    tiles = gemv_tiles(w, config)
    kps = router_k_steps * router_config.block_k
    a_splits, x_splits = triton.cdiv(K, kps), triton.cdiv(N, kps)
    r_tiles = triton.cdiv(E, router_config.block_n)
    split = a_splits + x_splits
    part = torch.empty(split * E, dtype=torch.float32, device=dev)  # partial logits [split, E]
    _gemv_route_kernel[(r_tiles * split + triton.cdiv(N, tiles.block_n),)](
        a, *weight_args(w), bias if bias is not None else y, residual, y,
        w_fold, w_fold.stride(0), router_weight, router_weight.stride(0), norm_weight,
        fold_bias if fold_bias is not None else part, part, x8_out if x8_out is not None else part,
        N, K, E, r_tiles, r_tiles * split, a_splits, kps,
        FMT=FMT_ID[w.fmt], HAS_BIAS=bias is not None, WRITE_U8=x8_out is not None, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, PIPE=tiles.prefetch, R_BLOCK_N=router_config.block_n, R_BLOCK_K=router_config.block_k,
        R_PIPE=router_config.prefetch, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **launch_kw(dev)
    )
    return y, PendingRouting(routing.ids, routing.weights, routing.logits, part, split, True, cfg, router_bias,
                             correction_bias, eps, rstd_x=y, x8=x8_out)


def route_ref(x, router_weight, cfg: RouterConfig, *, router_bias=None, correction_bias=None, norm_weight=None,
              eps=1e-6) -> Routing:
    """Torch reference (DeepSeek-V3 / Qwen3-MoE / gpt-oss routing written out; masked groups get -inf)."""
    xf = x.float().reshape(-1)
    if norm_weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean() + eps) * norm_weight.float()
    logits = router_weight.float() @ xf
    if router_bias is not None:
        logits = logits + router_bias.float()
    E = logits.numel()
    if cfg.scoring == "softmax":
        score = torch.softmax(logits, -1)
    elif cfg.scoring == "sigmoid":
        score = torch.sigmoid(logits)
    else:
        score = logits
    choice = score + correction_bias.float() if correction_bias is not None else score.clone()
    if cfg.n_group > 1:
        grouped = choice.view(cfg.n_group, -1)
        gs = grouped.topk(2, -1).values.sum(-1) if cfg.group_score == "top2" else grouped.max(-1).values
        keep = torch.zeros(cfg.n_group, dtype=torch.bool, device=logits.device)
        keep[gs.topk(cfg.topk_group).indices] = True
        choice = grouped.masked_fill(~keep[:, None], float("-inf")).reshape(E)
    ids = choice.topk(cfg.top_k).indices
    w = score[ids]
    if cfg.scoring == "softmax_topk":
        w = torch.softmax(w, -1)
    elif cfg.norm_topk_prob:
        w = w / (w.sum() + 1e-20)
    return Routing(ids.to(torch.int32), w * cfg.routed_scaling_factor, logits)


# ======================================================================================================================
# Routed experts
# ======================================================================================================================
@triton.jit
def _expert_glu_kernel(
    x_ptr, nw_ptr, ids_ptr,
    wg_ptr, stride_wgn, sg_ptr, stride_sgn, stride_sgk, gsg_ptr, stride_wge, stride_sge, stride_gge,
    wu_ptr, stride_wun, su_ptr, stride_sun, stride_suk, gsu_ptr, stride_wue, stride_sue, stride_gue,
    bg_ptr, stride_bge, stride_bgn, bu_ptr, stride_bue, stride_bun, h_ptr,
    I, K, eps, limit, alpha, stride_x8,
    FMT: tl.constexpr, HAS_NW: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, H_X8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_X: tl.constexpr, PIPE: tl.constexpr, PDL: tl.constexpr = False,
    PAIR: tl.constexpr = False,
    # SELECT (route(defer=True)): this launch scores the router's partial logits and picks the top-k itself
    rpart_ptr=None, rb_ptr=None, rcorr_ptr=None, logits_ptr=None, wts_ptr=None, scaling=1.0, E=1, rx_ptr=None,
    SELECT: tl.constexpr = False, SEL_NW: tl.constexpr = 0, SEL_BIAS: tl.constexpr = False,
    SEL_CORR: tl.constexpr = False, SCORE: tl.constexpr = 0, NORM_TOPK: tl.constexpr = True,
    N_GROUP: tl.constexpr = 1, GROUP_SIZE: tl.constexpr = 1, TOPK_GROUP: tl.constexpr = 1,
    GROUP_TOP2: tl.constexpr = False, TOP_K: tl.constexpr = 1, SPLIT_K: tl.constexpr = 1, BLOCK_G: tl.constexpr = 1,
    BLOCK_S: tl.constexpr = 1, BLOCK_TOPK: tl.constexpr = 1, SCALE_GLU: tl.constexpr = False,
    PER_ROUND: tl.constexpr = 1,
    # INIT_Y (the down launch adds into y with atomics, EXPERT_DOWN_ATOMIC): 1 y = residual, 2 y = 0, by slot 0's
    # programs, INIT_BLOCK values each
    y_ptr=None, res_ptr=None, N_Y=0, INIT_Y: tl.constexpr = 0, INIT_BLOCK: tl.constexpr = 1,
):
    """grid (cdiv(I, BLOCK_N), TOP_K): h[slot, I] = glu(Wg[e] x + bg[e], Wu[e] x + bu[e]), e = ids[slot].
    H_X8: store each h[slot] in the x8 layout (an fp4 down projection reads it that way). PAIR (float formats, gate
    and up of one stride layout): gate and up rows stream in one K loop that loads each x step once (tiles._tile_pair)
    instead of two loops that load it twice.
    SELECT: ids come from the router's partial logits (rpart_ptr, route(defer=True)): every program runs the top-k
    (_route_topk, the router tail's own code) and takes its slot's id; program (0, 0) stores ids / weights / logits
    for the down launch. SEL_NW, the logits' RMSNorm scale: 0 none; 1 the router normed x, so the scale comes from
    its sums of x^2 (and serves the experts' norm too); 2 (gemv_route: the logits come unscaled) the scale of
    rx_ptr's vector (gemv_route's y), in front of the top-k. SCALE_GLU (fp4 experts on gemv_route's x8, nw * y
    without the scale): the gate / up sums times that scale."""
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    slot = tl.program_id(1)
    if SELECT:
        rstd_sel = 1.0
        if SEL_NW == 1:
            rstd_sel = _route_rstd(rpart_ptr, E, K, eps, SPLIT_K)
        elif SEL_NW == 2:
            rstd_sel = _rstd(rx_ptr, K, eps, BLOCK_X)
        sel_ids, sel_wts, sel_logit = _route_topk(rpart_ptr, rstd_sel, rb_ptr, rcorr_ptr, scaling, E, SEL_BIAS,
                                                  SEL_CORR, SCORE, NORM_TOPK, N_GROUP, GROUP_SIZE, TOPK_GROUP,
                                                  GROUP_TOP2, TOP_K, SPLIT_K, BLOCK_G, BLOCK_S, BLOCK_TOPK, PER_ROUND)
        if (pid_n == 0) & (slot == 0):
            _route_store(sel_ids, sel_wts, sel_logit, logits_ptr, ids_ptr, wts_ptr, N_GROUP, GROUP_SIZE, TOP_K,
                         BLOCK_G, BLOCK_S, BLOCK_TOPK)
        e = tl.sum(tl.where(tl.arange(0, BLOCK_TOPK) == slot, sel_ids, 0), axis=0).to(tl.int64)
    else:
        e = tl.load(ids_ptr + slot).to(tl.int64)  # the only data-dependent address: which expert's rows to stream
    n_start = pid_n * BLOCK_N
    if PAIR:
        g, u = _tile_pair(FMT, wg_ptr + e * stride_wge, wu_ptr + e * stride_wue, stride_wgn, sg_ptr + e * stride_sge,
                          su_ptr + e * stride_sue, stride_sgn, stride_sgk, x_ptr, nw_ptr, n_start, I, 0, K, HAS_NW,
                          BLOCK_N, BLOCK_K, PIPE)
    else:
        g = _tile(FMT, wg_ptr + e * stride_wge, stride_wgn, sg_ptr + e * stride_sge, stride_sgn, stride_sgk,
                  gsg_ptr + e * stride_gge, x_ptr, nw_ptr, stride_x8, n_start, I, 0, K, HAS_NW, BLOCK_N, BLOCK_K,
                  PIPE)
        u = _tile(FMT, wu_ptr + e * stride_wue, stride_wun, su_ptr + e * stride_sue, stride_sun, stride_suk,
                  gsu_ptr + e * stride_gue, x_ptr, nw_ptr, stride_x8, n_start, I, 0, K, HAS_NW, BLOCK_N, BLOCK_K,
                  PIPE)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    if HAS_NW or SCALE_GLU:
        if SELECT and SEL_NW != 0:  # the same x and eps: the scale the top-k used (SEL_NW 1: no re-read of x)
            r = rstd_sel
        else:
            r = _rstd(x_ptr, K, eps, BLOCK_X)
        g = g * r
        u = u * r
    if HAS_BIAS:
        g += tl.load(bg_ptr + e * stride_bge + offs_n * stride_bgn, mask=n_mask, other=0.0).to(tl.float32)
        u += tl.load(bu_ptr + e * stride_bue + offs_n * stride_bun, mask=n_mask, other=0.0).to(tl.float32)
    h_offs = _x8_offs(offs_n, I // 8) if H_X8 else offs_n
    tl.store(h_ptr + slot * I + h_offs, _glu(g, u, limit, alpha, ACT), mask=n_mask)
    if INIT_Y != 0:
        if slot == 0:   # the down launch's atomics start from y = residual (or 0); the launch boundary orders them
            offs_y = pid_n * INIT_BLOCK + tl.arange(0, INIT_BLOCK)
            y0 = tl.zeros((INIT_BLOCK,), dtype=tl.float32)
            if INIT_Y == 1:
                y0 = tl.load(res_ptr + offs_y, mask=offs_y < N_Y, other=0.0).to(tl.float32)
            tl.store(y_ptr + offs_y, y0, mask=offs_y < N_Y)


@triton.jit
def _expert_down_kernel(
    h_ptr, ids_ptr, wts_ptr,
    wd_ptr, stride_wdn, sd_ptr, stride_sdn, stride_sdk, gsd_ptr, stride_wde, stride_sde, stride_gde,
    bd_ptr, stride_bde, res_ptr, y_ptr, part_ptr, cnt_ptr,
    N, I, slots_per_split,
    FMT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, TOP_K: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PIPE: tl.constexpr, PDL: tl.constexpr = False,
    ATOMIC: tl.constexpr = False,
):
    """grid (cdiv(N, BLOCK_N), SPLIT): y[N] = sum_slot wts[slot] * (Wd[e] h[slot] + bd[e]) (+ residual); the slots
    are split over SPLIT programs per row tile (reduced in slot order by the last one). ATOMIC: each program adds its
    sum into fp32 y (set to the residual by the GLU launch's INIT_Y) with a relaxed atomic; the order of the SPLIT
    additions is the hardware's (not bit-reproducible run to run)."""
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n_start = pid_n * BLOCK_N
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for slot in range(pid_s * slots_per_split, tl.minimum(pid_s * slots_per_split + slots_per_split, TOP_K)):
        e = tl.load(ids_ptr + slot).to(tl.int64)
        d = _tile(FMT, wd_ptr + e * stride_wde, stride_wdn, sd_ptr + e * stride_sde, stride_sdn, stride_sdk,
                  gsd_ptr + e * stride_gde, h_ptr + slot * I, h_ptr, I // 8, n_start, N, 0, I, False,
                  BLOCK_N, BLOCK_K, PIPE)
        if HAS_BIAS:
            d += tl.load(bd_ptr + e * stride_bde + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc += tl.load(wts_ptr + slot) * d
    if ATOMIC:   # fp32 y holds the residual already (the GLU launch wrote it): no partials, counter or last program
        tl.atomic_add(y_ptr + offs_n, acc, mask=n_mask, sem="relaxed", scope="gpu")
    elif SPLIT == 1:
        _store_out(acc, offs_n, n_mask, y_ptr, y_ptr, res_ptr, False, HAS_RES)
    else:
        acc, is_last = _split_reduce(acc, part_ptr, cnt_ptr, pid_n, pid_s, offs_n, n_mask, N, SPLIT)
        if is_last:
            _store_out(acc, offs_n, n_mask, y_ptr, y_ptr, res_ptr, False, HAS_RES)


def expert_down_split(n_tiles: int, top_k: int, device: torch.device,
                      per_sm: int = EXPERT_DOWN_PROGRAMS_PER_SM) -> int:
    """Programs per row tile of the expert down launch (each sums top_k / split slots; the last one reduces): as
    many as fit per_sm programs per SM, up to one slot per program. qwen3-30b-a3b (256 row tiles, top-8): 8;
    gpt-oss-120b (360, top-4): 4; DeepSeek-V3 (896, top-8): 2."""
    return max(1, min(top_k, per_sm * num_sms(device) // max(n_tiles, 1)))


def split_slots(split: int, top_k: int) -> tuple[int, int]:
    """(slots per program, programs) for a requested split of top_k slots: no program left without a slot."""
    per = triton.cdiv(top_k, max(1, min(split, top_k)))
    return per, triton.cdiv(top_k, per)


def _expert_args(w: WeightHandle) -> tuple:
    """weight_args + the expert-axis strides (w, scale, global scale)."""
    st = lambda t: t.stride(0) if t is not None and t.dim() >= 1 else 0  # noqa: E731
    return (*weight_args(w), w.weight.stride(0), st(w.scale), st(w.global_scale))


def _check_bias2(b, E, n, dev, name):
    if b is None:
        return (None, 0, 0)
    if b.dim() != 2 or tuple(b.shape) != (E, n) or not b.is_floating_point() or b.device != dev:
        raise ValueError(f"moe_experts: {name} must be a float [{E}, {n}] on {dev}, got {b.dtype} {tuple(b.shape)}")
    return (b, b.stride(0), b.stride(1))


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: WeightHandle, w_up: WeightHandle,
                w_down: WeightHandle, *, act: str = "silu", limit: float = 7.0, alpha: float = 1.702,
                gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None, eps: float = 1e-6, out: torch.Tensor | None = None,
                x8: torch.Tensor | None = None, config_up: TileConfig | None = None,
                config_down: TileConfig | None = None, split: int | None = None,
                mma: bool | None = None, glu_pair: bool | None = None, select: PendingRouting | None = None,
                xh: torch.Tensor | None = None, **mma_launch) -> torch.Tensor:
    """Routed experts of one token: y = sum_k weights[k] * down[e_k](glu(gate[e_k] x, up[e_k] x)) (+ residual).

    ids int32 [k] / weights fp32 [k] stay on the device (from route()); repeated ids are fine. w_gate/w_up [E, I, H],
    w_down [E, H, I] stacked handles of one format (gpt-oss interleaved gate_up: rows(0, None, 2), rows(1, None, 2)).
    Biases [E, I] / [E, H] (views with strides are fine); down_bias is weighted like its expert's output.
    fp4 gate/up: x8 = prepare_x8(x, norm_weight, eps) (or route(..., x8_out=)) if already made.
    mma: nvfp4 / mxfp4 stacks on the tensor cores (kernels/fp4_mma_experts.py; x8 unused, x rounded to fp16 after the
    norm, h kept in fp16); None: when use_mma_experts says so (>= MMA_EXPERT_MIN_BYTES[fmt] of active experts);
    mma_launch: that path's launch shapes (fp4_mma_experts.moe_experts_mma's keywords, for benchmarks).
    xh: the tensor-core path's input already made (route(xh_out=) or prepare_xh(x, norm_weight, eps)): no
    prepare_xh launch of its own (x and norm_weight then serve the residual's shape checks only).
    glu_pair: float gate / up rows in one K loop sharing each x load (_expert_glu_kernel PAIR; None: gemv.GLU_PAIR,
    where the two stacks share their stride layout).
    select: route(defer=True)'s PendingRouting for this token (ids / weights must be its buffers): the GLU launch
    picks the top-k from the router's partial logits and fills them (CUDA-core path only)."""
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not w.num_experts:
            raise ValueError(f"moe_experts: {name} is not an expert stack [E, out, in]")
    E, I, H = w_gate.num_experts, w_gate.out_features, w_gate.in_features
    if (w_up.num_experts, w_up.out_features, w_up.in_features) != (E, I, H):
        raise ValueError(f"moe_experts: w_up is [{w_up.num_experts}, {w_up.out_features}, {w_up.in_features}], "
                         f"w_gate [{E}, {I}, {H}]")
    if (w_down.num_experts, w_down.out_features, w_down.in_features) != (E, H, I):
        raise ValueError(f"moe_experts: w_down is [{w_down.num_experts}, {w_down.out_features}, "
                         f"{w_down.in_features}], expected [{E}, {H}, {I}]")
    if FMT_ID[w_gate.fmt] != FMT_ID[w_up.fmt]:
        raise ValueError(f"moe_experts: w_gate is {w_gate.fmt}, w_up is {w_up.fmt}")
    if act not in ACT_ID:
        raise ValueError(f"moe_experts: act {act!r}, expected one of {sorted(ACT_ID)}")
    dev = w_gate.device
    check_x(x, H, dev)
    if ids.dtype != torch.int32 or ids.dim() != 1 or ids.device != dev or not ids.is_contiguous():
        raise ValueError(f"moe_experts: ids must be a contiguous int32 [top_k] on {dev}, got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    top_k = ids.numel()
    if (weights.dtype != torch.float32 or weights.numel() != top_k or weights.device != dev
            or not weights.is_contiguous()):
        raise ValueError(f"moe_experts: weights must be a contiguous fp32 [{top_k}] on {dev}, got {weights.dtype} "
                         f"{tuple(weights.shape)}")
    if (gate_bias is None) != (up_bias is None):
        raise ValueError("moe_experts: pass both gate_bias and up_bias or neither")
    bg, bu, bd = (_check_bias2(gate_bias, E, I, dev, "gate_bias"), _check_bias2(up_bias, E, I, dev, "up_bias"),
                  _check_bias2(down_bias, E, H, dev, "down_bias"))
    if bd[0] is not None and bd[2] != 1:
        raise ValueError("moe_experts: down_bias rows must be contiguous")
    check_vec(residual, H, dev, "residual")
    check_vec(norm_weight, H, dev, "norm_weight")
    y = make_out(x, H, out)
    if mma is None:
        mma = config_up is None and config_down is None and use_mma_experts(w_gate, w_up, w_down, top_k)
    if (mma_launch or xh is not None) and not mma:
        raise ValueError(f"moe_experts: {sorted(mma_launch) + (['xh'] if xh is not None else [])} apply to the "
                         f"tensor-core path only (mma=True)")
    if select is not None:
        _check_select(select, x, x8, ids, weights, E, w_gate.fmt, mma, norm_weight, eps)
    if mma:
        from .fp4_mma_experts import moe_experts_mma  # it imports this module: not at the top
        return moe_experts_mma(x, ids, weights, w_gate, w_up, w_down, act_id=ACT_ID[act], limit=limit, alpha=alpha,
                               gate_bias=bg, up_bias=bu, down_bias=bd, residual=residual, norm_weight=norm_weight,
                               eps=eps, y=y, counters=counters(dev, triton.cdiv(H, 16)), split=split, xh=xh,
                               **mma_launch)
    h = torch.empty((top_k, I), dtype=torch.float32, device=dev)  # fp32: no rounding between the two GEMVs

    cu = resolve_config(w_gate, config_up, DEFAULT_EXPERT_TILES)
    x_in, nw_in, has_nw, stride_x8 = input_args(x, w_gate.fmt, norm_weight, eps, x8)
    ga, ua = _expert_args(w_gate), _expert_args(w_up)
    pair = glu_pair_choice(w_gate.fmt, ga, ua, glu_pair, "moe_experts")
    sel = {}
    if select is not None:
        c, p = select.cfg, select.part
        sel = dict(rpart_ptr=p, rb_ptr=select.router_bias if select.router_bias is not None else p,
                   rcorr_ptr=select.correction_bias if select.correction_bias is not None else p,
                   logits_ptr=select.logits, wts_ptr=weights, scaling=float(c.routed_scaling_factor),
                   E=E, SELECT=True, SEL_NW=2 if select.rstd_x is not None else int(select.normed),
                   rx_ptr=select.rstd_x if select.rstd_x is not None else p, SCALE_GLU=select.x8 is not None,
                   SEL_BIAS=select.router_bias is not None, SEL_CORR=select.correction_bias is not None,
                   # E: _check_select held the router to the stacks' count
                   **_select_meta(c, E, select.split, select.correction_bias is not None))
        if select.normed:
            eps = select.eps  # the router's scale; _check_select refused an experts' norm with another eps
    n_glu_tiles = triton.cdiv(I, cu.block_n)
    cd = resolve_config(w_down, config_down, DEFAULT_EXPERT_TILES)
    n_tiles = triton.cdiv(H, cd.block_n)
    if split is None:
        split = expert_down_split(n_tiles, top_k, dev)
    per, split = split_slots(split, top_k)
    atomic = EXPERT_DOWN_ATOMIC and y.dtype == torch.float32 and split > 1
    init_y = {}   # atomic: slot 0's GLU programs set y to the residual (or 0) before the down launch adds into it
    if atomic:
        init_y = dict(y_ptr=y, res_ptr=residual if residual is not None else y, N_Y=H,
                      INIT_Y=1 if residual is not None else 2,
                      INIT_BLOCK=triton.next_power_of_2(triton.cdiv(H, n_glu_tiles)))
    _expert_glu_kernel[(n_glu_tiles, top_k)](
        x_in, nw_in, ids, *ga, *ua,
        bg[0] if bg[0] is not None else h, bg[1], bg[2], bu[0] if bu[0] is not None else h, bu[1], bu[2], h,
        I, H, eps, limit, alpha, stride_x8,
        FMT=FMT_ID[w_gate.fmt], HAS_NW=has_nw, HAS_BIAS=bg[0] is not None, ACT=ACT_ID[act],
        H_X8=is_fp4(w_down.fmt),
        BLOCK_N=cu.block_n, BLOCK_K=cu.block_k, BLOCK_X=rstd_block(H),
        PIPE=cu.prefetch, PAIR=pair, num_warps=cu.num_warps, num_stages=cu.num_stages,
        **sel, **init_y, **launch_kw(dev),
        **reg_cap(dev, EXPERT_GLU_MAXNREG.get(w_gate.fmt))
    )

    part = torch.empty((split, H), dtype=torch.float32, device=dev) if split > 1 and not atomic else h
    _expert_down_kernel[(n_tiles, split)](
        h, ids, weights, *_expert_args(w_down), bd[0] if bd[0] is not None else h, bd[1],
        residual if residual is not None else y, y, part, counters(dev, n_tiles) if split > 1 and not atomic else h,
        H, I, per,
        FMT=FMT_ID[w_down.fmt], HAS_BIAS=bd[0] is not None, HAS_RES=residual is not None, TOP_K=top_k,
        SPLIT=split, BLOCK_N=cd.block_n, BLOCK_K=cd.block_k, ATOMIC=atomic,
        PIPE=cd.prefetch, num_warps=cd.num_warps, num_stages=cd.num_stages,
        **launch_kw(dev)
    )
    return y


def _check_select(select, x, x8, ids, weights, E: int, fmt: str, mma: bool, norm_weight, eps: float):
    """moe_experts(select=): a PendingRouting of this stack, whose buffers are ids / weights, on the CUDA cores."""
    if not isinstance(select, PendingRouting):
        raise ValueError(f"moe_experts: select must be route(defer=True)'s PendingRouting, got {type(select).__name__}")
    if select.ids is not ids or select.weights is not weights:
        raise ValueError("moe_experts: with select=, ids and weights must be select.ids and select.weights (the GLU "
                         "launch fills them)")
    if select.logits.numel() != E:
        raise ValueError(f"moe_experts: select routes over {select.logits.numel()} experts, the stacks hold {E}")
    if mma:
        raise ValueError("moe_experts: select= needs the CUDA-core expert launches (mma=False)")
    rx = select.rstd_x
    if rx is not None and not (x.data_ptr() == rx.data_ptr() and x.numel() == rx.numel() and x.dtype == rx.dtype):
        raise ValueError("moe_experts: select= is gemv_route's: x must be its output y (the logits take y's RMSNorm "
                         "scale in the GLU launch)")
    if rx is not None and is_fp4(fmt) and (select.x8 is None or x8 is not select.x8):
        raise ValueError(f"moe_experts: {fmt} experts after gemv_route read its x8_out: pass x8=select.x8 (gemv_route "
                         f"with x8_out=)")
    if rx is not None and not is_fp4(fmt) and (select.x8 is not None or norm_weight is None):
        raise ValueError("moe_experts: float experts after gemv_route norm y themselves: pass norm_weight (and no "
                         "x8_out to gemv_route)")
    if select.normed and norm_weight is not None and eps != select.eps:
        raise ValueError(f"moe_experts: norm eps {eps} differs from the router's {select.eps} (select= shares its "
                         f"RMSNorm scale)")


def use_mma_experts(w_gate: WeightHandle, w_up: WeightHandle, w_down: WeightHandle, top_k: int) -> bool:
    """moe_experts' default path: the tensor cores (fp4_mma_experts) for nvfp4 / mxfp4 stacks they can read whose
    top_k active experts hold >= MMA_EXPERT_MIN_BYTES[fmt] (a format not there: never); else the CUDA-core tiles
    (tuned on qwen3's small experts)."""
    least = MMA_EXPERT_MIN_BYTES.get(w_gate.fmt)
    if least is None or not (is_fp4(w_gate.fmt) and w_gate.fmt == w_up.fmt == w_down.fmt):
        return False
    active = top_k * (w_gate.nbytes + w_up.nbytes + w_down.nbytes) // w_gate.num_experts
    if active < least:
        return False
    from .fp4_mma import mma_experts_unreadable
    return not any(mma_experts_unreadable(w) for w in (w_gate, w_up, w_down))


def moe_experts_ref(x, ids, weights, w_gate: WeightHandle, w_up: WeightHandle, w_down: WeightHandle, *,
                    act="silu", limit=7.0, alpha=1.702, gate_bias=None, up_bias=None, down_bias=None, residual=None,
                    norm_weight=None, eps=1e-6, out_dtype=None, fp16_inputs=False) -> torch.Tensor:
    """Torch reference: dequantize each picked expert, fp32 math (reads ids on the host: a reference may sync).
    fp16_inputs: the normed x and each h rounded to fp16 once, as the tensor-core path (mma=True) does."""
    rnd = (lambda t: t.half().float()) if fp16_inputs else (lambda t: t)  # noqa: E731
    xf = x.float().reshape(-1)
    if norm_weight is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean() + eps) * norm_weight.float()
    xf = rnd(xf)
    y = torch.zeros(w_down.out_features, dtype=torch.float32, device=x.device)
    for e, wt in zip(ids.tolist(), weights.float().tolist()):
        g = dequantize(w_gate.expert(e)) @ xf
        u = dequantize(w_up.expert(e)) @ xf
        if gate_bias is not None:
            g, u = g + gate_bias[e].float(), u + up_bias[e].float()
        d = dequantize(w_down.expert(e)) @ rnd(glu_ref(g, u, act, limit, alpha))
        if down_bias is not None:
            d = d + down_bias[e].float()
        y += wt * d
    if residual is not None:
        y += residual.float().reshape(-1)
    return y.reshape(*x.shape[:-1], -1).to(out_dtype or x.dtype)

#!/usr/bin/env python3
"""GPU micro-benchmark of the batch-1 decode kernels (kie_moe.kernels.gemv / .moe / .attention / .rope).

Measures, on one GPU:
  probe   the read-bandwidth ceiling: torch sum over ~4 GB (DESIGN.md §6: ~4.2 TB/s on an H200);
  big     each weight format on one GEMV launch covering >= 256 MB of weights (+ scales);
  models  every launch of one decoder layer at the real shapes of qwen3-30b-a3b, gpt-oss-120b and laneformer-2b
          (--models; llama-3.2-1b too on request), in the formats each would run: bf16, fp8 and nvfp4 everywhere,
          and gpt-oss's released layout "mxfp4-experts" (bf16 attention, mxfp4 experts). Per layer: q/k/v (fused
          rows for float / fp8, three GEMVs for block / fp4 formats, as the graph backend launches them), RoPE +
          KV append, decode attention at each --ctx (sinks, sliding windows), o_proj, then the router + routed
          experts (gate/up and down launches) or the dense gate/up + down, the fp4 x8 input preps, and the bf16
          lm_head once per token; the sum is the decode time of a token spent in these launches. Activations are
          fp32 and the KV cache bf16 there, as in the graph backend (the big GEMVs keep bf16 x).
          laneformer-2b rows are one lane's launches (one device of the 8-way lane-parallel layout: 4 q / 2 kv
          heads, 864 FFN rows of 4096); "all lanes on one device" multiplies its layer by 8.
  experts-topk (--experts-topk 4,5,..) routed experts of 4096 x 4096 at each top-k, every --formats format on
          its default path (fp4: tensor cores), each launch's own time and its GLU program count: where a launch
          outgrows one wave of resident programs.
  sweep   (--sweep) launch shapes of the big GEMV per format, to pick DEFAULT_TILES.
  layer-sweep (--layer-sweep MODEL:FMT, e.g. qwen3-30b-a3b:fp8) launch shapes of that layer's q/k/v, o_proj, router,
          expert gate/up and expert down launches at their real sizes: the small launches where the big GEMV's
          defaults leave too few programs per SM (graph-timed like `models`, each row names its TileConfig / split).

Two timings per launch (DESIGN.md §6):
  us        the launch captured N times back to back in a CUDA graph (the graph backend's path, launch overhead
            removed), cycling through copies of its weights / KV caches that together exceed 3x the 60 MB L2 (and,
            for experts, through random expert ids), replayed under triton.testing.do_bench (warm-up, L2 flushed
            before each replay, median); us = replay time / N.
  us_eager  one eager call per iteration under do_bench (L2 flushed each time): includes the host's launch cost.
GB/s counts weight + scale bytes (GEMVs, router, experts) or the K + V bytes read (attention); % of the probe of
the same run. Never on zeros: random codes and scales.

--budget-s (default 210) bounds the whole run: sections run in order (probe, big, then the models in --models
order) and ops that no longer fit are recorded as skipped, so the default run ends in < 4 minutes. JSON goes to
--out after every section, so a timeout still leaves what was measured.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time

import torch
import triton

from kie_moe.kernels.attention import gqa_decode
from kie_moe.kernels.fp4_mma import (MMA_MAXNREG, MMA_ROW_BLOCKS, MMA_WARPS, gemv_fp4_mma,
                                     pack_for_mma, prepare_xh)
from kie_moe.kernels.fp4_mma_experts import (MMA_EXPERT_WARPS, MMA_GLU_K_SPLIT, MMA_GLU_MAXNREG,
                                             auto_down_row_blocks, glu_k_chunks)
from kie_moe.kernels.gemv import DEFAULT_GLU_TILES, DEFAULT_TILES, TileConfig, gemv, gemv_glu, gemv_ref, prepare_x8
from kie_moe.kernels.moe import (DEFAULT_EXPERT_TILES, RouterConfig, Routing, fold_router, gemv_route, moe_experts,
                                 route)
from kie_moe.kernels.rope import rope_append
from kie_moe.kernels.weights import random_weight

FORMATS = ["bf16", "fp8", "fp8_block", "nvfp4", "mxfp4"]
FP4 = ("nvfp4", "mxfp4")
L2_BYTES = 60 << 20
DEV = "cuda"  # tests/kernels/test_kernels_micro.py drives the sections on CPU (interpreter, tiny shapes)

# Public shapes (config.json of each model; laneformer-2b: dense/preset.py, per lane). "plans": the default
# (label, attention format, FFN / expert format) list; "windows": (window, share of the layers).
MODELS = {
    "qwen3-30b-a3b": dict(hidden=2048, q_heads=32, kv_heads=4, head_dim=128, layers=48, vocab=151936,
                          qk_norm="head", moe=dict(experts=128, top_k=8, inter=768, act="silu", router="softmax"),
                          plans=["bf16", "fp8", "nvfp4"]),
    "gpt-oss-120b": dict(hidden=2880, q_heads=64, kv_heads=8, head_dim=64, layers=36, vocab=201088, qkv_bias=True,
                         sinks=True, windows=[(None, 0.5), (128, 0.5)],
                         moe=dict(experts=128, top_k=4, inter=2880, act="gpt_oss", router="softmax_topk",
                                  interleaved=True, bias=True),
                         plans=["mxfp4-experts", "bf16", "fp8", "nvfp4"]),
    "laneformer-2b": dict(hidden=4096, q_heads=4, kv_heads=2, head_dim=128, layers=15, vocab=32768, inter=864,
                          lanes=8, windows=[(1024, 10 / 15), (None, 5 / 15)], plans=["bf16", "fp8", "nvfp4"]),
    "llama-3.2-1b": dict(hidden=2048, q_heads=32, kv_heads=8, head_dim=64, layers=16, vocab=128256, inter=8192,
                         plans=["bf16", "fp8", "nvfp4"]),
}
DEFAULT_MODELS = ["qwen3-30b-a3b", "gpt-oss-120b", "laneformer-2b"]
# named mixed plans: label -> (attention format, FFN / expert format)
MIXED = {"mxfp4-experts": ("bf16", "mxfp4")}


def plan(label: str) -> tuple[str, str, str]:
    """'fp8' -> ('fp8', 'fp8', 'fp8'); 'mxfp4-experts' -> ('mxfp4-experts', 'bf16', 'mxfp4')."""
    if label in MIXED:
        return (label, *MIXED[label])
    if label not in FORMATS:
        raise ValueError(f"unknown format {label!r}; expected some of {FORMATS + list(MIXED)}")
    return label, label, label


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--formats", default=None,
                   help="comma list of formats for the big GEMV (default: all) and, when given, the per-layer "
                        f"plans of every model instead of each model's own list ({', '.join(FORMATS)}, "
                        f"{', '.join(MIXED)})")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma list of model shapes (default: %(default)s; known: {', '.join(MODELS)})")
    p.add_argument("--ctx", default="128,8192", help="comma list of context lengths for the attention launches; "
                   "the first is the one the layer sums use (kie bench decodes at context 32..159)")
    p.add_argument("--skip", default="", help="comma list of sections to skip: probe,big,big-experts,models")
    p.add_argument("--big-mb", type=int, default=256, help="weight MB of the one-launch GEMV per format")
    p.add_argument("--mma-configs", default=f"{MMA_ROW_BLOCKS}x{MMA_WARPS}",
                   help="fp4 on the tensor cores (kernels/fp4_mma.py) in the big section, timed beside each fp4 "
                        "format's row: comma list of ROW_BLOCKSxWARPS[:rN][:p][:cN] launch shapes ('' = none; "
                        "rN: register cap; p: packing mma; cN: mxfp4 mma chains per group)")
    p.add_argument("--mma-shapes", default="",
                   help="comma list of NxK: each fp4 format's CUDA-core GEMV (gemv with x8) and mma GEMV at that "
                        "shape, both timed in this process (where the mma kernel starts to win)")
    p.add_argument("--probe-gb", type=float, default=4.0, help="GB read by the bandwidth probe")
    p.add_argument("--sweep", action="store_true", help="also sweep launch shapes of the big GEMV per format")
    p.add_argument("--layer-sweep", default=None, metavar="MODEL:FMT",
                   help="sweep the launch shapes of one layer's launches (e.g. qwen3-30b-a3b:fp8)")
    p.add_argument("--layer-ops", default=None, help="comma list of the layer sweep's ops to run (default: all of "
                   "up, down, qkv, o, router)")
    p.add_argument("--rep-ms", type=int, default=40, help="do_bench measuring time per timing (ms)")
    p.add_argument("--no-eager", action="store_true", help="skip the eager (host launch included) timing")
    p.add_argument("--budget-s", type=float, default=210, help="wall-clock budget of the run (0: none)")
    p.add_argument("--experts-topk", default="", metavar="K,K,..",
                   help="routed experts of H = I = 4096 at each of these top-k (2k experts stored), every --formats "
                        "format on its default path (fp4: the tensor cores), each launch's own time: does a launch "
                        "slow down per byte when its programs need a second wave of resident slots")
    return p.parse_args(argv)


class Budget:
    """Seconds left of --budget-s; ops that no longer fit are recorded as skipped instead of run."""

    def __init__(self, seconds: float | None):
        self.t0, self.seconds = time.time(), seconds or None

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.time() - self.t0)

    def out(self) -> bool:
        return self.left() <= 0


EAGER = True  # main() turns it off with --no-eager


# ---- timing -------------------------------------------------------------------------------------------------------
def time_graph(call, n_rot: int, rep_ms: int) -> float:
    """Median microseconds per call of call(i), i cycling over n_rot input sets, captured back to back in one CUDA
    graph (>= 32 calls) and replayed under do_bench."""
    n = max(32, n_rot)
    n = math.ceil(n / n_rot) * n_rot
    for i in range(min(n_rot, 2)):  # compile, allocate the shared counters: never inside the capture
        call(i)
    if DEV != "cuda":  # CPU smoke run of the script's plumbing: nothing to time
        return 1.0
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm the allocator on the capture stream
        call(0)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            call(i % n_rot)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median")
    del graph
    return ms * 1e3 / n


def time_eager(call, n_rot: int, rep_ms: int) -> float | None:
    """Median microseconds of one eager call (host launch cost included), cycling the input sets; do_bench flushes
    the L2 before each call."""
    if not EAGER:
        return None
    if DEV != "cuda":
        call(0)
        return 1.0
    it = [0]

    def one():
        call(it[0] % n_rot)
        it[0] += 1

    return triton.testing.do_bench(one, warmup=5, rep=max(10, rep_ms // 2), return_mode="median") * 1e3


def timed(call, n_rot: int, rep_ms: int) -> tuple[float, float | None]:
    us = time_graph(call, n_rot, rep_ms)
    return us, time_eager(call, n_rot, rep_ms)


def kernel_us(call, n_rot: int, calls: int = 64) -> dict | None:
    """Mean device microseconds per launch of each kernel that one call runs (torch.profiler over `calls` eager
    calls, input sets cycled): which launch of a multi-launch op is the slow one. None off CUDA; a profiler
    failure is returned as {"error": ...} rather than losing the row."""
    if DEV != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
        for i in range(4):
            call(i % n_rot)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(calls):
                call(i % n_rot)
            torch.cuda.synchronize()
        out = {}
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            if t > 0 and ev.count >= calls:
                out[ev.key[:60]] = round(t / ev.count, 3)
        return out
    except Exception as e:  # noqa: BLE001 -- a diagnostic column, never worth the row
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def n_copies(nbytes: int, cap_bytes: int = 4 << 30) -> int:
    """Copies of a weight that together exceed 3x L2 (1 if one copy already does), within cap_bytes."""
    return max(1, min(math.ceil(3 * L2_BYTES / max(nbytes, 1)), 1024, cap_bytes // max(nbytes, 1)))


def row(name, us, nbytes, probe_gbps, us_eager=None, **extra):
    gbps = nbytes / (us * 1e-6) / 1e9
    r = dict(op=name, us=round(us, 3), mb=round(nbytes / 1e6, 4), gbps=round(gbps, 1),
             pct_probe=round(100 * gbps / probe_gbps, 1) if probe_gbps else None, **extra)
    if us_eager is not None:
        r["us_eager"] = round(us_eager, 3)
        r["gbps_eager"] = round(nbytes / (us_eager * 1e-6) / 1e9, 1)
    print(f"  {name:44s} {us:9.2f} us" + (f" ({us_eager:8.2f} eager)" if us_eager is not None else "")
          + f" {nbytes / 1e6:9.3f} MB {gbps:8.0f} GB/s" + (f" {r['pct_probe']:5.1f}%" if probe_gbps else ""),
          flush=True)
    return r


def _vec(n, dtype=torch.bfloat16):
    return torch.randn(n, device=DEV).to(dtype)


# Activations (GEMV inputs, residual, q/k/v): bf16 for the big GEMVs (as the committed big-GEMV results), fp32 in
# the per-layer section, as the graph backend runs them (fp32 residual stream; norm weights and biases are fp32
# vectors there too; weights and the KV cache in their own formats).
ACT = torch.bfloat16


def _x(n):
    return _vec(n, ACT)


def _f32(n):
    return _vec(n, torch.float32)


def bench_gemv(name, fmt, N, K, probe, rep_ms, *, fn="gemv", config=None, seed=0, residual=False, bias=False,
               act="silu", rows=None, eager=True):
    """One Linear [N, K] in `fmt` (`rows`: a list of row counts = that many GEMVs of one input, e.g. q, k, v of a
    block format; they then share the norm'd x8), x = bf16 [K]. fn: gemv | rmsnorm | glu (gate/up halves of one
    [2N, K], act silu or gpt_oss, gpt-oss interleaved). fp4: the GEMV kernels alone, their x8 input made once outside
    the timing (bench_x8 times that launch)."""
    parts = rows or [N]
    total_rows = 2 * N if fn == "glu" else sum(parts)

    def make(sd):  # several GEMVs: one handle each (block-scaled rows cannot be cut at any row)
        if len(parts) == 1:
            return random_weight(fmt, total_rows, K, seed=sd, device=DEV)
        return [random_weight(fmt, n, K, seed=sd * 8 + j, device=DEV) for j, n in enumerate(parts)]

    def nbytes(w):
        return w.nbytes if len(parts) == 1 else sum(h.nbytes for h in w)

    probe_w = make(seed)
    copies = [probe_w] + [make(seed + i) for i in range(1, n_copies(nbytes(probe_w)))]
    x, nw = _x(K), _f32(K)
    res = _x(N)
    b = torch.randn(total_rows, device=DEV) if bias else None
    x8 = prepare_x8(x, nw if fn in ("rmsnorm", "glu") else None) if fmt in FP4 else None
    nw_kw = dict(norm_weight=nw) if fn in ("rmsnorm", "glu") and x8 is None else {}
    offs = [sum(parts[:i]) for i in range(len(parts))]

    def call(i):
        w = copies[i]
        if fn == "glu":
            if act == "gpt_oss":  # interleaved gate/up rows, biases as strided views
                return gemv_glu(x, w.rows(0, None, 2), w.rows(1, None, 2), act=act, x8=x8, config=config,
                                gate_bias=b[0::2] if b is not None else None,
                                up_bias=b[1::2] if b is not None else None, **nw_kw)
            return gemv_glu(x, w.rows(0, N), w.rows(N), act=act, x8=x8, config=config, **nw_kw)
        out = None
        for j, (o, n) in enumerate(zip(offs, parts)):
            wi = w if len(parts) == 1 else w[j]
            bi = None if b is None else b[o:o + n]
            out = gemv(x, wi, bias=bi, residual=res if residual else None, x8=x8, config=config, **nw_kw)
        return out

    us, us_e = time_graph(call, len(copies), rep_ms), (time_eager(call, len(copies), rep_ms) if eager else None)
    return row(name, us, nbytes(probe_w), probe, us_e, fmt=fmt, shape=[total_rows, K], fn=fn,
               launches=len(parts))


def bench_x8(name, K, probe, rep_ms, norm: bool):
    """prepare_x8 alone: the extra launch an fp4 GEMV costs when its producer does not write x8 itself."""
    xs = [_x(K) for _ in range(8)]
    nw = _f32(K) if norm else None
    us, us_e = timed(lambda i: prepare_x8(xs[i], nw), len(xs), rep_ms)
    return row(name, us, K * (2 + 4), probe, us_e, fn="prepare_x8", shape=[K])


def bench_router(name, E, H, cfg, probe, rep_ms, *, with_x8=False, bias=False, config=None):
    ws = [(torch.randn(E, H, device=DEV) * 0.05).to(torch.bfloat16) for _ in range(n_copies(E * H * 2))]
    x, nw = _x(H), _f32(H)
    b = torch.randn(E, device=DEV) if bias else None
    x8 = torch.empty(8, H // 8, device=DEV) if with_x8 else None
    us, us_e = timed(lambda i: route(x, ws[i], cfg, norm_weight=nw, router_bias=b, x8_out=x8, config=config),
                     len(ws), rep_ms)
    return row(name, us, E * H * 2, probe, us_e, fn="route", shape=[E, H])


def _expert_stacks(fmt, m, H):
    """(w_gate, w_up, w_down, bytes per expert, bias kwargs) of a model's routed-expert stacks in `fmt`."""
    E, I = m["experts"], m["inter"]
    if m.get("interleaved") and fmt != "fp8_block":  # block scales cannot follow every other row: same bytes apart
        gate_up = random_weight(fmt, 2 * I, H, experts=E, seed=1, device=DEV, std=0.02)
        wg, wu = gate_up.rows(0, None, 2), gate_up.rows(1, None, 2)
        per_expert = gate_up.nbytes // E
    else:
        wg = random_weight(fmt, I, H, experts=E, seed=1, device=DEV)
        wu = random_weight(fmt, I, H, experts=E, seed=2, device=DEV)
        per_expert = (wg.nbytes + wu.nbytes) // E
    wd = random_weight(fmt, H, I, experts=E, seed=3, device=DEV)
    per_expert += wd.nbytes // E
    bias = {}
    if m.get("bias"):
        b = torch.randn(E, 2 * I, device=DEV)
        bias = dict(gate_bias=b[:, 0::2], up_bias=b[:, 1::2], down_bias=_f32(E * H).reshape(E, H))
    return wg, wu, wd, per_expert, bias


def bench_moe_block(name, fmt, m, H, probe, rep_ms, defer):
    """The router launch + both CUDA-core expert launches as the graph backend runs them (norm fused, fp4: the router
    writes the experts' x8), with the top-k picked by the router's last program (defer False) or by the expert GLU
    launch (defer True: route(defer=True), moe_experts(select=); KIE_SELECT_IN_EXPERTS). Router weights rotate over
    copies, so every call routes to other experts. Bytes: router + top_k experts."""
    E, k = m["experts"], m["top_k"]
    wg, wu, wd, per_expert, bias = _expert_stacks(fmt, m, H)
    cfg = RouterConfig(top_k=k, scoring=m["router"])
    ws = [(torch.randn(E, H, device=DEV) * 0.05).to(torch.bfloat16) for _ in range(n_copies(E * H * 2))]
    x, nw = _x(H), _f32(H)
    rb = torch.randn(E, device=DEV) if m.get("bias") else None
    x8 = torch.empty(8, H // 8, device=DEV) if fmt in FP4 else None
    out = Routing(torch.empty(k, dtype=torch.int32, device=DEV), torch.empty(k, device=DEV),
                  torch.empty(E, device=DEV))
    y = torch.empty(H, device=DEV, dtype=torch.bfloat16)

    def call(i):
        r = route(x, ws[i], cfg, norm_weight=nw, router_bias=rb, x8_out=x8, out=out, defer=defer)
        moe_experts(x, r.ids, r.weights, wg, wu, wd, act=m["act"], norm_weight=nw, x8=x8, residual=x, out=y,
                    mma=False, select=r if defer else None, **bias)

    us, us_e = timed(call, len(ws), rep_ms)
    extra = dict(kernels_us=kernel_us(call, len(ws)))
    del wg, wu, wd
    return row(name, us, k * per_expert + E * H * 2, probe, us_e, fmt=fmt, fn="route+moe_experts",
               shape=[E, k, m["inter"], H], launches=3, ab_row=True, **extra)


def bench_experts(name, fmt, m, H, probe, rep_ms, prenormed=False, packed=False, **tiles):
    """Both launches of moe_experts over random distinct expert sets; tiles: config_up / config_down / split / mma
    (fp4 on the tensor cores: prepare_xh's launch counted too) / glu_pair. prenormed: x already RMS-normed (what
    route(xn_out=) hands float experts): no norm weight in the GLU launch. packed: the stacks in packing "mma"
    (fp4_mma.pack_for_mma, as the graph backend stores its tensor-core experts)."""
    E, k, I = m["experts"], m["top_k"], m["inter"]
    wg, wu, wd, per_expert, bias = _expert_stacks(fmt, m, H)
    if packed:
        wg, wu, wd = pack_for_mma(wg), pack_for_mma(wu), pack_for_mma(wd)
    n_sets = 256  # random distinct experts per call: consecutive calls rarely share an expert in L2
    ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(n_sets)]).to(torch.int32)
    wts = torch.softmax(torch.randn(n_sets, k, device=DEV), -1)
    x, nw = _x(H), _f32(H)
    x8 = prepare_x8(x, nw) if fmt in FP4 else None  # in a model: written by route(x8_out=)

    def call(i):
        return moe_experts(x, ids[i], wts[i], wg, wu, wd, act=m["act"], norm_weight=None if prenormed else nw, x8=x8,
                           residual=x, **bias, **tiles)

    us, us_e = timed(call, n_sets, rep_ms)
    # each launch's own time: the GLU launch streams k experts' gate + up bytes, the down launch k down matrices
    split = dict(kernels_us=kernel_us(call, n_sets), mb_down=round(k * wd.nbytes / E / 1e6, 4))
    del wg, wu, wd
    return row(name, us, k * per_expert, probe, us_e, fmt=fmt, fn="moe_experts", shape=[E, k, I, H], launches=2,
               **split)


def bench_rope(name, spec, probe, rep_ms, ctx):
    """RoPE (+ per-head q/k norm) and the K/V append at position ctx - 1: one launch, latency-bound."""
    hq, hk, hd = spec["q_heads"], spec["kv_heads"], spec["head_dim"]
    n = 64
    qs = [_x(hq * hd).reshape(hq, hd) for _ in range(n)]
    ks = [_x(hk * hd).reshape(hk, hd) for _ in range(n)]
    v = _x(hk * hd).reshape(hk, hd)
    kc = torch.zeros(ctx, hk, hd, device=DEV, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    cos, sin = torch.rand(ctx, hd // 2, device=DEV), torch.rand(ctx, hd // 2, device=DEV)
    pos = torch.tensor([ctx - 1], dtype=torch.int32, device=DEV)
    norm = spec.get("qk_norm")
    kw = dict(qk_norm=norm, q_norm=_f32(hd), k_norm=_f32(hd)) if norm == "head" else {}
    us, us_e = timed(lambda i: rope_append(qs[i], ks[i], v, kc, vc, pos, cos, sin, **kw), n, rep_ms)
    return row(name, us, 2 * (hq + 2 * hk) * hd, probe, us_e, fn="rope_append", shape=[hq, hk, hd])


def bench_attention(name, spec, probe, rep_ms, ctx, window=None):
    """gqa_decode (split + combine launches) at context ctx over rotating bf16 caches."""
    hq, hk, hd = spec["q_heads"], spec["kv_heads"], spec["head_dim"]
    visible = min(ctx, window) if window else ctx
    per = 2 * ctx * hk * hd * 2
    caches = [(_vec(ctx * hk * hd).reshape(ctx, hk, hd), _vec(ctx * hk * hd).reshape(ctx, hk, hd))
              for _ in range(n_copies(per, 2 << 30))]
    q = _x(hq * hd).reshape(hq, hd)
    out = torch.empty_like(q)
    sinks = torch.randn(hq, device=DEV) if spec.get("sinks") else None
    pos = torch.tensor([ctx - 1], dtype=torch.int32, device=DEV)

    def call(i):
        k, v = caches[i]
        return gqa_decode(q, k, v, pos, softmax_scale=hd ** -0.5, window=window, sinks=sinks, out=out)

    us, us_e = timed(call, len(caches), rep_ms)
    return row(name, us, 2 * visible * hk * hd * 2, probe, us_e, fn="gqa_decode", ctx=ctx, window=window,
               shape=[hq, hk, hd], launches=2)


# ---- sections -----------------------------------------------------------------------------------------------------
def probe_section(gb: float, rep_ms: int) -> dict:
    x = torch.empty(int(gb * (1 << 30)) // 8 * 8, dtype=torch.uint8, device=DEV).random_().view(torch.int64)
    ms = triton.testing.do_bench(x.sum, warmup=20, rep=max(rep_ms, 200), return_mode="median")
    gbps = x.numel() * 8 / (ms * 1e-3) / 1e9
    del x
    torch.cuda.empty_cache()
    print(f"probe: torch sum over {gb:.1f} GB: {gbps:.0f} GB/s", flush=True)
    return dict(gb=gb, ms=round(ms, 3), gbps=round(gbps, 1))


def _each_format(formats, budget: Budget | None, op: str, run) -> list:
    """run(fmt) -> a row (or a list of rows) for each format until the time budget is out (then a `skipped` row per
    format)."""
    out = []
    for fmt in formats:
        if budget is not None and budget.out():
            out.append(dict(op=f"{op} {fmt}", skipped="time budget"))
            continue
        r = run(fmt)
        out.extend(r) if isinstance(r, list) else out.append(r)
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return out


def big_section(formats, mb: float, probe: float, rep_ms: int, K: int = 8192, budget: Budget | None = None) -> list:
    print(f"big: one GEMV launch per format, >= {mb} MB of weights, K = {K}", flush=True)

    def run(fmt):
        per_row = {"bf16": 2, "fp8": 1, "fp8_block": 1, "nvfp4": 0.5, "mxfp4": 0.5}[fmt] * K
        N = int(math.ceil(mb * (1 << 20) / per_row / 128) * 128)
        r = bench_gemv(f"gemv {fmt} {N}x{K}", fmt, N, K, probe, rep_ms)
        r["check_rel_err"] = check_rows(fmt, N, K)
        return r

    return _each_format(formats, budget, "gemv", run)


def experts_topk_section(formats, ks, probe: float, rep_ms: int, H: int = 4096, I: int = 4096,
                         budget: Budget | None = None) -> list:
    """moe_experts at each top-k of `ks` (2k experts of [I, H] stored): a launch whose programs fit the GPU's resident
    slots once runs in one wave; one more program per slot adds a second, mostly empty wave. If that is what holds
    the launches below the GEMV's % of the probe (session 20's reading of the fp4 GLU register-cap results: nvfp4
    4096 top-10 = 640 GLU programs at 3 per SM = 396 slots; mxfp4 top-11 = 704 at 4 per SM), the per-byte rate steps
    down between the k whose grid still fits and the next. Each row: both launches, each launch's own time
    (kernels_us) and its program count."""
    print(f"experts top-k sweep: H = {H}, I = {I}, k in {ks}", flush=True)

    def run(fmt):
        rows = []
        for k in ks:
            m = dict(experts=max(8, 2 * k), top_k=k, inter=I, act="silu")
            fp4 = fmt in FP4
            r = bench_experts(f"experts {fmt} top-{k} of {2 * k} [{I}x{H}]{' mma' if fp4 else ''}", fmt, m, H,
                              probe, rep_ms, **({"mma": True} if fp4 else {}))
            if fp4:   # fp4_mma_experts: GLU 16 rows per warp, times its K chunks
                r["glu_k_chunks"] = glu_k_chunks(MMA_GLU_K_SPLIT, I, H, k, fmt, torch.device(DEV))
                r["glu_programs"] = triton.cdiv(I, 16 * MMA_EXPERT_WARPS) * k * r["glu_k_chunks"]
            else:
                r["glu_programs"] = triton.cdiv(I, DEFAULT_EXPERT_TILES[fmt].block_n) * k
            rows.append(r)
        return rows

    return _each_format(formats, budget, "experts-topk", run)


def big_experts_section(formats, mb: float, probe: float, rep_ms: int, H: int = 4096, I: int = 4096,
                        budget: Budget | None = None, model_shapes: bool = True) -> list:
    """Issue 5's routed-expert figure: both launches of moe_experts over >= mb MB of *active* expert bytes (top-k
    experts of [I, H] gate / up and [H, I] down, k chosen per format; twice as many experts stored), bytes = the
    active experts' weights + scales only. fp4: the CUDA-core and tensor-core paths each (model_shapes: also at
    four models' expert shapes)."""
    print(f"big experts: moe_experts over >= {mb} MB of active experts, H = {H}, I = {I}", flush=True)

    def run(fmt):
        per_expert = 3 * I * H * {"bf16": 2, "fp8": 1, "fp8_block": 1, "nvfp4": 0.5 + 1 / 16,
                                  "mxfp4": 0.5 + 1 / 32}[fmt]
        k = max(1, math.ceil(mb * (1 << 20) / per_expert))
        m = dict(experts=max(8, 2 * k), top_k=k, inter=I, act="silu")
        name = f"experts {fmt} top-{k} of {2 * k} [{I}x{H}]"
        if fmt not in FP4:   # float formats: also gate / up in one K loop (glu_pair, session 19's prediction)
            rows = [bench_experts(name, fmt, m, H, probe, rep_ms, glu_pair=False),
                    bench_experts(f"{name} glu pair", fmt, m, H, probe, rep_ms, glu_pair=True),
                    bench_experts(f"{name} glu pair xn", fmt, m, H, probe, rep_ms, glu_pair=True, prenormed=True)]
            if fmt == "fp8_block":   # beside the GLU GEMV's tiles it took until session 19 (H200: 55.0 vs 77.6%)
                old = DEFAULT_GLU_TILES["fp8_block"]
                rows.append(bench_experts(f"{name} glu tiles", fmt, m, H, probe, rep_ms, config_up=old,
                                          config_down=old, glu_pair=False))
            if model_shapes:   # qwen3-30b-a3b's experts, the graph backend's main float case
                q = dict(experts=128, top_k=8, inter=768, act="silu")
                rows += [bench_experts(f"experts {fmt} qwen3-30b-a3b top-8 [768x2048]{tag}", fmt, q, 2048, probe,
                                       rep_ms, glu_pair=pair, prenormed=xn)
                         for tag, pair, xn in (("", False, False), (" glu pair", True, False),
                                               (" glu pair xn", True, True))]
            return rows
        # fp4: the CUDA-core tiles and the tensor cores (fp4_mma_experts) side by side, here and at the expert
        # shapes of DeepSeek-V3 (H 7168, I 2048, top-8), gpt-oss-120b (2880, 2880, top-4), qwen3-30b-a3b (2048,
        # 768, top-8: ~21 MB, below every measured crossover) and Mixtral-8x7B (4096, 14336, top-2): where
        # moe.MMA_EXPERT_MIN_BYTES should lie.
        rows = []
        shapes = [(name, m, H, False)]
        if model_shapes:   # (label, shape, H, a row without the down launch's K chunks too: down_launch_split)
            shapes += [(f"experts {fmt} deepseek-v3 top-8 [2048x7168]",
                        dict(experts=16, top_k=8, inter=2048, act="silu"), 7168, False),
                       (f"experts {fmt} gpt-oss-120b top-4 [2880x2880]",
                        dict(experts=8, top_k=4, inter=2880, act="silu"), 2880, False),
                       (f"experts {fmt} qwen3-30b-a3b top-8 [768x2048]",
                        dict(experts=128, top_k=8, inter=768, act="silu"), 2048, False),
                       (f"experts {fmt} mixtral-8x7b top-2 [14336x4096]",
                        dict(experts=8, top_k=2, inter=14336, act="silu"), 4096, True)]
        for label, mm, h, k_split_row in shapes:
            for mma in (False, True):
                rows.append(bench_experts(f"{label} {'mma' if mma else 'cuda-core'}", fmt, mm, h, probe, rep_ms,
                                          mma=mma))
            # the stacks in packing "mma" (the graph backend's KIE_PACK_EXPERTS, session 39)
            rows.append(bench_experts(f"{label} mma packed", fmt, mm, h, probe, rep_ms, mma=True, packed=True))
            if (label == name or k_split_row) and DEV == "cuda":   # packed: the GLU's K chunks other than
                auto = glu_k_chunks(None, mm["inter"], h, mm["top_k"], fmt, torch.device(DEV), packed=True)
                for ks in (1, 2, 3):   # auto_glu_k_split's (it counts 4 programs per SM for packed nvfp4, 3
                    # for checkpoint bytes)
                    if ks != auto:
                        rows.append(bench_experts(f"{label} mma packed glu-ks{ks}", fmt, mm, h, probe, rep_ms,
                                                  mma=True, packed=True, glu_k_split=ks))
            if k_split_row:
                rows.append(bench_experts(f"{label} mma k-split 1", fmt, mm, h, probe, rep_ms, mma=True,
                                          down_k_split=1))
            else:   # the down launch's row blocks per warp the other way round from auto_down_row_blocks's rule
                other = 3 - auto_down_row_blocks(h, mm["top_k"], mm["inter"], torch.device(DEV))
                rows.append(bench_experts(f"{label} mma down-rb{other}", fmt, mm, h, probe, rep_ms, mma=True,
                                          down_row_blocks=other))
            if label == name and DEV == "cuda":   # the GLU launch's register cap the other way round (r128 / none)
                other = None if MMA_GLU_MAXNREG[fmt] else 128
                rows.append(bench_experts(f"{label} mma glu-r{other or 'auto'}", fmt, mm, h, probe, rep_ms,
                                          mma=True, glu_maxnreg=other))
            if label == name:   # the GLU launch in 2 / 3 K chunks: whole waves of resident programs (session 20)
                for ks in (2, 3):
                    rows.append(bench_experts(f"{label} mma glu-ks{ks}", fmt, mm, h, probe, rep_ms, mma=True,
                                              glu_k_split=ks))
        return rows

    return _each_format(formats, budget, "experts", run)


def mma_config(text: str) -> dict:
    """--mma-configs entry ROW_BLOCKSxWARPS[:rN][:p] -> big_mma's launch keywords (rN: a register cap of N, r0 none;
    p: the weights in packing "mma", fp4_mma.pack_for_mma)."""
    parts = text.split(":")
    try:
        rb, nw = (int(v) for v in parts[0].split("x"))
        kw = dict(row_blocks=rb, num_warps=nw)
        for p in parts[1:]:
            if p.startswith("r"):
                kw["maxnreg"] = int(p[1:])
            elif p == "p":
                kw["packed"] = True
            else:
                raise ValueError(p)
    except ValueError:
        raise SystemExit(f"kernels_micro: --mma-configs entry {text!r}: expected RBxW[:rN][:p]") from None
    return kw


def big_mma(fmt: str, mb: float | None, probe: float, rep_ms: int, row_blocks: int, num_warps: int,
            K: int = 8192, shape: tuple[int, int] | None = None, maxnreg: int | None = MMA_MAXNREG,
            packed: bool = False) -> dict:
    """An fp4 GEMV on the tensor cores (kernels/fp4_mma.py): by default the same shape and byte count as
    big_section's row of that format (or `shape`); its xh input made once outside the timing, as that row's x8."""
    if shape is not None:
        N, K = shape
    else:
        N = int(math.ceil(mb * (1 << 20) / (0.5 * K) / 128) * 128)
    name = (f"gemv {fmt} mma {N}x{K} rb{row_blocks} w{num_warps} r{maxnreg or 'auto'}" + (" packed" if packed else ""))
    probe_w = random_weight(fmt, N, K, seed=0, device=DEV)
    copies = [probe_w] + [random_weight(fmt, N, K, seed=i, device=DEV) for i in range(1, n_copies(probe_w.nbytes))]
    if packed:
        copies = [pack_for_mma(c) for c in copies]
    x = _x(K)
    xh = prepare_xh(x)
    y = torch.empty(N, dtype=x.dtype, device=DEV)

    def call(i):
        return gemv_fp4_mma(x, copies[i], xh=xh, out=y, row_blocks=row_blocks, num_warps=num_warps,
                            maxnreg=maxnreg)

    us = time_graph(call, len(copies), rep_ms)
    r = row(name, us, probe_w.nbytes, probe, fmt=fmt, impl="mma", shape=[N, K], row_blocks=row_blocks,
            num_warps=num_warps, maxnreg=maxnreg)
    got = gemv_fp4_mma(x, copies[0], out=torch.empty(N, device=DEV), row_blocks=row_blocks, num_warps=num_warps,
                       maxnreg=maxnreg)
    want = gemv_ref(x, probe_w, out_dtype=torch.float32)
    r["check_rel_err"] = float((got - want).abs().max() / want.abs().max())
    del copies
    torch.cuda.empty_cache()
    print(f"  {name}: {us:.2f} us, {r['gbps']:.0f} GB/s = {r['pct_probe']}% of the probe, "
          f"err {r['check_rel_err']:.2g}", flush=True)
    return r


def check_rows(fmt, N, K) -> float:
    """Max error of the first rows vs the torch reference (cheap sanity: never benchmark garbage)."""
    n = min(N, 256)
    w = random_weight(fmt, N, K, seed=0, device=DEV).rows(0, n)
    x = _vec(K)
    got = gemv(x, w, out=torch.empty(n, device=DEV))
    want = gemv_ref(x, w, out_dtype=torch.float32)
    return float((got - want).abs().max() / want.abs().max())


def bench_oproj_moe(name, attn_fmt, ffn_fmt, m, H, Kq, probe, rep_ms, fold):
    """o_proj (+ residual), the router and both CUDA-core expert launches with the top-k picked in the expert GLU
    launch, as the graph backend runs them: the router as its own launch (fold False: gemv + route(defer=True)) or
    folded into o_proj's (fold True: moe.gemv_route, KIE_ROUTER_FOLD). o_proj / router / folded weights rotate over
    copies (every call routes to other experts, o_proj comes from HBM). Bytes: o_proj + router (+ the folded rows)
    + top_k experts."""
    E, k = m["experts"], m["top_k"]
    wg, wu, wd, per_expert, bias = _expert_stacks(ffn_fmt, m, H)
    cfg = RouterConfig(top_k=k, scoring=m["router"])
    wo0 = random_weight(attn_fmt, H, Kq, seed=10, device=DEV)
    o_bytes = wo0.nbytes
    n = n_copies(o_bytes + E * (H + Kq) * 2)
    wos = [wo0] + [random_weight(attn_fmt, H, Kq, seed=10 + i, device=DEV) for i in range(1, n)]
    wrs = [(torch.randn(E, H, device=DEV) * 0.05).to(torch.bfloat16) for _ in range(n)]
    a, x, nw = _x(Kq), _f32(H), _f32(H)
    wfs = [fold_router(wr, nw, wo) for wr, wo in zip(wrs, wos)] if fold else None
    rb = torch.randn(E, device=DEV) if m.get("bias") else None
    out = Routing(torch.empty(k, dtype=torch.int32, device=DEV), torch.empty(k, device=DEV),
                  torch.empty(E, device=DEV))
    x1, y = torch.empty(H, device=DEV), torch.empty(H, device=DEV)
    x8 = torch.empty(8, H // 8, device=DEV) if ffn_fmt in FP4 else None   # fp4 experts' input, as the graph shares it

    def call(i):
        if fold:
            _, r = gemv_route(a, wos[i], x, wfs[i], wrs[i], nw, cfg, router_bias=rb, out=x1, x8_out=x8, routing=out)
        else:
            gemv(a, wos[i], residual=x, out=x1)
            r = route(x1, wrs[i], cfg, norm_weight=nw, router_bias=rb, out=out, x8_out=x8, defer=True)
        moe_experts(x1, r.ids, r.weights, wg, wu, wd, act=m["act"], norm_weight=nw, residual=x1, out=y, mma=False,
                    x8=x8, select=r, **bias)

    us, us_e = timed(call, n, rep_ms)
    extra = dict(kernels_us=kernel_us(call, n))
    nbytes = o_bytes + E * H * 2 + (E * Kq * 2 if fold else 0) + k * per_expert
    return row(name, us, nbytes, probe, us_e, fmt=ffn_fmt, fn="gemv_route+moe_experts" if fold else
               "gemv+route+moe_experts", shape=[E, k, m["inter"], H, Kq], launches=3 if fold else 4, ab_row=True,
               **extra)


def _layer_ops(spec, attn_fmt, ffn_fmt):
    """(key, label, thunk -> row) for every launch of one layer in this plan; keys let plans share a measurement
    (the same bf16 attention in two plans is timed once)."""
    H, hd, hq, hk = spec["hidden"], spec["head_dim"], spec["q_heads"], spec["kv_heads"]
    qkv = [hq * hd, hk * hd, hk * hd]
    bias = bool(spec.get("qkv_bias"))
    fused = attn_fmt in ("bf16", "fp8")          # graph backend: one [q+k+v, H] GEMV for float / per-row fp8
    ops = []
    name = "qkv (rmsnorm fused)" if fused else "q, k, v: 3 GEMVs (rmsnorm fused)"
    ops.append((("qkv", attn_fmt), name, lambda probe, rep: bench_gemv(
        name, attn_fmt, sum(qkv), H, probe, rep, fn="rmsnorm", bias=bias, rows=None if fused else qkv)))
    ops.append((("o", attn_fmt), "o_proj (+residual)", lambda probe, rep: bench_gemv(
        "o_proj (+residual)", attn_fmt, H, hq * hd, probe, rep, residual=True)))
    if attn_fmt in FP4:                          # inputs of the fp4 attention GEMVs (not written as x8 upstream)
        ops.append((("x8", H, True), "x8 prep for q/k/v (rmsnorm fused)",
                    lambda probe, rep: bench_x8("x8 prep for q/k/v (rmsnorm fused)", H, probe, rep, norm=True)))
        ops.append((("x8", hq * hd, False), "x8 prep for o_proj",
                    lambda probe, rep: bench_x8("x8 prep for o_proj", hq * hd, probe, rep, norm=False)))
    if "moe" in spec:
        m = spec["moe"]
        cfg = RouterConfig(top_k=m["top_k"], scoring=m["router"])
        fp4 = ffn_fmt in FP4
        ops.append((("router", fp4), "router bf16 (rmsnorm fused)", lambda probe, rep: bench_router(
            "router bf16 (rmsnorm fused)", m["experts"], H, cfg, probe, rep, with_x8=fp4, bias=m.get("bias", False))))
        lab = f"experts top-{m['top_k']} (gate/up + down)"
        ops.append((("experts", ffn_fmt), lab, lambda probe, rep: bench_experts(lab, ffn_fmt, m, H, probe, rep)))
        for defer in (False, True):   # KIE_SELECT_IN_EXPERTS's A/B (session 20's prediction), CUDA-core experts
            lab2 = f"router + experts{' (top-k in the expert launch)' if defer else ''}"
            ops.append((("moe-block", ffn_fmt, defer), lab2, lambda probe, rep, lab2=lab2, defer=defer:
                        bench_moe_block(lab2, ffn_fmt, m, H, probe, rep, defer)))
        if attn_fmt not in FP4:   # KIE_ROUTER_FOLD's A/B (session 22's prediction)
            for fold in (False, True):
                lab3 = f"o_proj + {'router folded in' if fold else 'router'} + experts (top-k in the expert launch)"
                ops.append((("oproj-moe", attn_fmt, ffn_fmt, fold), lab3, lambda probe, rep, lab3=lab3, fold=fold:
                            bench_oproj_moe(lab3, attn_fmt, ffn_fmt, m, H, hq * hd, probe, rep, fold)))
    else:
        I = spec["inter"]
        ops.append((("glu", ffn_fmt), "gate/up swiglu (rmsnorm fused)", lambda probe, rep: bench_gemv(
            "gate/up swiglu (rmsnorm fused)", ffn_fmt, I, H, probe, rep, fn="glu")))
        ops.append((("down", ffn_fmt), "down (+residual)", lambda probe, rep: bench_gemv(
            "down (+residual)", ffn_fmt, H, I, probe, rep, residual=True)))
        if ffn_fmt in FP4:
            ops.append((("x8", H, True), "x8 prep for gate/up (rmsnorm fused)",
                        lambda probe, rep: bench_x8("x8 prep for gate/up (rmsnorm fused)", H, probe, rep, norm=True)))
            ops.append((("x8", I, False), "x8 prep for down",
                        lambda probe, rep: bench_x8("x8 prep for down", I, probe, rep, norm=False)))
    return ops


def _windows(spec) -> list[tuple[int | None, float]]:
    return spec.get("windows") or [(None, 1.0)]


def model_section(name, spec, plans, probe, rep_ms, ctxs=(128,), budget: Budget | None = None) -> dict:
    """Every launch of one layer of `spec` per plan (a format label, see plan()), attention at each ctx; per plan
    the layer and decode-token sums (graph timing and eager timing) at ctxs[0]."""
    global ACT
    act, ACT = ACT, torch.float32
    try:
        return _model_section(name, spec, plans, probe, rep_ms, ctxs, budget or Budget(None))
    finally:
        ACT = act


def _model_section(name, spec, plans, probe, rep_ms, ctxs, budget: Budget) -> dict:
    memo: dict = {}
    print(f"{name}", flush=True)

    def measure(key, label, thunk):
        if key not in memo:
            if budget.out():
                memo[key] = dict(op=label, skipped="time budget")
            else:
                try:
                    memo[key] = thunk(probe, rep_ms)
                except Exception as e:          # one op that fails to build / compile is a result, not the end
                    memo[key] = dict(op=label, error=f"{type(e).__name__}: {e}"[:300])
                    print(f"  {label}: {memo[key]['error']}", flush=True)
                if DEV == "cuda":
                    torch.cuda.empty_cache()
        return dict(memo[key], op=label)      # a shared measurement under this launch's own name

    head = measure(("lm_head",), "lm_head bf16 (rmsnorm fused)", lambda p, r: bench_gemv(
        "lm_head bf16 (rmsnorm fused)", "bf16", spec["vocab"], spec["hidden"], p, r, fn="rmsnorm"))
    attn = {}
    print(f"{name} [attention, bf16 KV]", flush=True)
    lab = "rope + KV append" + (" (q/k norm fused)" if spec.get("qk_norm") else "")
    rope = measure(("rope",), lab, lambda p, r: bench_rope(lab, spec, p, r, ctxs[0]))
    for ctx in ctxs:
        for w, _ in _windows(spec):
            lab = f"attention ctx {ctx}" + (f" window {w}" if w else "")
            attn[(ctx, w)] = measure(("attn", ctx, w), lab, lambda p, r, ctx=ctx, w=w, lab=lab: bench_attention(
                lab, spec, p, r, ctx, w))
    res = dict(spec={k: v for k, v in spec.items() if k != "plans"}, lm_head=head, rope=rope,
               attention=list(attn.values()), plans={})
    for label in plans:
        lab, af, ff = plan(label)
        print(f"{name} [{lab}: attention {af}, {'experts' if 'moe' in spec else 'mlp'} {ff}]", flush=True)
        all_ops = [measure(k, lab_, th) for k, lab_, th in _layer_ops(spec, af, ff)]
        r = dict(attn_fmt=af, ffn_fmt=ff, ops=all_ops)
        missing = [o["op"] for o in all_ops + [head, rope] if "us" not in o]
        ops = [o for o in all_ops if not o.get("ab_row")]   # A/B rows re-time launches the sums already hold
        sums = {}
        for ctx in ctxs:
            a = [(attn[(ctx, w)], share) for w, share in _windows(spec)]
            if any("us" not in x for x, _ in a):
                continue
            for kind in ("us", "us_eager"):
                if any(o.get(kind) is None for o in ops + [head, rope] + [x for x, _ in a]):
                    continue
                layer = sum(o[kind] for o in ops) + rope[kind] + sum(x[kind] * s for x, s in a)
                sums[f"ctx{ctx}_{kind}"] = dict(
                    layer_us=round(layer, 2), decode_ms=round((spec["layers"] * layer + head[kind]) / 1e3, 4),
                    tok_s=round(1e6 / (spec["layers"] * layer + head[kind]), 1))
        layer_mb = sum(o["mb"] for o in ops if o.get("fn") not in ("prepare_x8",) and "mb" in o)
        r.update(layer_weight_mb=round(layer_mb, 3), decode_weight_mb=round(spec["layers"] * layer_mb
                                                                             + head.get("mb", 0), 1),
                 sums=sums, missing=missing)
        key = f"ctx{ctxs[0]}_us"
        if key in sums:
            t = sums[key]
            r["weight_gbps"] = round(r["decode_weight_mb"] / (t["decode_ms"] * 1e3) * 1e3, 1)
            r["weight_pct_probe"] = round(100 * r["weight_gbps"] / probe, 1) if probe else None
            if spec.get("lanes"):
                r["all_lanes_one_device"] = dict(layer_us=round(spec["lanes"] * t["layer_us"], 2),
                                                 decode_ms=round((spec["layers"] * spec["lanes"] * t["layer_us"]
                                                                  + head["us"]) / 1e3, 4))
            print(f"  => {spec['layers']} layers + lm_head at ctx {ctxs[0]}: {t['decode_ms']:.3f} ms "
                  f"({t['tok_s']:.0f} tok/s in these launches), weights {r['decode_weight_mb']:.0f} MB "
                  f"at {r['weight_gbps']:.0f} GB/s"
                  + (f"; eager {sums[f'ctx{ctxs[0]}_us_eager']['decode_ms']:.3f} ms"
                     if f"ctx{ctxs[0]}_us_eager" in sums else ""), flush=True)
        elif missing:
            print(f"  => no layer sum: {', '.join(missing)} not measured", flush=True)
        res["plans"][lab] = r
    return res


def sweep_section(formats, mb: float, probe: float, rep_ms: int, K: int = 8192) -> list:
    out = []
    for fmt in formats:
        per_row = {"bf16": 2, "fp8": 1, "fp8_block": 1, "nvfp4": 0.5, "mxfp4": 0.5}[fmt] * K
        N = int(math.ceil(mb * (1 << 20) / per_row / 128) * 128)
        print(f"sweep {fmt} {N}x{K} (default {DEFAULT_TILES[fmt]})", flush=True)
        bks = (32, 64, 128) if fmt == "fp8_block" else (256, 512, 1024, 2048)
        bns = (16, 32, 64, 128) if fmt == "fp8_block" else (4, 8, 16, 32)
        best = None
        for bn in bns:
            for bk in bks:
                for nw in (4, 8):
                    for pf in (True, False):
                        cfg = TileConfig(bn, bk, nw, prefetch=pf)
                        try:
                            r = bench_gemv(f"{fmt} bn={bn} bk={bk} w={nw} pf={int(pf)}", fmt, N, K, probe, rep_ms,
                                           config=cfg)
                        except Exception as e:  # a shape that does not compile (registers) is a result too
                            r = dict(op=f"{fmt} {cfg}", error=str(e)[:200])
                        r["config"] = dict(block_n=bn, block_k=bk, num_warps=nw, prefetch=pf)
                        out.append(r)
                        if "gbps" in r and (best is None or r["gbps"] > best["gbps"]):
                            best = r
        if best:
            print(f"  best {fmt}: {best['config']} {best['gbps']} GB/s", flush=True)
        torch.cuda.empty_cache()
    return out


def _layer_sweep_grid(fmt: str) -> dict:
    """op -> [(label, kwargs)]: the launch shapes tried per op (block_n x block_k x warps x split / prefetch)."""
    pf = DEFAULT_TILES[fmt].prefetch
    gemv_grid = [("default", {})] + [
        (f"bn={bn} bk={bk} w=4 split={sp}", dict(config=TileConfig(bn, bk, 4, split_k=sp, prefetch=pf)))
        for bn in (4, 8, 16) for bk in (256, 512, 1024) for sp in (None, 2)] + [
        (f"bn={bn} bk={bk} w=2 split=None", dict(config=TileConfig(bn, bk, 2, prefetch=pf)))
        for bn in (4, 8, 16) for bk in (256, 512, 1024)]   # 2 warps: twice the programs per SM at the same bytes
    if not pf:   # fp8 / fp8-block: the weight prefetch their tiles leave off (on for all: -2.7% decode, session 23)
        gemv_grid += [(f"bn={bn} bk={bk} w=4 split=None pf=1", dict(config=TileConfig(bn, bk, 4, prefetch=True)))
                      for bn, bk in ((16, 512), (8, 512), (4, 1024), (8, 1024))]
    router_grid = [("default", {})] + [
        (f"bn={bn} bk={bk} w={w}", dict(config=TileConfig(bn, bk, w)))
        for bn in (4, 8, 16) for bk in (256, 512) for w in (2, 4)]
    up_grid = [("default", {})] + [
        (f"up bn={bn} bk={bk} w={w} pf={int(p)}", dict(config_up=TileConfig(bn, bk, w, prefetch=p)))
        for bn in (2, 4, 8) for bk in (512, 1024) for w in (1, 2, 4) for p in (False, True)]
    down_grid = [(f"down bn={bn} bk=256 w={w} split={sp}",
                  dict(config_down=TileConfig(bn, 256, w, prefetch=pf), split=sp))
                 for bn in (4, 8, 16) for w in (1, 2, 4) for sp in (None, 1, 2, 3, 4, 8)]
    return dict(qkv=gemv_grid, o=gemv_grid, router=router_grid, up=up_grid, down=down_grid)


def layer_sweep_section(target: str, probe: float, rep_ms: int, budget: Budget, only: list | None = None) -> dict:
    """--layer-sweep MODEL:FMT: every launch shape of _layer_sweep_grid for that layer's launches (the expert rows
    time both expert launches: the gate/up grid with the default down, the down grid with the default gate/up)."""
    name, _, fmt = target.partition(":")
    if name not in MODELS or fmt not in FORMATS:
        raise SystemExit(f"kernels_micro: --layer-sweep {target!r}: expected MODEL:FMT with MODEL in {list(MODELS)}, "
                         f"FMT in {FORMATS}")
    spec = MODELS[name]
    H, hd, hq, hk = spec["hidden"], spec["head_dim"], spec["q_heads"], spec["kv_heads"]
    fused = fmt in ("bf16", "fp8")
    qkv = [hq * hd, hk * hd, hk * hd]
    grid = _layer_sweep_grid(fmt)
    ops = {}
    if "moe" in spec:                            # the expert launches first: most of a MoE layer's time
        m = spec["moe"]
        ops["up"] = ops["down"] = lambda lab, kw: bench_experts(f"experts {lab}", fmt, m, H, probe, rep_ms, **kw)
    ops.update({
        "qkv": lambda lab, kw: bench_gemv(f"qkv {lab}", fmt, sum(qkv), H, probe, rep_ms, fn="rmsnorm",
                                          bias=bool(spec.get("qkv_bias")), rows=None if fused else qkv, eager=False,
                                          **kw),
        "o": lambda lab, kw: bench_gemv(f"o_proj {lab}", fmt, H, hq * hd, probe, rep_ms, residual=True, eager=False,
                                        **kw),
    })
    if "moe" in spec:
        rcfg = RouterConfig(top_k=m["top_k"], scoring=m["router"])
        ops["router"] = lambda lab, kw: bench_router(f"router {lab}", m["experts"], H, rcfg, probe, rep_ms,
                                                     with_x8=fmt in FP4, bias=m.get("bias", False), **kw)
    res = dict(model=name, fmt=fmt, ops={})
    for op, fn in ops.items():
        if only and op not in only:
            continue
        rows = res["ops"][op] = []
        print(f"layer sweep {name} {fmt} {op}", flush=True)
        for lab, kw in grid[op]:
            if budget.out():
                rows.append(dict(op=f"{op} {lab}", skipped="time budget"))
                continue
            try:
                r = fn(lab, kw)
            except Exception as e:  # a shape that does not compile (registers, block_k < a group) is a result too
                r = dict(op=f"{op} {lab}", error=f"{type(e).__name__}: {e}"[:300])
                print(f"  {op} {lab}: {r['error'][:120]}", flush=True)
            r["tiles"] = lab
            rows.append(r)
            if DEV == "cuda":
                torch.cuda.empty_cache()
        ok = [r for r in rows if "us" in r]
        if ok:
            best = min(ok, key=lambda r: r["us"])
            dflt = next((r for r in ok if r["tiles"] == "default"), None)
            res.setdefault("best", {})[op] = dict(tiles=best["tiles"], us=best["us"],
                                                  default_us=dflt["us"] if dflt else None)
            print(f"  best {op}: {best['tiles']} {best['us']:.2f} us"
                  + (f" (default {dflt['us']:.2f} us)" if dflt else ""), flush=True)
    return res


def main(argv=None):
    global EAGER
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels_micro: needs a CUDA GPU (see --help)")
    EAGER = not args.no_eager
    labels = [f for f in (args.formats or "").split(",") if f]
    for f in labels:
        try:
            plan(f)
        except ValueError as e:
            raise SystemExit(f"kernels_micro: {e}")
    big_formats = [f for f in labels if f in FORMATS] if labels else FORMATS
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"kernels_micro: unknown model {m!r}; expected some of {list(MODELS)}")
    try:
        ctxs = [int(c) for c in args.ctx.split(",") if c]
    except ValueError:
        raise SystemExit(f"kernels_micro: --ctx {args.ctx!r}: expected a comma list of integers")
    skip = set(args.skip.split(","))
    budget = Budget(args.budget_s)
    prop = torch.cuda.get_device_properties(0)
    result = dict(meta=dict(date=_dt.datetime.now().isoformat(timespec="seconds"), device=prop.name,
                            sms=prop.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
                            python=platform.python_version(), argv=sys.argv[1:], budget_s=args.budget_s,
                            ctx=ctxs, default_tiles={k: vars(v) for k, v in DEFAULT_TILES.items()}))

    def save():
        if args.out:
            with open(args.out + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(args.out + ".tmp", args.out)

    t0 = time.time()
    probe = None
    if "probe" not in skip:
        result["probe"] = probe_section(args.probe_gb, args.rep_ms)
        probe = result["probe"]["gbps"]
        save()
    if "big" not in skip:
        result["big"] = big_section(big_formats, args.big_mb, probe, args.rep_ms, budget=budget)
        configs = [mma_config(c) for c in args.mma_configs.split(",") if c]
        for fmt in (f for f in FP4 if f in big_formats):
            for kw in configs:
                result["big"].append(big_mma(fmt, args.big_mb, probe, args.rep_ms, **kw))
            for shp in (v for v in args.mma_shapes.split(",") if v):
                n, k = (int(v) for v in shp.split("x"))
                result["big"].append(bench_gemv(f"gemv {fmt} {n}x{k}", fmt, n, k, probe, args.rep_ms, eager=False))
                for kw in configs or [mma_config(f"{MMA_ROW_BLOCKS}x{MMA_WARPS}")]:
                    result["big"].append(big_mma(fmt, None, probe, args.rep_ms, shape=(n, k), **kw))
        save()
    if "big-experts" not in skip:
        result["big_experts"] = big_experts_section(big_formats, args.big_mb, probe, args.rep_ms, budget=budget)
        save()
    if args.experts_topk:
        result["experts_topk"] = experts_topk_section(big_formats, [int(v) for v in args.experts_topk.split(",")],
                                                      probe, args.rep_ms, budget=budget)
        save()
    if "models" not in skip:
        result["models"] = {}
        for name in models:
            spec = MODELS[name]
            result["models"][name] = model_section(name, spec, labels or spec["plans"], probe, args.rep_ms,
                                                   ctxs, budget)
            save()
    if args.sweep:
        result["sweep"] = sweep_section(big_formats, args.big_mb, probe, args.rep_ms)
        save()
    if args.layer_sweep:
        result["layer_sweep"] = layer_sweep_section(args.layer_sweep, probe, args.rep_ms, budget,
                                                    [o for o in (args.layer_ops or "").split(",") if o])
        save()
    result["meta"]["seconds"] = round(time.time() - t0, 1)
    result["meta"]["budget_exhausted"] = budget.out()
    save()
    print(f"done in {time.time() - t0:.0f} s" + (" (time budget exhausted: see 'skipped' rows)" if budget.out()
                                                 else "") + (f"; JSON in {args.out}" if args.out else ""))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""GPU micro-benchmark of the batch-1 decode kernels (kie_moe.kernels.gemv / .moe).

Measures, on one GPU:
  probe   the read-bandwidth ceiling: torch sum over ~4 GB (DESIGN.md §6: ~4.2 TB/s on an H200);
  big     each weight format on one GEMV launch covering >= 256 MB of weights (+ scales);
  models  the per-layer GEMV / MoE ops of qwen3-30b-a3b, gpt-oss-120b and llama-3.2-1b in each format (router and
          the bf16 lm_head as the converter keeps them), and the decode time they add up to (no attention);
  sweep   (--sweep) launch shapes of the big GEMV per format, to pick DEFAULT_TILES.
Bandwidth counts weight + scale bytes. Timing: each op is captured N times back to back in a CUDA graph (the
kernel-per-op decode path), cycling through copies of its weights that together exceed 3x the 60 MB L2 (and, for
experts, through random expert ids), replayed under triton.testing.do_bench (warm-up, L2 flushed before each
replay, median); per-op time = replay time / N. Never on zeros: random codes and scales.

JSON goes to --out after every section, so a timeout still leaves what was measured.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import sys
import time

import torch
import triton

from kie_moe.kernels.gemv import DEFAULT_TILES, TileConfig, gemv, gemv_ref, gemv_swiglu, prepare_x8, rmsnorm_gemv
from kie_moe.kernels.moe import RouterConfig, moe_experts, route
from kie_moe.kernels.weights import random_weight

FORMATS = ["bf16", "fp8", "fp8_block", "nvfp4", "mxfp4"]
L2_BYTES = 60 << 20
DEV = "cuda"  # tests/kernels/test_kernels_micro.py drives the sections on CPU (interpreter, tiny shapes)

# Public shapes (config.json of each model).
MODELS = {
    "qwen3-30b-a3b": dict(hidden=2048, q_heads=32, kv_heads=4, head_dim=128, layers=48, vocab=151936,
                          moe=dict(experts=128, top_k=8, inter=768, act="silu", router="softmax")),
    "gpt-oss-120b": dict(hidden=2880, q_heads=64, kv_heads=8, head_dim=64, layers=36, vocab=201088, qkv_bias=True,
                         moe=dict(experts=128, top_k=4, inter=2880, act="gpt_oss", router="softmax_topk",
                                  interleaved=True, bias=True)),
    "llama-3.2-1b": dict(hidden=2048, q_heads=32, kv_heads=8, head_dim=64, layers=16, vocab=128256, inter=8192),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list of weight formats (default: all)")
    p.add_argument("--models", default=",".join(MODELS), help="comma list of model shapes (default: all)")
    p.add_argument("--skip", default="", help="comma list of sections to skip: probe,big,models")
    p.add_argument("--big-mb", type=int, default=256, help="weight MB of the one-launch GEMV per format")
    p.add_argument("--probe-gb", type=float, default=4.0, help="GB read by the bandwidth probe")
    p.add_argument("--sweep", action="store_true", help="also sweep launch shapes of the big GEMV per format")
    p.add_argument("--rep-ms", type=int, default=60, help="do_bench measuring time per op (ms)")
    return p.parse_args(argv)


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
    with torch.cuda.stream(stream):  # warm the allocator on the capture stream
        call(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            call(i % n_rot)
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median")
    del graph
    return ms * 1e3 / n


def n_copies(nbytes: int, cap_bytes: int = 4 << 30) -> int:
    """Copies of a weight that together exceed 3x L2 (1 if one copy already does), within cap_bytes."""
    return max(1, min(math.ceil(3 * L2_BYTES / max(nbytes, 1)), 1024, cap_bytes // max(nbytes, 1)))


def row(name, us, nbytes, probe_gbps, **extra):
    gbps = nbytes / (us * 1e-6) / 1e9
    r = dict(op=name, us=round(us, 3), mb=round(nbytes / 1e6, 3), gbps=round(gbps, 1),
             pct_probe=round(100 * gbps / probe_gbps, 1) if probe_gbps else None, **extra)
    print(f"  {name:42s} {us:9.2f} us {nbytes / 1e6:9.2f} MB {gbps:8.0f} GB/s"
          + (f" {r['pct_probe']:5.1f}%" if probe_gbps else ""), flush=True)
    return r


def bench_gemv(name, fmt, N, K, probe, rep_ms, *, fn="gemv", config=None, seed=0, **kw):
    """One Linear [N, K] in `fmt`, x = bf16 [K]. fn: gemv | rmsnorm | swiglu (gate/up halves of one [2N, K]).
    fp4: the GEMV kernel alone, its x8 input made once outside the timing (bench_x8 times that launch)."""
    rows_ = 2 * N if fn == "swiglu" else N
    probe_w = random_weight(fmt, rows_, K, seed=seed, device=DEV)
    copies = [probe_w] + [random_weight(fmt, rows_, K, seed=seed + i, device=DEV)
                          for i in range(1, n_copies(probe_w.nbytes))]
    x = torch.randn(K, device=DEV).to(torch.bfloat16)
    nw = torch.randn(K, device=DEV).to(torch.bfloat16)
    res = torch.randn(N, device=DEV).to(torch.bfloat16)
    x8 = None
    if fmt in ("nvfp4", "mxfp4"):
        x8 = prepare_x8(x, nw if fn in ("rmsnorm", "swiglu") else None)

    def call(i):
        w = copies[i]
        if fn == "swiglu":
            return gemv_swiglu(x, w.rows(0, N), w.rows(N), norm_weight=nw, x8=x8, config=config)
        if fn == "rmsnorm":
            return rmsnorm_gemv(x, nw, 1e-6, w, x8=x8, config=config)
        return gemv(x, w, residual=res if kw.get("residual") else None, x8=x8, config=config)

    us = time_graph(call, len(copies), rep_ms)
    return row(name, us, probe_w.nbytes, probe, fmt=fmt, shape=[rows_, K], fn=fn)


def bench_x8(name, K, probe, rep_ms, norm: bool):
    """prepare_x8 alone: the extra launch an fp4 GEMV costs when its producer does not write x8 itself."""
    xs = [torch.randn(K, device=DEV).to(torch.bfloat16) for _ in range(8)]
    nw = torch.randn(K, device=DEV).to(torch.bfloat16) if norm else None
    us = time_graph(lambda i: prepare_x8(xs[i], nw), len(xs), rep_ms)
    return row(name, us, K * (2 + 4), probe, fn="prepare_x8", shape=[K])


def bench_router(name, E, H, cfg, probe, rep_ms, *, with_x8=False, bias=False):
    ws = [(torch.randn(E, H, device=DEV) * 0.05).to(torch.bfloat16) for _ in range(n_copies(E * H * 2))]
    x = torch.randn(H, device=DEV).to(torch.bfloat16)
    nw = torch.randn(H, device=DEV).to(torch.bfloat16)
    b = torch.randn(E, device=DEV) if bias else None
    x8 = torch.empty(8, H // 8, device=DEV) if with_x8 else None
    us = time_graph(lambda i: route(x, ws[i], cfg, norm_weight=nw, router_bias=b, x8_out=x8), len(ws), rep_ms)
    return row(name, us, E * H * 2, probe, fn="route", shape=[E, H])


def bench_experts(name, fmt, m, H, probe, rep_ms):
    E, k, I = m["experts"], m["top_k"], m["inter"]
    if m.get("interleaved"):
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
        b = torch.randn(E, 2 * I, device=DEV).to(torch.bfloat16)
        bias = dict(gate_bias=b[:, 0::2], up_bias=b[:, 1::2],
                    down_bias=torch.randn(E, H, device=DEV).to(torch.bfloat16))
    n_sets = 256  # random distinct experts per call: consecutive calls rarely share an expert in L2
    ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(n_sets)]).to(torch.int32)
    wts = torch.softmax(torch.randn(n_sets, k, device=DEV), -1)
    x = torch.randn(H, device=DEV).to(torch.bfloat16)
    nw = torch.randn(H, device=DEV).to(torch.bfloat16)
    x8 = prepare_x8(x, nw) if fmt in ("nvfp4", "mxfp4") else None  # in a model: written by route(x8_out=)

    def call(i):
        return moe_experts(x, ids[i], wts[i], wg, wu, wd, act=m["act"], norm_weight=nw, x8=x8, residual=x, **bias)

    us = time_graph(call, n_sets, rep_ms)
    return row(name, us, k * per_expert, probe, fmt=fmt, fn="moe_experts", shape=[E, k, I, H])


# ---- sections -----------------------------------------------------------------------------------------------------
def probe_section(gb: float, rep_ms: int) -> dict:
    x = torch.empty(int(gb * (1 << 30)) // 8 * 8, dtype=torch.uint8, device=DEV).random_().view(torch.int64)
    ms = triton.testing.do_bench(x.sum, warmup=20, rep=max(rep_ms, 200), return_mode="median")
    gbps = x.numel() * 8 / (ms * 1e-3) / 1e9
    del x
    torch.cuda.empty_cache()
    print(f"probe: torch sum over {gb:.1f} GB: {gbps:.0f} GB/s", flush=True)
    return dict(gb=gb, ms=round(ms, 3), gbps=round(gbps, 1))


def big_section(formats, mb: float, probe: float, rep_ms: int, K: int = 8192) -> list:
    print(f"big: one GEMV launch per format, >= {mb} MB of weights, K = {K}", flush=True)
    out = []
    for fmt in formats:
        per_row = {"bf16": 2, "fp8": 1, "fp8_block": 1, "nvfp4": 0.5, "mxfp4": 0.5}[fmt] * K
        N = int(math.ceil(mb * (1 << 20) / per_row / 128) * 128)
        r = bench_gemv(f"gemv {fmt} {N}x{K}", fmt, N, K, probe, rep_ms)
        r["check_rel_err"] = check_rows(fmt, N, K)
        out.append(r)
        torch.cuda.empty_cache()
    return out


def check_rows(fmt, N, K) -> float:
    """Max error of the first rows vs the torch reference (cheap sanity: never benchmark garbage)."""
    n = min(N, 256)
    w = random_weight(fmt, N, K, seed=0, device=DEV).rows(0, n)
    x = torch.randn(K, device=DEV).to(torch.bfloat16)
    got = gemv(x, w, out=torch.empty(n, device=DEV))
    want = gemv_ref(x, w, out_dtype=torch.float32)
    return float((got - want).abs().max() / want.abs().max())


def model_section(name, spec, formats, probe, rep_ms) -> dict:
    H, hd = spec["hidden"], spec["head_dim"]
    qkv = (spec["q_heads"] + 2 * spec["kv_heads"]) * hd
    res = {}
    print(f"{name}", flush=True)
    head = bench_gemv("lm_head bf16 (rmsnorm fused)", "bf16", spec["vocab"], H, probe, rep_ms, fn="rmsnorm")
    for fmt in formats:
        print(f"{name} [{fmt}]", flush=True)
        ops = [bench_gemv("qkv (rmsnorm fused)", fmt, qkv, H, probe, rep_ms, fn="rmsnorm"),
               bench_gemv("o_proj (+residual)", fmt, H, spec["q_heads"] * hd, probe, rep_ms, residual=True)]
        if "moe" in spec:
            m = spec["moe"]
            cfg = RouterConfig(top_k=m["top_k"], scoring=m["router"])
            ops.append(bench_router("router bf16 (rmsnorm fused)", m["experts"], H, cfg, probe, rep_ms,
                                    with_x8=fmt in ("nvfp4", "mxfp4"), bias=m.get("bias", False)))
            ops.append(bench_experts(f"experts top-{m['top_k']} (gate/up + down)", fmt, m, H, probe, rep_ms))
        else:
            ops.append(bench_gemv("gate/up swiglu (rmsnorm fused)", fmt, spec["inter"], H, probe, rep_ms,
                                  fn="swiglu"))
            ops.append(bench_gemv("down (+residual)", fmt, H, spec["inter"], probe, rep_ms, residual=True))
        if fmt in ("nvfp4", "mxfp4"):  # inputs of the fp4 GEMVs not written as x8 by their producer today
            ops.append(bench_x8("x8 prep for qkv (rmsnorm fused)", H, probe, rep_ms, norm=True))
            ops.append(bench_x8("x8 prep for o_proj", spec["q_heads"] * hd, probe, rep_ms, norm=False))
            if "moe" not in spec:  # MoE: route(x8_out=) and the gate/up kernel write x8 themselves
                ops.append(bench_x8("x8 prep for gate/up (rmsnorm fused)", H, probe, rep_ms, norm=True))
                ops.append(bench_x8("x8 prep for down", spec["inter"], probe, rep_ms, norm=False))
        layer_us = sum(o["us"] for o in ops)
        layer_mb = sum(o["mb"] for o in ops if o.get("fn") != "prepare_x8")
        total_us = spec["layers"] * layer_us + head["us"]
        total_mb = spec["layers"] * layer_mb + head["mb"]
        res[fmt] = dict(ops=ops, lm_head=head, layer_us=round(layer_us, 2),
                        decode_ms_no_attention=round(total_us / 1e3, 3), decode_mb=round(total_mb, 1),
                        gbps=round(total_mb / total_us * 1e3, 1),
                        tok_s_no_attention=round(1e6 / total_us, 1))
        print(f"  => {spec['layers']} layers + lm_head: {total_us / 1e3:.3f} ms, {total_mb:.0f} MB, "
              f"{total_mb / total_us * 1e3:.0f} GB/s, {1e6 / total_us:.0f} tok/s (GEMV/MoE only)", flush=True)
        torch.cuda.empty_cache()
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


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels_micro: needs a CUDA GPU (see --help)")
    formats = [f for f in args.formats.split(",") if f]
    for f in formats:
        if f not in FORMATS:
            raise SystemExit(f"kernels_micro: unknown format {f!r}; expected some of {FORMATS}")
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"kernels_micro: unknown model {m!r}; expected some of {list(MODELS)}")
    skip = set(args.skip.split(","))
    prop = torch.cuda.get_device_properties(0)
    result = dict(meta=dict(date=_dt.datetime.now().isoformat(timespec="seconds"), device=prop.name,
                            sms=prop.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
                            python=platform.python_version(), argv=sys.argv[1:],
                            default_tiles={k: vars(v) for k, v in DEFAULT_TILES.items()}))

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    t0 = time.time()
    probe = None
    if "probe" not in skip:
        result["probe"] = probe_section(args.probe_gb, args.rep_ms)
        probe = result["probe"]["gbps"]
        save()
    if "big" not in skip:
        result["big"] = big_section(formats, args.big_mb, probe, args.rep_ms)
        save()
    if "models" not in skip:
        result["models"] = {}
        for name in models:
            result["models"][name] = model_section(name, MODELS[name], formats, probe, args.rep_ms)
            save()
    if args.sweep:
        result["sweep"] = sweep_section(formats, args.big_mb, probe, args.rep_ms)
        save()
    result["meta"]["seconds"] = round(time.time() - t0, 1)
    save()
    print(f"done in {time.time() - t0:.0f} s" + (f"; JSON in {args.out}" if args.out else ""))


if __name__ == "__main__":
    main()

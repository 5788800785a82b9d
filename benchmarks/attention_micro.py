"""Decode-attention microbenchmarks (GPU only): time per layer and GB/s of KV read vs a read-bandwidth probe.

    python benchmarks/attention_micro.py --out $OUT/attention_micro.json [--contexts 8192 32768] [--sweep]

Shapes: qwen3-30b-a3b (32 q / 4 kv heads, Dh 128, full attention on every layer), gpt-oss-120b (64 / 8, Dh 64,
sinks; a full layer and a 128-token sliding-window layer alternate), deepseek-v3 MLA (128 heads, r 512, rope 64;
its absorbed W_uk / W_uv bytes are counted separately from the latent cache).

Method (DESIGN.md §6): bf16 caches for LAYERS layers (more than 4x the 60 MB L2 in total, so each layer's cache
comes from HBM as in a real decode step), one CUDA graph that runs attention on every layer once, timed by CUDA
events over many replays (median), divided by the layer count. Bytes = what the kernel must read: K + V of the
visible keys (min(context, window)). The probe is a torch sum over 2 GiB, the same ceiling `kie bench` reports.
Window layers read 256 KB each, so their rows may stay in L2 across replays: read them as latency, not bandwidth.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch

SHAPES = {
    "qwen3-30b-a3b": dict(hq=32, hkv=4, dh=128, windows=(None,), sinks=False),
    "gpt-oss-120b": dict(hq=64, hkv=8, dh=64, windows=(None, 128), sinks=True),
}
MLA_SHAPE = dict(h=128, nope=128, rope=64, r=512, v=128)
L2_BYTES = 60 * 2 ** 20


def _median_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _graph(fn):
    """Capture fn (a sequence of launches) into a CUDA graph -> replay callable."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()                                   # compile + warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def read_probe(gib: float = 2.0) -> float:
    """GB/s of a torch sum over `gib` GiB of bf16 (the read ceiling)."""
    x = torch.randn(int(gib * 2 ** 30) // 2, device="cuda", dtype=torch.bfloat16)
    ms = _median_ms(lambda: x.sum(), reps=20)
    del x
    return gib * 2 ** 30 / ms / 1e6


def _layers_for(bytes_per_layer: int, min_layers: int = 4, max_layers: int = 64) -> int:
    return max(min_layers, min(max_layers, -(-4 * L2_BYTES // max(bytes_per_layer, 1))))


def bench_gqa(hq: int, hkv: int, dh: int, ctx: int, *, window: int | None = None, sinks: bool = False,
              num_splits: int | None = None, block_n: int = 64, num_warps: int = 4, reps: int = 50) -> dict:
    """One decode-attention call per layer at context `ctx` -> dict(us per layer, GB/s, bytes, splits)."""
    from kie_moe.kernels.attention import default_num_splits, gqa_decode

    visible = min(ctx, window) if window else ctx
    kv_bytes = 2 * visible * hkv * dh * 2
    layers = _layers_for(2 * ctx * hkv * dh * 2)
    caches = [(torch.randn(ctx, hkv, dh, device="cuda", dtype=torch.bfloat16),
               torch.randn(ctx, hkv, dh, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
    q = torch.randn(hq, dh, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    sk = torch.randn(hq, device="cuda") if sinks else None
    pos = torch.tensor([ctx - 1], dtype=torch.int32, device="cuda")
    span = min(ctx, window) if window else ctx
    splits = num_splits or default_num_splits(hkv, span, "cuda", block_n)

    def step():
        for kc, vc in caches:
            gqa_decode(q, kc, vc, pos, softmax_scale=dh ** -0.5, window=window, sinks=sk, num_splits=splits,
                       out=out, block_n=block_n, num_warps=num_warps)

    ms = _median_ms(_graph(step), reps=reps) / layers
    del caches
    return dict(us=ms * 1e3, GBps=kv_bytes / ms / 1e6, kv_bytes=kv_bytes, splits=splits, block_n=block_n,
                num_warps=num_warps, layers=layers)


def bench_sdpa_peer(hq: int, hkv: int, dh: int, ctx: int, reps: int = 50) -> dict:
    """torch SDPA on the same full-attention decode (K/V as [1, Hkv, ctx, Dh], enable_gqa) for comparison."""
    import torch.nn.functional as F

    kv_bytes = 2 * ctx * hkv * dh * 2
    layers = _layers_for(kv_bytes)
    caches = [(torch.randn(1, hkv, ctx, dh, device="cuda", dtype=torch.bfloat16),
               torch.randn(1, hkv, ctx, dh, device="cuda", dtype=torch.bfloat16)) for _ in range(layers)]
    q = torch.randn(1, hq, 1, dh, device="cuda", dtype=torch.bfloat16)

    def step():
        for k, v in caches:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    ms = _median_ms(_graph(step), reps=reps) / layers
    return dict(us=ms * 1e3, GBps=kv_bytes / ms / 1e6)


def bench_mla(ctx: int, *, h: int, nope: int, rope: int, r: int, v: int, num_splits: int | None = None,
              reps: int = 30) -> dict:
    """Absorbed MLA decode per layer: latent cache bytes and W_uk / W_uv (kv_b) bytes reported apart."""
    from kie_moe.kernels.attention import mla_decode

    cache_bytes = ctx * (r + rope) * 2
    kvb_bytes = h * (nope + v) * r * 2
    layers = _layers_for(cache_bytes + kvb_bytes, max_layers=32)
    mats = [(torch.randn(ctx, r + rope, device="cuda", dtype=torch.bfloat16),
             torch.randn(h * (nope + v), r, device="cuda", dtype=torch.bfloat16) * 0.05) for _ in range(layers)]
    q = torch.randn(h, nope + rope, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(h, v, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([ctx - 1], dtype=torch.int32, device="cuda")

    def step():
        for cache, kv_b in mats:
            mla_decode(q, cache, kv_b, pos, nope=nope, v_head_dim=v, softmax_scale=0.1, num_splits=num_splits,
                       out=out)

    ms = _median_ms(_graph(step), reps=reps) / layers
    total = cache_bytes + kvb_bytes
    return dict(us=ms * 1e3, GBps=total / ms / 1e6, cache_bytes=cache_bytes, kv_b_bytes=kvb_bytes, layers=layers)


def run(contexts=(8192, 32768), sweep: bool = False) -> dict:
    probe = read_probe()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, date=datetime.date.today().isoformat(),
               read_probe_GBps=probe, gqa=[], mla=[], sdpa_peer=[])
    for name, sh in SHAPES.items():
        for ctx in contexts:
            for window in sh["windows"]:
                r = bench_gqa(sh["hq"], sh["hkv"], sh["dh"], ctx, window=window, sinks=sh["sinks"])
                r.update(shape=name, ctx=ctx, window=window, pct_of_probe=100 * r["GBps"] / probe)
                if sweep:
                    best = r
                    for bn in (32, 64, 128):
                        for nw in (4, 8):
                            for splits in (8, 16, 32, 64, 128):
                                t = bench_gqa(sh["hq"], sh["hkv"], sh["dh"], ctx, window=window, sinks=sh["sinks"],
                                              num_splits=splits, block_n=bn, num_warps=nw, reps=20)
                                if t["us"] < best["us"]:
                                    best = dict(t, shape=name, ctx=ctx, window=window)
                    r["best"] = dict(best, pct_of_probe=100 * best["GBps"] / probe)
                res["gqa"].append(r)
                print(f"{name:16s} ctx {ctx:6d} window {str(window):5s} {r['us']:8.2f} us/layer "
                      f"{r['GBps']:8.0f} GB/s ({r['pct_of_probe']:.0f}% of probe) splits {r['splits']}")
            try:
                p = bench_sdpa_peer(sh["hq"], sh["hkv"], sh["dh"], ctx)
                res["sdpa_peer"].append(dict(p, shape=name, ctx=ctx))
                print(f"{'  torch sdpa':16s} ctx {ctx:6d} full         {p['us']:8.2f} us/layer {p['GBps']:8.0f} GB/s")
            except Exception as e:                                        # a peer failing must not lose the run
                res["sdpa_peer"].append(dict(shape=name, ctx=ctx, error=repr(e)[:200]))
    for ctx in contexts:
        r = bench_mla(ctx, **MLA_SHAPE)
        r.update(shape="deepseek-v3", ctx=ctx, pct_of_probe=100 * r["GBps"] / probe)
        res["mla"].append(r)
        print(f"{'deepseek-v3 mla':16s} ctx {ctx:6d}              {r['us']:8.2f} us/layer {r['GBps']:8.0f} GB/s "
              f"(cache {r['cache_bytes'] / 1e6:.1f} MB + kv_b {r['kv_b_bytes'] / 1e6:.1f} MB)")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--sweep", action="store_true", help="also sweep splits / BLOCK_N / warps per case")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_micro needs a CUDA GPU")
    res = run(tuple(args.contexts), args.sweep)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""The fp8 tensor-core GEMV (kernels/fp8_mma.py) against the CUDA-core fp8 GEMV (kernels/gemv.py), beside the read
probe of the same process. GPU only.

Three groups of points, each % of the probe counting weight + scale bytes:
  big        one launch over a 65536 x 8192 matrix (537 MB), a grid of one program per row tile: the loop's rate
             when the GPU is full of programs (issue 5's >= 85% figure);
  persist    the same bytes (K = 8192, and 262144 x 2048 for the monokernel's K) through a persistent grid of
             1, 2 or 4 programs per SM: the monokernel's occupancy, where the CUDA-core fp8 loops stream 29-35% of
             the probe (NOTES.md sessions 4 and 7; benchmarks/stream_probe.py measures those loops);
  shapes     qwen3-30b-a3b's dense fp8 GEMVs (q/k/v 5120 x 2048, o_proj 2048 x 4096) and an lm_head 151936 x 2048,
             each launch timed inside a CUDA graph of 8 launches over 8 weight copies (no L2 reuse between them):
             us per launch, the CUDA-core launch with its fused RMSNorm, the mma launch on a prepared xh plus the
             prepare_xh launch it needs (timed alone).

    python benchmarks/fp8_mma_bench.py --out fp8-mma.json
"""
from __future__ import annotations

import argparse
import json
import time
import traceback


def _bytes(w) -> int:
    return w.weight.numel() + w.scale.numel() * 4


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--only", default="big,persist,shapes")
    a = ap.parse_args(argv)
    import torch
    import triton
    import triton.testing as tt

    from monokernel_bench import read_probe_gbps
    from kie_moe.kernels.fp4_mma import prepare_xh
    from kie_moe.kernels.fp8_mma import gemv_fp8_mma
    from kie_moe.kernels.gemv import gemv
    from kie_moe.kernels.weights import random_weight

    dev = torch.device("cuda")
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    probe = read_probe_gbps()
    res = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
               probe_gbps=probe, n_sms=n_sms, points=[])
    print(f"probe {probe:.0f} GB/s, {n_sms} SMs, {res['device']}", flush=True)

    def save():
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(res, fh, indent=1)

    def point(group, name, fn, nbytes, **extra):
        r = dict(group=group, name=name, **extra)
        try:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            r["first_call_s"] = time.perf_counter() - t0
            ms = tt.do_bench(fn, warmup=20, rep=200, return_mode="median")
            r.update(us=1e3 * ms, gbps=nbytes / ms / 1e6, pct_of_probe=100 * nbytes / ms / 1e6 / probe)
            if "launches" in extra:
                r["us_per_launch"] = r["us"] / extra["launches"]
        except Exception as ex:
            r["error"] = f"{type(ex).__name__}: {ex}"[:600]
            r["tb"] = traceback.format_exc()[-1500:]
        res["points"].append(r)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if k != "tb"}),
              flush=True)
        save()

    groups = a.only.split(",")
    for N, K in ((65536, 8192), (262144, 2048)):
        if not {"big", "persist"} & set(groups):
            break
        w = random_weight("fp8", N, K, seed=1, device=dev)
        x = torch.randn(K, device=dev).to(torch.bfloat16)
        xh = prepare_xh(x, natural=True)
        y = torch.empty(N, device=dev, dtype=torch.bfloat16)
        nb = _bytes(w)
        shape = f"{N}x{K}"
        if "big" in groups:
            point("big", f"cuda-core gemv {shape}", lambda: gemv(x, w, out=y), nb, shape=shape)
            for rb, nw, pc in ((2, 4, 2), (1, 4, 2), (2, 8, 2), (2, 4, 4), (1, 4, 4), (1, 8, 4)):
                point("big", f"mma rb{rb} w{nw} pieces {pc} {shape}",
                      lambda rb=rb, nw=nw, pc=pc: gemv_fp8_mma(x, w, xh=xh, out=y, row_blocks=rb, num_warps=nw,
                                                               pieces=pc), nb, shape=shape, rb=rb, warps=nw, pieces=pc)
        if "persist" in groups:
            for per_sm, nw, pc in ((1, 8, 2), (1, 4, 2), (2, 4, 2), (2, 8, 2), (4, 4, 2), (1, 16, 2), (1, 8, 4),
                                   (2, 4, 4), (1, 4, 4)):
                point("persist", f"mma persistent {per_sm} x {nw} warps per SM, pieces {pc} {shape}",
                      lambda per_sm=per_sm, nw=nw, pc=pc: gemv_fp8_mma(x, w, xh=xh, out=y, row_blocks=2,
                                                                       num_warps=nw, programs=per_sm * n_sms,
                                                                       pieces=pc), nb,
                      shape=shape, per_sm=per_sm, warps=nw, pieces=pc)

    if "shapes" in groups:
        copies = 8
        for name, N, K in (("q/k/v", 5120, 2048), ("o_proj", 2048, 4096), ("lm_head", 151936, 2048)):
            ws = [random_weight("fp8", N, K, seed=i, device=dev) for i in range(copies if N < 100000 else 1)]
            x = torch.randn(K, device=dev).to(torch.bfloat16)
            nw_ = torch.randn(K, device=dev).to(torch.bfloat16)
            xh = prepare_xh(x, nw_, natural=True)
            y = torch.empty(N, device=dev, dtype=torch.bfloat16)
            nb = _bytes(ws[0]) * len(ws)

            def graph_of(launch):
                for w in ws:   # compile + warm outside the capture
                    launch(w)
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for w in ws:
                        launch(w)
                return g.replay

            kw = dict(shape=f"{N}x{K}", launches=len(ws))
            point("shapes", f"cuda-core gemv+norm {name}",
                  graph_of(lambda w: gemv(x, w, norm_weight=nw_, out=y)), nb, **kw)
            point("shapes", f"mma rb2 w4 {name}",
                  graph_of(lambda w: gemv_fp8_mma(x, w, xh=xh, out=y)), nb, **kw)
            point("shapes", f"mma rb1 w4 {name}",
                  graph_of(lambda w: gemv_fp8_mma(x, w, xh=xh, out=y, row_blocks=1)), nb, **kw)
            point("shapes", f"mma rb1 w2 {name}",
                  graph_of(lambda w: gemv_fp8_mma(x, w, xh=xh, out=y, row_blocks=1, num_warps=2)), nb, **kw)
            point("shapes", f"prepare_xh {name} (K {K})",
                  graph_of(lambda w: prepare_xh(x, nw_, natural=True, out=xh)), 0, **kw)
    save()


if __name__ == "__main__":
    main()

"""A few decode launches at real sizes, run back to back for Nsight Compute: where a launch's time goes (stall
reasons, occupancy, achieved DRAM throughput), which CUDA-event timing cannot say. Meant to be wrapped:

    ncu --clock-control none --launch-skip 6 --launch-count 4 -k regex:'_expert|_gemv|_mma_' \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python benchmarks/ncu_launches.py --case experts-fp8

(`scripts/gpu-check R ncu:CASE` runs exactly that). BIG's shapes are kernels_micro.py big_section's (256 MiB of
codes at K = 8192). Cases: experts-FMT (qwen3-30b-a3b's routed experts: top-8 of 128,
I 768, H 2048, both launches), qkv-FMT (qwen3's fused q/k/v, 5120 x 2048, RMSNorm fused), big-FMT (one >= 256 MB
GEMV of issue 5's bandwidth table), bigexperts-FMT (kernels_micro's >= 256 MB routed-expert row: top-k of 2k experts
of 4096 x 4096, k per format as there; fp4 on the tensor cores, its GLU in the K chunks of auto_glu_k_split unless
KIE_MMA_GLU_KS says otherwise). Each case runs its launches `--reps` times after a warm-up (compiles)."""
from __future__ import annotations

import argparse

import torch

from kie_moe.kernels.gemv import gemv, is_fp4, prepare_x8
from kie_moe.kernels.moe import moe_experts
from kie_moe.kernels.weights import random_weight

# bigexperts-FMT: top-k of kernels_micro.big_experts_section (the fewest experts of 4096 x 4096 over 256 MB)
BIG_EXPERTS_TOPK = {"bf16": 3, "fp8": 6, "fp8_block": 6, "nvfp4": 10, "mxfp4": 11}
BIG = {"bf16": (16384, 8192), "fp8": (32768, 8192), "fp8_block": (32768, 8192), "nvfp4": (65536, 8192),
       "mxfp4": (65536, 8192)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", required=True, help="experts-FMT | qkv-FMT | big-FMT | bigexperts-FMT")
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args()
    kind, _, fmt = a.case.partition("-")
    if kind not in ("experts", "qkv", "big", "bigexperts") or fmt not in BIG:
        raise SystemExit(f"ncu_launches: unknown case {a.case!r}: experts-FMT | qkv-FMT | big-FMT | bigexperts-FMT, "
                         f"FMT in {list(BIG)}")
    if not torch.cuda.is_available():
        raise SystemExit("ncu_launches: needs a CUDA GPU (it exists to be profiled by ncu there)")
    dev = "cuda"
    torch.manual_seed(0)
    x = torch.randn(2048, device=dev).to(torch.bfloat16)
    nw = torch.rand(2048, device=dev) + 0.5
    if kind in ("experts", "bigexperts"):
        k = BIG_EXPERTS_TOPK[fmt] if kind == "bigexperts" else 8
        E, I, H = (2 * k, 4096, 4096) if kind == "bigexperts" else (128, 768, 2048)
        if H != x.numel():
            x = torch.randn(H, device=dev).to(torch.bfloat16)
            nw = torch.rand(H, device=dev) + 0.5
        wg, wu = (random_weight(fmt, I, H, experts=E, seed=s, device=dev) for s in (1, 2))
        wd = random_weight(fmt, H, I, experts=E, seed=3, device=dev)
        ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(a.reps + 1)]).to(torch.int32)
        wts = torch.softmax(torch.randn(a.reps + 1, k, device=dev), -1)
        x8 = prepare_x8(x, nw) if is_fp4(fmt) else None
        run = lambda i: moe_experts(x, ids[i], wts[i], wg, wu, wd, norm_weight=nw, x8=x8, residual=x)  # noqa: E731
    elif kind == "qkv":
        w = random_weight(fmt, 5120, 2048, seed=4, device=dev)
        x8 = prepare_x8(x, nw) if is_fp4(fmt) else None
        run = lambda i: gemv(x, w, norm_weight=None if x8 is not None else nw, x8=x8)  # noqa: E731
    else:                                                       # big
        n, kk = BIG[fmt]
        w = random_weight(fmt, n, kk, seed=5, device=dev)
        xb = torch.randn(kk, device=dev).to(torch.bfloat16)
        x8 = prepare_x8(xb) if is_fp4(fmt) else None
        run = lambda i: gemv(xb, w, x8=x8)  # noqa: E731
    for i in range(a.reps + 1):
        run(i)
    torch.cuda.synchronize()
    print(f"{a.case}: {a.reps + 1} calls done")


if __name__ == "__main__":
    main()

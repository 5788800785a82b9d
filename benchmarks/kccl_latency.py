"""KCCL one-shot all-reduce / all-gather latency vs NCCL on N GPUs of one host, 4 KB .. 1 MB messages.

GPU only (importable on CPU, --help works anywhere). Start it with torchrun-style env on 127.0.0.1, e.g.

    torchrun --nproc-per-node 8 --master-addr 127.0.0.1 benchmarks/kccl_latency.py --out kccl-8xh200.json

Each size: `--warmup` untimed calls, then `--iters` calls timed as one block with CUDA events (median of
`--repeats` blocks), per op and library. Also checks KCCL's result against NCCL's (integer-valued inputs, so any
summation order is exact). Rank 0 prints a table and writes JSON (--out). Nothing has been measured with it yet.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="message bytes, comma-separated")
    ap.add_argument("--ops", default="all_reduce,all_gather", help="all_reduce,all_gather")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, metavar="FILE", help="write the JSON result here (rank 0)")
    return ap.parse_args(argv)


def _time(fn, iters: int, repeats: int) -> float:
    """Median over `repeats` blocks of `iters` calls -> microseconds per call."""
    import torch
    per = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        per.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(per)


def run(args) -> dict:
    import torch
    import torch.distributed as dist

    from kie_moe.kccl import collectives as C
    from kie_moe.kccl.symm_gpu import GpuHeap

    if not torch.cuda.is_available():
        raise SystemExit("kccl_latency: needs CUDA GPUs (run under torchrun on the device machine)")
    if os.environ.get("MASTER_ADDR", "127.0.0.1") != "127.0.0.1":
        raise SystemExit("kccl_latency: MASTER_ADDR must be 127.0.0.1 (one host)")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=rank, world_size=world)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    sizes = [int(s) for s in args.sizes.split(",")]
    heap = GpuHeap.rendezvous(capacity_bytes=max(sizes))
    rows = []
    try:
        for op in args.ops.split(","):
            for nbytes in sizes:
                n = nbytes // torch.tensor([], dtype=dtype).element_size()
                x = torch.randint(-8, 8, (n,), device="cuda").to(dtype)
                if op == "all_reduce":
                    k, r = (lambda: C.all_reduce_sum(heap, x)), (lambda: C.reference_all_reduce_sum(x))
                elif op == "all_gather":
                    k, r = (lambda: C.all_gather(heap, x)), (lambda: C.reference_all_gather(x))
                else:
                    raise SystemExit(f"kccl_latency: unknown op {op!r} (all_reduce, all_gather)")
                same = bool(torch.equal(k(), r()))
                for _ in range(args.warmup):
                    k(), r()
                torch.cuda.synchronize()
                row = {"op": op, "bytes": nbytes, "kccl_us": _time(k, args.iters, args.repeats),
                       "nccl_us": _time(r, args.iters, args.repeats), "equal_to_nccl": same}
                rows.append(row)
                if rank == 0:
                    print(f"{op:10s} {nbytes:>8d} B  kccl {row['kccl_us']:8.1f} us  nccl {row['nccl_us']:8.1f} us"
                          f"  {'==' if same else 'DIFFERS'}", flush=True)
    finally:
        dist.destroy_process_group()
    return {"schema": "kccl-latency/1", "world": world, "dtype": args.dtype, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "iters": args.iters, "repeats": args.repeats, "rows": rows,
            "note": "KCCL timing includes the host-side watchdog check (one sync per wait)"}


def main(argv=None) -> int:
    args = parse_args(argv)
    res = run(args)
    if args.out and int(os.environ.get("RANK", 0)) == 0:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Instructions per weight byte of the GEMV inner loops, from sm_90 SASS compiled on a machine without a GPU.

For each format and launch shape (TileConfig) it compiles kernels.gemv._gemv_kernel for the H200 (the stand-in
driver kernels/device_caps.offline_target: compile, never launch), finds the main K loop in `cuobjdump -sass`
(the first backward branch: the unmasked, software-pipelined loop; the second is the masked tail) and reports

  instr   SASS instructions in the loop body (per thread per K step)
  B/thr   bytes one thread streams per K step: weights + scales
  i/B     instr / B/thr: the issue cost of one byte (an SM issues 128 thread-instructions per clock; at 4.5 TB/s on
          132 SMs at 1.98 GHz it receives ~17 B per clock, so ~7.4 instr/B is the most it can afford at 100%)
  alu     the share of instructions on the integer ALU pipe (LOP3, SHF, PRMT, IADD3, LEA, ...: half rate)
  regs    registers per thread; ctas = resident programs per SM (register-limited); kb = KB of weights in
          flight per SM (ctas x tile bytes x (2 when prefetching))

It runs in a subprocess without TRITON_INTERPRET (kernels imported under the interpreter are wrappers).
Usage: python benchmarks/sass_count.py [--formats nvfp4,mxfp4] [--configs 16x512,16x512:np,8x1024:w8] [--hist]
  config syntax: BNxBK[:np (no prefetch)][:wN (num_warps)]; default: each format's DEFAULT_TILES entry.
  --mma RBxW[:rN][:p],..  instead: kernels/fp4_mma.py's kernel (nvfp4 / mxfp4 only) in those launch shapes
  (benchmarks/kernels_micro.py's --mma-configs syntax); i/B is then instructions per u32 word of codes (`i/word`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ALU = ("LOP3", "SHF", "PRMT", "IADD3", "LEA", "ISETP", "SEL", "VIMNMX", "IMNMX", "PLOP3", "F2FP", "BMSK", "SGXT",
       "FMNMX", "FSEL", "VIADD")
BYTES_PER_ELEM = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1, "fp8_block": 1, "nvfp4": 0.5, "mxfp4": 0.5}
SCALE_BYTES_PER_ELEM = {"nvfp4": 1 / 16, "mxfp4": 1 / 32}  # fp8 / fp8-block scales are < 0.01%


def parse_config(text: str, default):
    from kie_moe.kernels.gemv import TileConfig
    if text == "default":
        return default
    parts = text.split(":")
    bn, bk = (int(v) for v in parts[0].split("x"))
    kw = dict(prefetch=True, num_warps=4)
    for p in parts[1:]:
        if p == "np":
            kw["prefetch"] = False
        elif p.startswith("w"):
            kw["num_warps"] = int(p[1:])
        else:
            raise SystemExit(f"sass_count: bad config part {p!r} in {text!r}")
    return TileConfig(bn, bk, **kw)


def main_loop(sass: str) -> list[str]:
    """Instructions of the first loop (backward branch) in a cuobjdump -sass listing."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    for addr, txt in ins:
        if "BRA" in txt:
            t = re.search(r"0x([0-9a-f]+)", txt)
            if t and int(t.group(1), 16) < addr:
                lo = int(t.group(1), 16)
                return [x for a, x in ins if lo <= a <= addr]
    return []


def opcode(txt: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", txt).split()[0]


def _sass(kernel) -> tuple[str, str]:
    """(cuobjdump -sass, cuobjdump -res-usage) of a compiled kernel's cubin."""
    import triton
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        cub = Path(d) / "k.cubin"
        cub.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([str(bin_dir / "cuobjdump"), "-sass", str(cub)], capture_output=True, text=True).stdout
        res = subprocess.run([str(bin_dir / "cuobjdump"), "-res-usage", str(cub)], capture_output=True,
                             text=True).stdout
    return sass, res


def measure(fmt: str, cfg, K: int = 8192, N: int = 4096) -> dict:
    import torch
    from kie_moe.kernels import gemv as G
    from kie_moe.kernels.device_caps import offline_target
    from kie_moe.kernels.weights import random_weight

    w = random_weight(fmt, N, K)
    fp4 = G.is_fp4(fmt)
    x = torch.empty(8, K // 8) if fp4 else torch.empty(K, dtype=torch.bfloat16)
    y = torch.empty(N, dtype=torch.bfloat16)
    part, cnt = torch.empty(4, N), torch.empty(N, dtype=torch.int32)
    with offline_target(90):
        k = G._gemv_kernel.warmup(x, x, *G.weight_args(w), y, y, y, part, cnt, N, K, K, 1e-6, K // 8,
                                  FMT=G.FMT_ID[fmt], HAS_NW=False, HAS_BIAS=False, HAS_RES=False, SPLIT_K=1,
                                  BLOCK_X=1024, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PIPE=cfg.prefetch,
                                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, grid=(1,))
    sass, res = _sass(k)
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    body = main_loop(sass)
    hist = collections.Counter(opcode(t) for t in body)
    threads = 32 * cfg.num_warps
    tile_bytes = cfg.block_n * cfg.block_k * (BYTES_PER_ELEM[fmt] + SCALE_BYTES_PER_ELEM.get(fmt, 0))
    per_thread = tile_bytes / threads
    alu = sum(n for op, n in hist.items() if op.split(".")[0] in ALU)
    regs_warp = -(-regs * 32 // 256) * 256  # allocation granularity: 256 registers per warp
    ctas = min(65536 // (regs_warp * cfg.num_warps), 64 // cfg.num_warps, 32)
    return dict(fmt=fmt, config=f"{cfg.block_n}x{cfg.block_k}{'' if cfg.prefetch else ':np'}"
                                f"{'' if cfg.num_warps == 4 else f':w{cfg.num_warps}'}",
                instr=len(body), bytes_per_thread=per_thread, instr_per_byte=round(len(body) / per_thread, 2),
                alu_share=round(alu / max(len(body), 1), 2), regs=regs, ctas=ctas,
                kb_in_flight=round(ctas * tile_bytes * (2 if cfg.prefetch else 1) / 1024, 1),
                hist=dict(hist.most_common()))


def measure_mma(fmt: str, cfg: dict, K: int = 8192, N: int = 4096) -> dict:
    """kernels/fp4_mma.py's loop: SASS per step (32 words of K per lane row pair), per u32 word, HMMA count, regs."""
    import torch
    from kie_moe.kernels import fp4_mma as M
    from kie_moe.kernels.device_caps import offline_target

    rb, nw = cfg["row_blocks"], cfg["num_warps"]
    w = torch.empty(N, K // 2, dtype=torch.uint8)
    s = torch.empty(N, K // (32 if fmt == "mxfp4" else 16), dtype=torch.uint8)
    xh = torch.empty(K, dtype=torch.float16)
    y = torch.empty(N, dtype=torch.bfloat16)
    with offline_target(90):
        k = M._fp4_mma_kernel.warmup(xh, w, K // 2, s, s.shape[1], y, y, y, y, N, K, MX=fmt == "mxfp4",
                                     HAS_BIAS=False, HAS_RES=False, RB=rb, NW=nw, RP=cfg.get("packed", False),
                                     num_warps=nw, grid=(1,),
                                     maxnreg=cfg.get("maxnreg", M.MMA_MAXNREG) or None)
    sass, res = _sass(k)
    body = main_loop(sass)
    hist = collections.Counter(opcode(t) for t in body)
    words = 16 * rb  # per lane and step: 2 pieces x 4 words x rows r, r + 8 x RB row blocks
    alu = sum(n for op, n in hist.items() if op.split(".")[0] in ALU)
    return dict(fmt=fmt, config=cfg["text"], instr=len(body), bytes_per_thread=words * 4.0,
                instr_per_byte=round(len(body) / words, 2), alu_share=round(alu / max(len(body), 1), 2),
                regs=int(re.search(r"REG:(\d+)", res).group(1)), ctas=0, kb_in_flight=0.0,
                hmma=sum(n for op, n in hist.items() if op.startswith("HMMA")), hist=dict(hist.most_common()))


def _child(args):
    from kie_moe.kernels.gemv import DEFAULT_TILES
    rows = []
    if args.mma:
        sys.path.insert(0, str(Path(__file__).parent))
        from kernels_micro import mma_config
        for fmt in args.formats.split(","):
            for c in args.mma.split(","):
                rows.append(measure_mma(fmt, dict(mma_config(c), text=c), K=args.k))
        print(json.dumps(rows))
        return
    for fmt in args.formats.split(","):
        for c in args.configs.split(","):
            rows.append(measure(fmt, parse_config(c, DEFAULT_TILES[fmt]), K=args.k))
    print(json.dumps(rows))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="bf16,fp8,fp8_block,nvfp4,mxfp4")
    p.add_argument("--configs", default="default", help="comma list of BNxBK[:np][:wN], or 'default'")
    p.add_argument("--k", type=int, default=8192, help="K of the compiled shape (strides specialise on it)")
    p.add_argument("--hist", action="store_true", help="print the opcode histogram of each loop")
    p.add_argument("--mma", default="", help="comma list of RBxW[:rN][:p]: the fp4 mma kernel instead")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return _child(args)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, __file__, "--child", "--formats", args.formats, "--configs", args.configs,
           "--k", str(args.k), "--mma", args.mma]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr[-4000:])
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    if args.mma:
        print(f"{'fmt':10s} {'config':12s} {'instr':>6s} {'words':>6s} {'i/word':>6s} {'alu':>5s} {'regs':>5s} "
              f"{'hmma':>5s}")
        for r in rows:
            print(f"{r['fmt']:10s} {r['config']:12s} {r['instr']:6d} {r['bytes_per_thread'] / 4:6.0f} "
                  f"{r['instr_per_byte']:6.2f} {r['alu_share']:5.2f} {r['regs']:5d} {r['hmma']:5d}")
            if args.hist:
                print("   ", r["hist"])
        return
    print(f"{'fmt':10s} {'config':12s} {'instr':>6s} {'B/thr':>6s} {'i/B':>6s} {'alu':>5s} {'regs':>5s} "
          f"{'ctas':>5s} {'kb':>6s}")
    for r in rows:
        print(f"{r['fmt']:10s} {r['config']:12s} {r['instr']:6d} {r['bytes_per_thread']:6.1f} "
              f"{r['instr_per_byte']:6.2f} {r['alu_share']:5.2f} {r['regs']:5d} {r['ctas']:5d} "
              f"{r['kb_in_flight']:6.1f}")
        if args.hist:
            print("   ", r["hist"])


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Registers, spills and code size of the monokernel built for sm_90 (H100 / H200) without a GPU, per set of flags.

The monokernel is one function: ptxas gives every op's code the registers of the hungriest path (the cap is 255 at
one 8-warp program per SM), so a flag that adds live registers in one op can move spills and scheduling into all
the others (NOTES.md session 31: tf32x3 attention dots made the attention task 40% faster alone and the qwen3 fp8
step 9% slower). This compiles the real shape's plan (meta device: shapes only) once per variant, each in its own
process (some flags are read at import), and reports

  regs      registers per thread (cuobjdump -res-usage)
  stack     bytes of local memory per thread (spills)
  sass      SASS instructions of the whole kernel
  spill_ins STL / LDL instructions, and the source lines (file:line) that hold the most of them

    python benchmarks/monokernel_regs.py --arch qwen3-30b-a3b --formats attn=fp8,exp=fp8 \\
        --variants "base:KIE_MONO_FP8_MMA=1;tf32x3:KIE_MONO_FP8_MMA=1,KIE_ATTN_DOT=tf32x3" [--out regs.json]
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

_CHILD = r"""
import json, sys
sys.path.insert(0, {bench!r})
from monokernel_regs import measure
print("RESULT " + json.dumps(measure({arch!r}, {formats!r}, {splits!r})))
"""


def _tools() -> Path:
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def spill_sites(sass: str, top: int = 8) -> tuple[int, list[tuple[str, int]]]:
    """(STL / LDL instructions, the `top` source lines holding most of them) of an `nvdisasm -g` listing, whose
    `//## File "...", line N` comments name the line of the instructions that follow."""
    where, sites = "?", collections.Counter()
    for line in sass.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = f"{Path(m.group(1)).name}:{m.group(2)}"
        elif re.search(r"\b(STL|LDL)(\.\w+)*\s", line):
            sites[where] += 1
    return sum(sites.values()), sites.most_common(top)


def measure(arch: str, formats: dict, n_splits: int = 10) -> dict:
    """Compile `arch`'s plan (formats: {"attn" | "mlp" | "exp": scheme}) for sm_90 with the flags of this process's
    environment; registers, stack, SASS size and spill sites."""
    import torch

    from kie_moe.kernels.monokernel import plan as P
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend, compile_offline
    plan = P.build_plan(P.preset_spec(arch), None, "meta", n_sms=132, formats=formats)
    be = MonokernelBackend(None, torch.device("meta"), plan=plan, offline=True)
    k = compile_offline(be, n_splits=n_splits)
    tools = _tools()
    with tempfile.TemporaryDirectory() as d:
        cub = Path(d) / "k.cubin"
        cub.write_bytes(k.asm["cubin"])
        res = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cub)], capture_output=True,
                             text=True).stdout
        sass = subprocess.run([str(tools / "nvdisasm"), "-g", "-c", str(cub)], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    n_spill, sites = spill_sites(sass)
    return dict(arch=arch, formats=formats, num_warps=be.num_warps, maxnreg=be.maxnreg,
                regs=int(regs.group(1)) if regs else None, stack=int(stack.group(1)) if stack else None,
                sass=len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+[^;]*;", sass)), spill_ins=n_spill, spill_sites=sites)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3-30b-a3b")
    ap.add_argument("--formats", default="attn=fp8,exp=fp8", help="op kind=scheme pairs (attn, mlp, exp)")
    ap.add_argument("--variants", default="base:KIE_MONO_FP8_MMA=1",
                    help="name:ENV=V,ENV=V;name:... (each compiled in its own process with those variables)")
    ap.add_argument("--splits", type=int, default=10, help="attention splits of the compiled launch")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    formats = dict(kv.split("=") for kv in a.formats.split(",") if kv)
    env0 = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("KIE_")}
    rows = []
    for spec in filter(None, a.variants.split(";")):
        name, _, sets = spec.partition(":")
        # VAR=V pairs split at a comma that starts the next VAR= (a value may itself be a comma list)
        env = dict(env0, **dict(kv.split("=", 1) for kv in re.split(r",(?=[A-Z_][A-Z0-9_]*=)", sets) if kv))
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kie-regs-")   # target_info guards are not in the key
        code = _CHILD.format(bench=str(Path(__file__).parent), arch=a.arch, formats=formats, splits=a.splits)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        out = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode or not out:
            raise SystemExit(f"monokernel_regs: variant {name!r} failed:\n{r.stderr[-3000:]}")
        row = dict(json.loads(out[0][7:]), variant=name, env=sets)
        rows.append(row)
        print(f"{name:<12} regs {row['regs']}  stack {row['stack']} B  sass {row['sass']}  spill instr "
              f"{row['spill_ins']}  top sites {', '.join(f'{s} x{n}' for s, n in row['spill_sites'][:4])}",
              flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(arch=a.arch, formats=formats, rows=rows), indent=1))


if __name__ == "__main__":
    main()

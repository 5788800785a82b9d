"""Graph backend (and monokernel, when it takes the format) on real shapes, random weights built on the GPU,
beside the read-bandwidth probe of the same run. Batch 1, 32-token prompt, 128 new tokens, median of 3.

    python benchmarks/graph_bench.py --out graph.json [--runs llama-3.2-1b:bf16,qwen3-30b-a3b:fp8,qwen3-30b-a3b:nvfp4+head]

(FMT+head: the lm_head quantized too, as `kie convert --quantize-lm-head` writes it.)
"""
from __future__ import annotations

import argparse
import gc
import json
import time
import traceback

import torch


def probe_gbps(nbytes=4 << 30) -> float:
    import triton.testing as tt
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    ms = tt.do_bench(lambda: x.view(torch.int64).sum(), warmup=50, rep=300, return_mode="median")
    del x
    return nbytes / ms / 1e6


def time_backend(be, prompt, new_tokens, runs=3):
    from kie_moe.sampling import SamplingParams
    list(be.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), set()))
    out = []
    for _ in range(runs):
        torch.cuda.synchronize()
        first = None
        toks = []
        for t in be.generate(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), set()):
            toks.append(int(t))
            if first is None:
                first = time.perf_counter()
        torch.cuda.synchronize()
        out.append((len(toks) - 1) / (time.perf_counter() - first))
    return sorted(out)[len(out) // 2], out, toks


def run(arch: str, fmt: str, probe: float, backends: list[str], prompt_len=32, new_tokens=128) -> list[dict]:
    from kie_moe.bench import backend_bytes
    from kie_moe.synthetic import open_model
    rows = []
    # as `kie bench` builds it: float weights drawn tensor by tensor when they would fill over half of the GPU
    # (qwen3-30b-a3b's 61 GB of bf16 beside its packed fp4 copy does not fit an 80 GB H100; session 18)
    # FMT+head: the lm_head quantized too (kie convert --quantize-lm-head)
    model = open_model(arch, torch.device("cuda"), scheme=fmt.removesuffix("+head"),
                       quantize_lm_head=fmt.endswith("+head")).model
    prompt = list(range(100, 100 + prompt_len))
    for name in backends:
        r = {"arch": arch, "fmt": fmt, "backend": name, "prompt_len": prompt_len, "new_tokens": new_tokens}
        try:
            t0 = time.perf_counter()
            if name == "graph":
                from kie_moe.kernels.graph import GraphBackend
                be = GraphBackend(model, torch.device("cuda"))
            else:
                from kie_moe.kernels.monokernel.runtime import MonokernelBackend
                be = MonokernelBackend(model, torch.device("cuda"))
            bpt = backend_bytes(be)       # each backend's own count, as `kie bench` reports it
            r["build_s"] = time.perf_counter() - t0
            tps, runs, toks = time_backend(be, prompt, new_tokens)
            r.update(tok_per_s=tps, runs=runs, bytes_per_token=bpt, token_ids=toks)   # greedy: A/Bs compare them
            if bpt:
                r.update(gbps=tps * bpt / 1e9, pct_roofline=100 * tps * bpt / 1e9 / probe)
            del be
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"[:1500]
            r["trace"] = traceback.format_exc()[-2500:]
        gc.collect()            # a backend's reference cycles (graph, store views) hold its GPU memory until collected
        torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
        rows.append(r)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", default="llama-3.2-1b:bf16,qwen3-30b-a3b:bf16,qwen3-30b-a3b:fp8,qwen3-30b-a3b:nvfp4")
    ap.add_argument("--backends", default="graph")
    a = ap.parse_args()
    import triton
    from kie_moe.roofline import environment
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "env": environment(torch.device("cuda"), prog="python benchmarks/graph_bench.py")}
    res["read_probe_gbps"] = probe = probe_gbps()
    print(json.dumps(res), flush=True)
    res["rows"] = []
    for item in a.runs.split(","):
        arch, fmt = item.split(":")
        res["rows"] += run(arch, fmt, probe, a.backends.split(","))
        json.dump(res, open(a.out, "w"), indent=1)
    for r in res["rows"]:
        print(f"{r['arch']:>16} {r['fmt']:>6} {r['backend']:>10} {r.get('tok_per_s', 0):8.1f} tok/s "
              f"{r.get('pct_roofline', 0):5.1f}% {r.get('error', '')[:80]}")


if __name__ == "__main__":
    main()

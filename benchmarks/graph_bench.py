"""Graph backend (and monokernel, when it takes the format) on real shapes, random weights built on the GPU,
beside the read-bandwidth probe of the same run. Batch 1, 32-token prompt, 128 new tokens, median of 3.

    python benchmarks/graph_bench.py --out graph.json [--runs llama-3.2-1b:bf16,qwen3-30b-a3b:fp8]
"""
from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

LINEAR = ("attn.q", "attn.k", "attn.v", "attn.o", "attn.q_a", "attn.q_b", "attn.kv_a", "mlp.", "moe.experts.",
          "moe.shared.gate", "moe.shared.up", "moe.shared.down")


class QuantizingStore:
    """WeightStore-like wrapper that hands the backends each Linear already quantized to `scheme` (on the GPU),
    as a converted checkpoint would; everything else (norms, router, embeddings, lm_head) stays bf16."""

    def __init__(self, store, scheme: str):
        self.store, self.scheme = store, scheme

    def names(self):
        return self.store.names()

    def __contains__(self, n):
        return n in self.store

    def get(self, n):
        return self.store.get(n)

    def quantized_tensor(self, n):
        from kie_moe.quant.schemes import quantize, get_scheme
        if self.scheme == "bf16" or not any(f".{p}" in f".{n}" or n.startswith(p) for p in LINEAR):
            return None
        if n.endswith("_bias") or n.endswith("shared_gate"):
            return None
        return quantize(self.store.get(n), get_scheme(self.scheme), name=n)


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
        n = 0
        for _t in be.generate(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), set()):
            n += 1
            if first is None:
                first = time.perf_counter()
        torch.cuda.synchronize()
        out.append((n - 1) / (time.perf_counter() - first))
    return sorted(out)[len(out) // 2], out


def run(arch: str, fmt: str, probe: float, backends: list[str], prompt_len=32, new_tokens=128) -> list[dict]:
    from kie_moe.models.registry import LoadedModel
    from kie_moe.models.synth import synth_weights_on_device
    rows = []
    spec, store = synth_weights_on_device(arch, "cuda", torch.bfloat16)
    model = LoadedModel(f"<synth {arch}>", {}, spec, QuantizingStore(store, fmt))
    prompt = list(range(100, 100 + prompt_len))
    for name in backends:
        r = {"arch": arch, "fmt": fmt, "backend": name, "prompt_len": prompt_len, "new_tokens": new_tokens}
        try:
            t0 = time.perf_counter()
            if name == "graph":
                from kie_moe.kernels.graph import GraphBackend
                be = GraphBackend(model, torch.device("cuda"))
                bpt = be.bytes_per_token
            else:
                from kie_moe.kernels.monokernel.runtime import MonokernelBackend
                be = MonokernelBackend(model, torch.device("cuda"))
                bpt = getattr(be, "bytes_per_token", None) or getattr(be.plan, "bytes_per_token", None)
            r["build_s"] = time.perf_counter() - t0
            tps, runs = time_backend(be, prompt, new_tokens)
            r.update(tok_per_s=tps, runs=runs, bytes_per_token=bpt)
            if bpt:
                r.update(gbps=tps * bpt / 1e9, pct_roofline=100 * tps * bpt / 1e9 / probe)
            del be
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"[:1500]
            r["trace"] = traceback.format_exc()[-2500:]
        torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
        rows.append(r)
    del model, store
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", default="llama-3.2-1b:bf16,qwen3-30b-a3b:bf16,qwen3-30b-a3b:fp8,qwen3-30b-a3b:nvfp4")
    ap.add_argument("--backends", default="graph")
    a = ap.parse_args()
    import triton
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
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

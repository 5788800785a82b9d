"""GPU smoke + first numbers: monokernel vs reference tokens on tiny checkpoints of several families, and
monokernel decode speed on real shapes beside a read-bandwidth probe. Writes JSON (--out). GPU only."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback

import torch


def read_probe_gbps(nbytes=4 << 30) -> float:
    import triton.testing as tt
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    ms = tt.do_bench(lambda: x.view(torch.int64).sum(), warmup=50, rep=300, return_mode="median")
    del x
    return nbytes / ms / 1e6


def parity(cases, steps=32) -> list[dict]:
    sys.path.insert(0, ".")
    from tests.models.hf_tiny import make_checkpoint
    from kie_moe.models.registry import load_model
    from kie_moe.models.reference import ReferenceDecoder
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend
    from kie_moe.sampling import SamplingParams
    out = []
    for case in cases:
        r = {"case": case}
        try:
            d = tempfile.mkdtemp()
            make_checkpoint(case, d, torch.bfloat16)
            m = load_model(d)
            prompt = list(range(5, 25))
            ref = ReferenceDecoder(m.spec, m.weights, "cuda", torch.float32)
            logits = ref.forward(torch.tensor(prompt))[-1]
            want, margins = [], []
            for _ in range(steps):
                top2 = torch.topk(logits, 2).values
                margins.append(float(top2[0] - top2[1]))
                t = int(torch.argmax(logits)); want.append(t)
                logits = ref.forward(torch.tensor([t]))[-1]
            mk = MonokernelBackend(m, torch.device("cuda"))
            got = list(mk.generate(prompt, SamplingParams(max_new_tokens=steps, ignore_eos=True), set()))
            n_eq = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), steps)
            r.update(match_prefix=n_eq, steps=steps, equal=got == want,
                     margin_at_divergence=margins[n_eq] if n_eq < steps else None)
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"[:2000]
            r["trace"] = traceback.format_exc()[-3000:]
        print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
        out.append(r)
    return out


def speed(arch: str, probe: float, new_tokens=128, prompt_len=32) -> dict:
    from kie_moe.models.registry import LoadedModel
    from kie_moe.models.synth import synth_weights_on_device, count_params
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend
    from kie_moe.sampling import SamplingParams
    r = {"arch": arch, "dtype": "bf16"}
    try:
        spec, store = synth_weights_on_device(arch, "cuda", torch.bfloat16)
        total, active = count_params(spec)
        m = LoadedModel(f"<synth {arch}>", {}, spec, store)
        t0 = time.perf_counter()
        mk = MonokernelBackend(m, torch.device("cuda"))
        r["plan_s"] = time.perf_counter() - t0
        del store, m
        torch.cuda.empty_cache()
        prompt = list(range(100, 100 + prompt_len))
        p = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        list(mk.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), set()))  # compile + warm
        runs = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter(); first = None; n = 0
            for _tok in mk.generate(prompt, p, set()):
                n += 1
                if first is None:
                    first = time.perf_counter()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            runs.append((n - 1) / (t1 - first))
        tps = sorted(runs)[1]
        # bytes per token: active weights (bf16) + lm head/embedding row; KV is small at this context
        bpt = active * 2
        r.update(tok_per_s=tps, runs=runs, active_params=active, bytes_per_token=bpt,
                 gbps=tps * bpt / 1e9, pct_roofline=100 * tps * bpt / 1e9 / probe,
                 last_launch={k: (v if isinstance(v, (int, float, str)) else str(v)) for k, v in mk.last_launch.items()})
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"[:2000]
        r["trace"] = traceback.format_exc()[-3000:]
    print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="llama,qwen3,qwen3_moe_mixed,qwen2_moe,mixtral_window,olmoe,gpt_oss")
    ap.add_argument("--archs", default="llama-3.2-1b,qwen3-30b-a3b")
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    res["triton"] = triton.__version__
    res["read_probe_gbps"] = probe = read_probe_gbps()
    print(json.dumps(res), flush=True)
    res["parity"] = parity([c for c in a.cases.split(",") if c])
    res["speed"] = [speed(x, probe) for x in a.archs.split(",") if x]
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()

"""Same-shape peers on the same GPU: HF transformers eager, and static cache + torch.compile, batch 1.

Random weights with a real architecture's shapes (models/presets.py), a 32-token prompt, 128 new tokens, greedy.
Prints a table and writes JSON (--out). GPU only; importable on CPU.

    python benchmarks/peers.py --arch qwen3-30b-a3b --modes eager,compile --out peers.json
"""
from __future__ import annotations

import argparse
import json
import time


def run_peer(arch: str, mode: str, prompt_len: int = 32, new_tokens: int = 128, layers: int | None = None) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from kie_moe.models.presets import PRESETS

    cfg_d = dict(PRESETS[arch])
    if layers:
        cfg_d["num_hidden_layers"] = layers
        if "layer_types" in cfg_d:
            cfg_d["layer_types"] = cfg_d["layer_types"][:layers]
    mt = cfg_d.pop("model_type")
    cfg = AutoConfig.for_model(mt, **{k: v for k, v in cfg_d.items() if k not in ("architectures", "quantization_config")})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    for p in model.parameters():            # never time on the init's tiny values alone
        p.data.normal_(0, 0.02)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), device="cuda")
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if mode == "compile":
        kw["cache_implementation"] = "static"
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
    t_c = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})   # warm-up / compile
        model.generate(ids, **kw)
    warm_s = time.perf_counter() - t_c
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = sorted(times)[1]
    n_params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return {"peer": f"hf-transformers-{mode}", "arch": arch, "layers": cfg.num_hidden_layers, "params": n_params,
            "prompt_len": prompt_len, "new_tokens": new_tokens, "tok_per_s": new_tokens / t,
            "runs_s": times, "warmup_s": warm_s, "note": "includes prefill of the prompt in each run"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="preset name (repeatable)")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch, transformers
    rows = []
    for arch in a.arch or ["llama-3.2-1b", "qwen3-30b-a3b"]:
        for mode in a.modes.split(","):
            try:
                r = run_peer(arch, mode, a.prompt_len, a.new_tokens)
            except Exception as e:   # a peer that fails is reported, not fatal to the run
                r = {"peer": f"hf-transformers-{mode}", "arch": arch, "error": f"{type(e).__name__}: {e}"[:500]}
            r.update(torch=torch.__version__, transformers=transformers.__version__,
                     device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)
    for r in rows:
        print(f"{r['arch']:>16} {r['peer']:>28} {r.get('tok_per_s', float('nan')):8.1f} tok/s  {r.get('error', '')}")


if __name__ == "__main__":
    main()

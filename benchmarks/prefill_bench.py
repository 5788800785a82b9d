"""Prefill speed and time to first token of a long prompt, on a preset's real shapes with random weights built on
the device (models/synth) and quantized there (kie_moe.synthetic.QuantizingStore): no checkpoint, no disk.

Per MoE path (`--moe`: grouped_mm, loop, or both; "auto" is what the product picks), through the backend's own
prefill (kernels/prefill.py over its weight buffers, writing its KV cache):
  prefill   one warm-up, then `--runs` timed prefills of `--prompt-len` tokens (torch.cuda.synchronize around
            each); median seconds -> prompt tokens/s
  ttft      backend.generate(prompt, 2 tokens): one untimed call (kernel compiles, CUDA-graph capture), then
            `--runs` timed calls to the first token (prefill of the prompt but its last token + one decode step)
  parity    a `--parity-len` prompt through the same prefill and through the reference decoder (models/reference,
            the oracle, reading the same weights): last-position logits and every layer's KV cache compared
JSON goes to `--out` after every step (a run cut short still leaves its numbers).

    python benchmarks/prefill_bench.py --out results/prefill.json                        # qwen3-30b-a3b fp8, 8192
    python benchmarks/prefill_bench.py --tiny --device cpu --prompt-len 48 --out p.json  # CI plumbing
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--arch", default="qwen3-30b-a3b", help="preset (default qwen3-30b-a3b)")
    ap.add_argument("--scheme", default="fp8", choices=["bf16", "fp8", "fp8-block", "nvfp4", "mxfp4"])
    ap.add_argument("--backend", default="graph", choices=["graph", "monokernel"])
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--moe", default="auto,loop", help="MoE paths to time: auto, grouped_mm, loop (comma list)")
    ap.add_argument("--parity-len", type=int, default=16, help="prompt of the reference comparison (0: skip)")
    ap.add_argument("--no-ttft", action="store_true", help="skip the generate() TTFT measurement")
    ap.add_argument("--tiny", action="store_true", help="the preset's tiny variant (CPU tests)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    return ap.parse_args(argv)


def _sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_time(fn, runs: int, dev) -> tuple[float, list[float]]:
    ts = []
    for _ in range(runs):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def build(a, dev):
    """(Source, backend) for the preset: weights drawn on the device, quantized there, the backend built."""
    import torch
    from kie_moe.synthetic import open_model
    src = open_model(a.arch, dev, scheme=a.scheme, tiny=a.tiny,
                     dtype=torch.float32 if dev.type == "cpu" else torch.bfloat16)
    if a.backend == "graph":
        from kie_moe.kernels.graph import GraphBackend
        be = GraphBackend(src.model, dev)
    else:
        from kie_moe.kernels.monokernel.runtime import MonokernelBackend
        kw = {"quantized": src.model.weights.quantized_tensor} if a.scheme != "bf16" else {}
        be = MonokernelBackend(src.model, dev, prefill="torch", **kw)
    return src, be


def backend_prefill(be, n: int):
    """(Prefill object, its caches in the backend's layout) after sizing the backend's KV cache for n positions."""
    from kie_moe.kernels.prefill import Prefill
    if be.name == "graph":
        be._ensure(n + 2)
        if getattr(be, "_prefiller", None) is None:
            be._prefiller = Prefill.for_graph(be)
        return be._prefiller, be.caches
    be._ensure_kv(n + 2)
    if be._prefiller is None:
        be._prefiller = Prefill.for_plan(be.plan, be.prefill_dtype)
    L = be.spec.num_layers
    caches = ([be.kv[i] for i in range(L)] if be.dims.MLA else
              [(be.kv[i, 0].transpose(0, 1), be.kv[i, 1].transpose(0, 1)) for i in range(L)])
    return be._prefiller, caches


def reference_store(be):
    """The weights the reference decoder reads: the backend's own buffers (dequantized on access)."""
    if be.name == "graph":
        return be.W
    from kie_moe.kernels.monokernel.runtime import ArenaStore
    return ArenaStore(be.plan)


def parity(be, pf, caches, ids, dev) -> dict:
    """Batched prefill vs the reference decoder on the same weights: logits and KV cache, relative errors."""
    import torch
    from kie_moe.models.reference import ReferenceDecoder
    got = pf(ids, caches, logits=True)
    ref = ReferenceDecoder(be.spec, reference_store(be), dev, pf.dtype, lazy=True)
    want = ref.forward(ids)[-1]
    n = len(ids)
    kv_err = 0.0
    for i, (c, rc) in enumerate(zip(caches, ref.cache)):
        if isinstance(c, tuple):
            pairs = [(c[0][:n], rc[0]), (c[1][:n], rc[1])]
        else:
            pairs = [(c[:n], torch.cat(rc, -1))]
        for g, w in pairs:
            kv_err = max(kv_err, float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6)))
    lg = float((got - want).abs().max() / want.abs().max().clamp_min(1e-6))
    cos = float(torch.nn.functional.cosine_similarity(got[None], want[None].float())[0])
    return {"tokens": n, "logits_rel_err": lg, "logits_cosine": cos, "kv_rel_err": kv_err,
            "argmax_equal": int(got.argmax()) == int(want.argmax())}


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")    # the backends' decode kernels (TTFT) run interpreted
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    from kie_moe import roofline as R
    from kie_moe.bench import prompt_ids, write_json
    from kie_moe.sampling import SamplingParams
    env = R.environment(dev, [])
    env["command"] = " ".join(["python", "benchmarks/prefill_bench.py", *(sys.argv[1:] if argv is None else argv)])
    res = {"schema": "kie-prefill-bench/1", "env": env,
           "arch": a.arch + (" (tiny)" if a.tiny else ""), "scheme": a.scheme, "backend": a.backend,
           "prompt_len": a.prompt_len, "runs": a.runs, "rows": []}
    out = a.out
    t0 = time.perf_counter()
    src, be = build(a, dev)
    spec = be.spec
    res["build_s"] = time.perf_counter() - t0
    if a.prompt_len + 2 > spec.max_position:
        raise SystemExit(f"--prompt-len {a.prompt_len} exceeds {a.arch}'s context ({spec.max_position})")
    ids = prompt_ids(spec.vocab_size, a.prompt_len)
    ids_t = torch.tensor(ids, dtype=torch.long)
    pf, caches = backend_prefill(be, a.prompt_len)
    auto_grouped = pf.grouped
    res["auto_moe_path"] = "grouped_mm" if auto_grouped else "loop"
    print(json.dumps({k: res[k] for k in ("arch", "scheme", "backend", "prompt_len", "build_s", "auto_moe_path")}),
          flush=True)
    write_json(res, out)
    for moe in a.moe.split(","):
        row = {"moe": moe}
        try:
            if moe not in ("auto", "grouped_mm", "loop"):
                raise ValueError(f"--moe: unknown path {moe!r}")
            pf.grouped = auto_grouped if moe == "auto" else moe == "grouped_mm"
            row["moe_path"] = "grouped_mm" if pf.grouped else "loop"
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
                base = torch.cuda.memory_allocated(dev)
            pf(ids_t, caches)                                                     # warm-up
            med, ts = _median_time(lambda: pf(ids_t, caches), a.runs, dev)
            row.update(prefill_s=med, prefill_s_runs=ts, tok_per_s=a.prompt_len / med, stats=dict(pf.stats))
            if dev.type == "cuda":
                row["peak_extra_gb"] = (torch.cuda.max_memory_allocated(dev) - base) / 1e9
            if a.parity_len:
                pids = torch.tensor(prompt_ids(spec.vocab_size, a.parity_len, seed=1), dtype=torch.long)
                row["parity"] = parity(be, pf, caches, pids, dev)
            if not a.no_ttft:
                p = SamplingParams(max_new_tokens=2, ignore_eos=True)

                def first_token():
                    g = be.generate(list(ids), p, set())
                    next(g)
                    g.close()
                first_token()                                                     # compiles, graph capture
                med, ts = _median_time(first_token, a.runs, dev)
                row.update(ttft_ms=med * 1e3, ttft_ms_runs=[t * 1e3 for t in ts],
                           ttft_prompt_tok_per_s=a.prompt_len / med)
        except Exception as e:         # a path that fails is recorded; the next one still runs
            row["error"] = f"{type(e).__name__}: {e}"[:1500]
            row["trace"] = traceback.format_exc()[-2500:]
        pf.grouped = auto_grouped
        res["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        write_json(res, out)
    for r in res["rows"]:
        if "error" in r:
            print(f"{r['moe']:>10}: error {r['error'][:120]}")
        else:
            print(f"{r['moe']:>10} ({r['moe_path']}): prefill {r['tok_per_s']:9.0f} tok/s "
                  f"({r['prefill_s'] * 1e3:.1f} ms)"
                  + (f", TTFT {r['ttft_ms']:.1f} ms" if "ttft_ms" in r else "")
                  + (f", parity logits {r['parity']['logits_rel_err']:.2e} kv {r['parity']['kv_rel_err']:.2e}"
                     if "parity" in r else ""))
    return 1 if any("error" in r for r in res["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Where two greedy runs of the graph backend part ways (an env-flag A/B such as KIE_SELECT_IN_EXPERTS): is the
first differing token a near-tie of the logits, and how far apart are the routings before it?

    python benchmarks/select_divergence.py --arch qwen3-30b-a3b --fmt fp8 --steps 48 --out div.json

Runs the backend's launches eagerly (no CUDA graph, so the logits and each layer's routing can be read after every
step), once with kernels.graph.SELECT_IN_EXPERTS off and once on, from the same prompt. Reports per step the
top-1 ids, the top-1 / top-2 logit gap of each run and the largest logit difference; at step 0 (identical inputs up
to the first MoE layer) every layer's routing: equal ids, and the largest relative difference of the weights.
"""
from __future__ import annotations

import argparse
import json

import torch


def run(be, prompt, steps, select: bool):
    import kie_moe.kernels.graph as graph
    from kie_moe.sampling import SamplingParams
    graph.SELECT_IN_EXPERTS = select
    be.eager = True
    logits, routes = [], None
    gen = be.generate(prompt, SamplingParams(max_new_tokens=steps, ignore_eos=True), set())
    for s, _ in enumerate(gen):
        logits.append(be.logits.detach().clone())
        if s == 0:
            routes = [(L["routing"].ids.clone(), L["routing"].weights.clone()) for L in be.layers if "routing" in L]
    return torch.stack(logits), routes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="qwen3-30b-a3b")
    ap.add_argument("--fmt", default="fp8")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the preset's tiny shape (a CPU smoke run)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from kie_moe.kernels.graph import GraphBackend
    from kie_moe.synthetic import open_model
    dev = torch.device(a.device)
    model = open_model(a.arch, dev, scheme=a.fmt, tiny=a.tiny).model
    be = GraphBackend(model, dev)
    prompt = list(range(100, 132))
    la, ra = run(be, prompt, a.steps, False)
    lb, rb = run(be, prompt, a.steps, True)
    ta, tb = la.argmax(-1), lb.argmax(-1)
    first = next((s for s in range(a.steps) if ta[s] != tb[s]), None)
    rows = []
    for s in range(a.steps if first is None else min(a.steps, first + 1)):
        top_a, top_b = la[s].topk(2).values, lb[s].topk(2).values
        rows.append({"step": s, "tok_off": int(ta[s]), "tok_on": int(tb[s]),
                     "gap_off": float(top_a[0] - top_a[1]), "gap_on": float(top_b[0] - top_b[1]),
                     "max_logit_diff": float((la[s] - lb[s]).abs().max()),
                     "logit_scale": float(la[s].abs().max())})
    layer0 = []
    for i, ((ia, wa), (ib, wb)) in enumerate(zip(ra, rb)):
        layer0.append({"layer": i, "ids_equal": bool(torch.equal(ia, ib)),
                       "weights_bit_equal": bool(torch.equal(wa, wb)),
                       "weights_max_rel_diff": float(((wa - wb).abs() / wa.abs().clamp_min(1e-30)).max())})
    out = {"arch": a.arch, "fmt": a.fmt, "steps": a.steps, "first_divergence": first, "per_step": rows,
           "step0_routing": layer0, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    for r in rows[-3:]:
        print(json.dumps(r))
    print(f"first divergence: step {first}; step 0 layer 0 routing: {json.dumps(layer0[0])}; layers with unequal "
          f"ids at step 0: {[r['layer'] for r in layer0 if not r['ids_equal']]}; max weight rel diff at step 0: "
          f"{max(r['weights_max_rel_diff'] for r in layer0):.3g}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

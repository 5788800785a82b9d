"""The batched prefill on a real GPU (`-m gpu`): real widths (a few layers so the fp32 reference fits beside them),
bf16 activations, grouped_mm and the per-expert loop, through the graph backend's buffers, against the fp32
reference decoder on the same (dequantized) weights. Prompts cross the 2,048-token chunk and gpt-oss's 128-token
window. The fp32 reference takes the prefill's own expert choices (bf16 and fp32 disagree on router near ties).
bf16 noise bounds: logits within 3% of their largest magnitude or twice the bf16 reference decoder's error on the
same choices (1 - cosine within 1e-3 or twice the bf16 reference's), every KV row within 5%."""
import pytest
import torch

from kie_moe.kernels.prefill import Prefill, grouped_mm_available
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.models.registry import LoadedModel
from kie_moe.models.synth import synth_weights_on_device
from kie_moe.synthetic import QuantizingStore

pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda")


def cut(arch: str, layers: int) -> dict:
    from kie_moe.models.presets import preset
    cfg = preset(arch)
    cfg["num_hidden_layers"] = layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(cfg["max_window_layers"], layers)
    return cfg


ROUTER_TIE = 0.1   # router logits: the largest fp32 top-k margin a bf16 run may decide the other way


def routed_as(pf, monkeypatch):
    """Run the prefill with its MoE routing recorded: {layer: expert ids [S, k]} (chunks concatenated)."""
    import kie_moe.kernels.prefill as P
    from kie_moe.models.reference import route
    rec, layer = {}, [None]
    moe = pf._moe

    def moe_at(i, m, x):
        layer[0] = i
        return moe(i, m, x)

    def record(m, logits, sb):
        ids, w = route(m, logits, sb)
        rec.setdefault(layer[0], []).append(ids)
        return ids, w

    monkeypatch.setattr(pf, "_moe", moe_at)
    monkeypatch.setattr(P, "route", record)
    return rec


def reference_routed(ref, ids, forced: dict, monkeypatch) -> tuple[torch.Tensor, list, dict]:
    """The reference's last logits with every MoE layer using the experts in `forced` ({layer: [S, k]}, the
    prefill's own choice); where its own top-k differs: (layer, token, k-th margin) per changed token; and its
    router logits {layer: [S, E]}."""
    import kie_moe.models.reference as R
    route, layers, moved, seen = R.route, sorted(forced), [], {}

    def pinned(m, logits, sb):
        i = layers[len(seen)]
        seen[i] = logits.float()
        own, _ = route(m, logits, sb)
        want = forced[i].to(own.device)
        diff = (own.sort(-1).values != want.sort(-1).values).any(-1).nonzero().flatten().tolist()
        v = torch.sort(logits.float(), -1, descending=True).values
        for t in diff:
            moved.append((i, t, float(v[t, m.top_k - 1] - v[t, m.top_k])))
        return route(m, logits, sb, ids=want)

    monkeypatch.setattr(R, "route", pinned)
    out = ref.forward(ids)[-1]
    monkeypatch.setattr(R, "route", route)
    return out, moved, seen


@pytest.mark.parametrize("arch,layers,scheme,n", [
    ("qwen3-30b-a3b", 2, "fp8", 2500), ("qwen3-30b-a3b", 2, "bf16", 700),     # 2500: two query chunks
    ("gpt-oss-20b", 2, "bf16", 600), ("deepseek-v2-lite", 2, "bf16", 600)])    # sinks + window 128; MLA
def test_real_width_prefill_matches_fp32_reference(arch, layers, scheme, n, monkeypatch):
    """At real widths a bf16 run and the fp32 reference pick different experts for a few (token, layer) pairs
    whose router top-k margin is tiny (qwen3-30b-a3b bf16, 700 tokens: the last token's margins are 0.022 and
    0.007, and the bf16 *reference decoder* then sits 9% of the largest logit from fp32): such a flip changes
    whole hidden states, so no bf16 bound holds across it. The fp32 reference therefore takes the prefill's own
    expert choice (route(ids=...)), and every (token, layer) where that differs from its own top-k must have an
    fp32 margin within twice the router-logit error of the bf16 reference decoder in that layer, or ROUTER_TIE
    (measured there: 232 of 1,400 (token, layer) pairs differ, all with margins below 0.085; on the H200,
    qwen3-30b-a3b fp8 at 2,500 tokens: 844 of 5,000, one at 0.113)."""
    from kie_moe.kernels.graph import GraphBackend
    spec, store = synth_weights_on_device(cut(arch, layers), DEVICE, torch.bfloat16)
    m = LoadedModel(f"<{arch}>", {}, spec, QuantizingStore(store, scheme) if scheme != "bf16" else store)
    be = GraphBackend(m, DEVICE, dtype=torch.bfloat16)
    ids = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    paths = [False] + ([True] if grouped_mm_available(DEVICE, torch.bfloat16) else [])
    for grouped in paths:
        pf = Prefill.for_graph(be, grouped=grouped)
        rec = routed_as(pf, monkeypatch)
        be._ensure(n + 1)
        got = pf(ids, be.caches, logits=True)
        monkeypatch.undo()
        forced = {i: torch.cat(c) for i, c in rec.items()}
        ref = ReferenceDecoder(spec, be.W, DEVICE, torch.float32, lazy=True)
        want, moved, rl = reference_routed(ref, ids, forced, monkeypatch)
        # the same math in bf16 on the same expert choices: how far precision alone moves logits and router logits
        low, _, rl_low = reference_routed(ReferenceDecoder(spec, be.W, DEVICE, torch.bfloat16, lazy=True), ids,
                                          forced, monkeypatch)
        path = "grouped" if grouped else "loop"
        # a flip needs the k-th / (k+1)-th router logits to move apart by the margin: <= twice the largest router
        # logit error the bf16 reference shows in that layer (or ROUTER_TIE)
        tie = {i: max(ROUTER_TIE, 2 * float((rl_low[i] - rl[i]).abs().max())) for i in rl}
        beyond = [(i, t, mg, tie[i]) for i, t, mg in moved if mg > tie[i]]
        assert not beyond, f"{path}: {len(moved)} routed differently, beyond a near tie: {beyond}"
        # bf16 noise at real widths grows with the prompt (qwen3-30b-a3b bf16, CPU: 2.2% of the largest logit at
        # 300 tokens): the bound is 3% of it or twice what the bf16 reference decoder shows on the same routing
        err, err_low = float((got - want).abs().max()), float((low.float() - want).abs().max())
        assert err <= max(0.03 * float(want.abs().max()), 2 * err_low), (path, pf.stats, err, err_low, len(moved))
        cos = float(torch.nn.functional.cosine_similarity(got[None], want[None])[0])
        cos_low = float(torch.nn.functional.cosine_similarity(low.float()[None], want[None])[0])
        assert 1 - cos <= max(1e-3, 2 * (1 - cos_low)), (path, cos, cos_low)
        for i, (c, rc) in enumerate(zip(be.caches, ref.cache)):
            pairs = [(c[0][:n], rc[0]), (c[1][:n], rc[1])] if isinstance(c, tuple) else [(c[:n], torch.cat(rc, -1))]
            for g, w in pairs:
                err = float((g.float() - w).abs().max())
                assert err <= 0.05 * float(w.abs().max()), f"layer {i} ({path}): {err}"

"""The batched prefill on a real GPU (`-m gpu`): real widths (a few layers so the fp32 reference fits beside them),
bf16 activations, grouped_mm and the per-expert loop, through the graph backend's buffers, against the fp32
reference decoder on the same (dequantized) weights. Prompts cross the 2,048-token chunk and gpt-oss's 128-token
window. bf16 noise bounds: logits within 3% of their largest magnitude (cosine > 0.999), every KV row within 5%."""
import pytest
import torch

from kie_moe.kernels.prefill import Prefill, grouped_mm_available
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.models.registry import LoadedModel
from kie_moe.models.synth import synth_weights_on_device
from kie_moe.synthetic import QuantizingStore

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def cut(arch: str, layers: int) -> dict:
    from kie_moe.models.presets import preset
    cfg = preset(arch)
    cfg["num_hidden_layers"] = layers
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    if "max_window_layers" in cfg:
        cfg["max_window_layers"] = min(cfg["max_window_layers"], layers)
    return cfg


@pytest.mark.parametrize("arch,layers,scheme,n", [
    ("qwen3-30b-a3b", 2, "fp8", 2500), ("qwen3-30b-a3b", 2, "bf16", 700),     # 2500: two query chunks
    ("gpt-oss-20b", 2, "bf16", 600), ("deepseek-v2-lite", 2, "bf16", 600)])    # sinks + window 128; MLA
def test_real_width_prefill_matches_fp32_reference(arch, layers, scheme, n):
    from kie_moe.kernels.graph import GraphBackend
    spec, store = synth_weights_on_device(cut(arch, layers), CUDA, torch.bfloat16)
    m = LoadedModel(f"<{arch}>", {}, spec, QuantizingStore(store, scheme) if scheme != "bf16" else store)
    be = GraphBackend(m, CUDA)
    ids = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    ref = ReferenceDecoder(spec, be.W, CUDA, torch.float32, lazy=True)
    want = ref.forward(ids)[-1]
    paths = [False] + ([True] if grouped_mm_available(CUDA, torch.bfloat16) else [])
    for grouped in paths:
        pf = Prefill.for_graph(be, grouped=grouped)
        be._ensure(n + 1)
        got = pf(ids, be.caches, logits=True)
        assert float((got - want).abs().max()) <= 0.03 * float(want.abs().max()), (grouped, pf.stats)
        assert float(torch.nn.functional.cosine_similarity(got[None], want[None])[0]) > 0.999
        for i, (c, rc) in enumerate(zip(be.caches, ref.cache)):
            pairs = [(c[0][:n], rc[0]), (c[1][:n], rc[1])] if isinstance(c, tuple) else [(c[:n], torch.cat(rc, -1))]
            for g, w in pairs:
                err = float((g.float() - w).abs().max())
                assert err <= 0.05 * float(w.abs().max()), f"layer {i} ({'grouped' if grouped else 'loop'}): {err}"

"""HF transformers (v5) Qwen3-MoE state dicts with some modules' weights replaced: how the demo model's quantization
gate (scripts/train_demo_model.py) and benchmarks/demo_quant_analysis.py run decompressed weights through HF's own
modeling code, with the quantized modules decompressed by compressed-tensors' own decompressors."""
from __future__ import annotations

import os


def qwen3_moe_state(base: dict, get, n_layers: int, n_experts: int) -> dict:
    """HF (transformers v5: fused experts) state dict with module name -> float weight (None: keep the base one);
    module names are the checkpoint's (`...mlp.experts.E.gate_proj`), as kie convert writes them."""
    sd = dict(base)
    for L in range(n_layers):
        p = f"model.layers.{L}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w = get(p + f"self_attn.{n}")
            if w is not None:
                sd[p + f"self_attn.{n}.weight"] = w
        gu, dn = sd[p + "mlp.experts.gate_up_proj"].clone(), sd[p + "mlp.experts.down_proj"].clone()
        inter = dn.shape[-1]
        for e in range(n_experts):
            g, u, d = (get(p + f"mlp.experts.{e}.{n}") for n in ("gate_proj", "up_proj", "down_proj"))
            if g is not None:
                gu[e, :inter] = g
            if u is not None:
                gu[e, inter:] = u
            if d is not None:
                dn[e] = d
        sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"] = gu, dn
    return sd


def ct_decompressed(ckpt_dir: str, scheme: str) -> tuple[dict, dict]:
    """(every tensor of `ckpt_dir`'s model.safetensors, {module: float32 weight} of its quantized modules as
    compressed-tensors' decompressor for `scheme` reads them back): the oracle for what a converted checkpoint means."""
    from compressed_tensors.compressors import BaseCompressor
    from safetensors.torch import load_file

    from kie_moe.quant import ct_scheme
    written = load_file(os.path.join(ckpt_dir, "model.safetensors"))
    cts = ct_scheme(scheme)
    comp = BaseCompressor.get_value_from_registry(cts.format)
    mods: dict[str, dict] = {}
    for k, v in written.items():
        mod, _, local = k.rpartition(".")
        mods.setdefault(mod, {})[local] = v
    return written, {m: comp.decompress(t, cts)["weight"].float() for m, t in mods.items() if "weight_scale" in t}

"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): q/k/v biases, softmax router with optional renormalisation, and a
shared expert scaled by sigmoid(shared_expert_gate(x))."""
from ..spec import LayerSpec, MLPSpec, MoESpec, canonical
from .common import Cfg, L, base_spec, dense_family_refs, gqa_attention, layer_windows, mlp_refs, mlp_spec, ref
from .qwen3_moe import moe_refs

MODEL_TYPES = ("qwen2_moe",)


def build_spec(cfg: Cfg):
    n = cfg.positive("num_hidden_layers")
    attn = gqa_attention(cfg, qkv_bias=bool(cfg.get("qkv_bias", True)))
    E = cfg.get("num_experts", 0, int)
    shared = cfg.get("shared_expert_intermediate_size", 0, int)
    moe = MoESpec(num_experts=E, top_k=cfg.positive("num_experts_per_tok"),
                  intermediate_size=cfg.positive("moe_intermediate_size"), scoring="softmax",
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                  shared_intermediate_size=shared, shared_expert_gate=shared > 0) if E else None
    step = cfg.get("decoder_sparse_step", 1, int) or 1
    only = set(cfg.get("mlp_only_layers") or [])
    default = None
    if cfg.get("use_sliding_window"):
        mwl = cfg.get("max_window_layers", 28)
        default = ["sliding_attention" if (i + 1) % 2 and i < mwl else "full_attention" for i in range(n)]
    wins = layer_windows(cfg, n, default) if cfg.get("use_sliding_window") else [None] * n
    layers = []
    for i in range(n):
        sparse = moe is not None and i not in only and (i + 1) % step == 0
        layers.append(LayerSpec(attn=attn, moe=moe if sparse else None, mlp=None if sparse else mlp_spec(cfg),
                                sliding_window=wins[i]))
    return base_spec(cfg, "qwen2_moe", layers)


def tensor_refs(spec):
    out = dense_family_refs(spec) + moe_refs(spec)
    D = spec.hidden_size
    for i, lay in enumerate(spec.layers):
        if lay.moe is not None and lay.moe.shared_intermediate_size:
            p = f"model.layers.{i}.mlp"
            out += mlp_refs(i, "moe.shared", MLPSpec(lay.moe.shared_intermediate_size), D, f"{p}.shared_expert")
            out.append(ref(canonical(i, "moe.shared_gate"), L(f"{p}.shared_expert_gate.weight", (1, D))))
    return out

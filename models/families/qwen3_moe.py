"""Qwen3-MoE: Qwen3 attention (per-head q/k norm); MoE on layers where (i+1) % decoder_sparse_step == 0 and
i not in mlp_only_layers; softmax router, top-k, optional renormalisation (norm_topk_prob)."""
from ..spec import LayerSpec, MoESpec, canonical
from .common import Cfg, L, base_spec, dense_family_refs, expert_refs, gqa_attention, mlp_spec, ref

MODEL_TYPES = ("qwen3_moe",)


def build_spec(cfg: Cfg):
    n = cfg.positive("num_hidden_layers")
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_attention(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head")
    E = cfg.get("num_experts", cfg.get("num_local_experts", 0), int)
    moe = MoESpec(num_experts=E, top_k=cfg.positive("num_experts_per_tok"),
                  intermediate_size=cfg.positive("moe_intermediate_size"), scoring="softmax",
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", False))) if E else None
    step = cfg.get("decoder_sparse_step", 1, int) or 1
    only = set(cfg.get("mlp_only_layers") or [])
    # HF qwen3_moe: one window for every layer whenever sliding_window is set
    win = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    layers = []
    for i in range(n):
        sparse = moe is not None and i not in only and (i + 1) % step == 0
        layers.append(LayerSpec(attn=attn, moe=moe if sparse else None, mlp=None if sparse else mlp_spec(cfg),
                                sliding_window=win))
    return base_spec(cfg, "qwen3_moe", layers)


def moe_refs(spec, router="mlp.gate", experts="mlp.experts"):
    out = []
    for i, lay in enumerate(spec.layers):
        if lay.moe is None:
            continue
        p = f"model.layers.{i}"
        out.append(ref(canonical(i, "moe.router"), L(f"{p}.{router}.weight", (lay.moe.num_experts, spec.hidden_size))))
        out += expert_refs(i, lay.moe, spec.hidden_size, f"{p}.{experts}")
    return out


def tensor_refs(spec):
    return dense_family_refs(spec) + moe_refs(spec)

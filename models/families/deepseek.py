"""DeepSeek-V2 / V3: Multi-head Latent Attention (with or without q_lora_rank), dense first layers
(first_k_dense_replace), shared experts, group-limited routing.

V2: softmax scores; topk_method greedy or group_limited_greedy (group score = max); weights * routed_scaling_factor.
V3: sigmoid scores; choice uses scores + e_score_correction_bias; group score = sum of the group's top-2; weights
are the unbiased scores, renormalised (norm_topk_prob) and * routed_scaling_factor.
RoPE on the qk_rope part only, adjacent pairs (V2's complex form; V3's rope_interleave), YaRN with mscale; the
softmax scale gains mscale(factor, mscale_all_dim)^2 under YaRN.
"""
import re

from ..errors import ConfigError
from ..rope import _yarn_mscale, rope_from_config
from ..spec import AttentionSpec, LayerSpec, MLPSpec, MoESpec, canonical
from .common import Cfg, L, base_spec, embed_and_head, expert_refs, mlp_refs, mlp_spec, norm_refs, ref

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


def _attention(cfg: Cfg, v3: bool) -> AttentionSpec:
    if cfg.get("attention_bias"):
        raise ConfigError(f"{cfg.path}: attention_bias=true is not supported for DeepSeek MLA")
    heads = cfg.positive("num_attention_heads")
    nope, rope_d = cfg.positive("qk_nope_head_dim"), cfg.positive("qk_rope_head_dim")
    style = "pair" if (not v3 or cfg.get("rope_interleave", True)) else "half"
    rope = rope_from_config(cfg.d, rope_d, style)
    scale = (nope + rope_d) ** -0.5
    if rope.scaling != "default" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return AttentionSpec(kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=nope + rope_d, rope=rope,
                         softmax_scale=scale, q_lora_rank=cfg.get("q_lora_rank", None, int),
                         kv_lora_rank=cfg.positive("kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope_d,
                         v_head_dim=cfg.positive("v_head_dim"))


def build_spec(cfg: Cfg):
    v3 = cfg.d.get("model_type") == "deepseek_v3"
    n = cfg.positive("num_hidden_layers")
    attn = _attention(cfg, v3)
    E = cfg.get("n_routed_experts", 0, int)
    moe = None
    if E:
        n_group = cfg.get("n_group", 1, int) or 1
        if E % n_group:
            raise ConfigError(f"{cfg.path}: n_routed_experts={E} is not divisible by n_group={n_group}")
        grouped = v3 or cfg.get("topk_method", "greedy") == "group_limited_greedy"
        if not v3 and cfg.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"{cfg.path}: topk_method {cfg.get('topk_method')!r} is not supported")
        moe = MoESpec(num_experts=E, top_k=cfg.positive("num_experts_per_tok"),
                      intermediate_size=cfg.positive("moe_intermediate_size"),
                      scoring="sigmoid" if v3 else "softmax",
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", False)) if v3 else False,
                      routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                      n_group=n_group if grouped else 1, topk_group=(cfg.get("topk_group", 1, int) or 1) if grouped else 1,
                      group_score="top2sum" if v3 else "max", score_correction_bias=v3,
                      shared_intermediate_size=(cfg.get("n_shared_experts", 0, int) or 0) * cfg.positive("moe_intermediate_size"))
    first_dense = cfg.get("first_k_dense_replace", 0, int) or 0
    layers = [LayerSpec(attn=attn, moe=moe if (moe and i >= first_dense) else None,
                        mlp=None if (moe and i >= first_dense) else mlp_spec(cfg)) for i in range(n)]
    return base_spec(cfg, cfg.d.get("model_type"), layers)


def mla_refs(i: int, a: AttentionSpec, D: int, p: str):
    c = lambda n: canonical(i, n)
    H, qk = a.num_heads, a.head_dim
    out = []
    if a.q_lora_rank:
        out += [ref(c("attn.q_a"), L(f"{p}.q_a_proj.weight", (a.q_lora_rank, D))),
                ref(c("attn.q_a_norm"), L(f"{p}.q_a_layernorm.weight", (a.q_lora_rank,))),
                ref(c("attn.q_b"), L(f"{p}.q_b_proj.weight", (H * qk, a.q_lora_rank)))]
    else:
        out.append(ref(c("attn.q"), L(f"{p}.q_proj.weight", (H * qk, D))))
    out += [ref(c("attn.kv_a"), L(f"{p}.kv_a_proj_with_mqa.weight", (a.kv_lora_rank + a.qk_rope_head_dim, D))),
            ref(c("attn.kv_a_norm"), L(f"{p}.kv_a_layernorm.weight", (a.kv_lora_rank,))),
            ref(c("attn.kv_b"), L(f"{p}.kv_b_proj.weight", (H * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank))),
            ref(c("attn.o"), L(f"{p}.o_proj.weight", (D, H * a.v_head_dim)))]
    return out


def tensor_refs(spec):
    D = spec.hidden_size
    out = embed_and_head(spec)
    for i, lay in enumerate(spec.layers):
        p = f"model.layers.{i}"
        out += norm_refs(i, D) + mla_refs(i, lay.attn, D, f"{p}.self_attn")
        if lay.mlp is not None:
            out += mlp_refs(i, "mlp", lay.mlp, D, f"{p}.mlp")
        else:
            m = lay.moe
            out.append(ref(canonical(i, "moe.router"), L(f"{p}.mlp.gate.weight", (m.num_experts, D))))
            if m.score_correction_bias:
                out.append(ref(canonical(i, "moe.score_bias"), L(f"{p}.mlp.gate.e_score_correction_bias", (m.num_experts,))))
            out += expert_refs(i, m, D, f"{p}.mlp.experts")
            if m.shared_intermediate_size:
                out += mlp_refs(i, "moe.shared", MLPSpec(m.shared_intermediate_size), D, f"{p}.mlp.shared_experts")
    return out


def ignore(spec):
    """Multi-token-prediction layers (index >= num_hidden_layers) ship in V3 checkpoints; decode does not use them."""
    n = spec.num_layers
    pat = re.compile(r"model\.layers\.(\d+)\.")
    return lambda name: bool((m := pat.match(name)) and int(m.group(1)) >= n)

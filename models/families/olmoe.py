"""OLMoE: RMSNorm over the whole q and k projections (not per head), optional clip_qkv, softmax router without
renormalisation by default."""
from ..spec import LayerSpec, MoESpec
from .common import Cfg, base_spec, dense_family_refs, gqa_attention
from .qwen3_moe import moe_refs

MODEL_TYPES = ("olmoe",)


def build_spec(cfg: Cfg):
    n = cfg.positive("num_hidden_layers")
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_attention(cfg, qkv_bias=bias, o_bias=bias, qk_norm="full")
    moe = MoESpec(num_experts=cfg.positive("num_experts"), top_k=cfg.positive("num_experts_per_tok"),
                  intermediate_size=cfg.positive("intermediate_size"), scoring="softmax",
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
    return base_spec(cfg, "olmoe", [LayerSpec(attn=attn, moe=moe) for _ in range(n)], 1e-5)


def tensor_refs(spec):
    return dense_family_refs(spec) + moe_refs(spec)

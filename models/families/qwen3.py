"""Qwen3 dense: Llama plus per-head RMSNorm on q and k (over head_dim, before RoPE), optional sliding window."""
from ..spec import LayerSpec
from .common import Cfg, base_spec, dense_family_refs, gqa_attention, layer_windows, mlp_spec

MODEL_TYPES = ("qwen3",)


def build_spec(cfg: Cfg):
    n = cfg.positive("num_hidden_layers")
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_attention(cfg, qkv_bias=bias, o_bias=bias, qk_norm="head")
    mlp = mlp_spec(cfg)
    # HF: sliding window only with use_sliding_window, on layers >= max_window_layers
    default = None
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        mwl = cfg.get("max_window_layers", 28)
        default = ["sliding_attention" if i >= mwl else "full_attention" for i in range(n)]
    wins = layer_windows(cfg, n, default) if cfg.get("use_sliding_window") else [None] * n
    return base_spec(cfg, "qwen3", [LayerSpec(attn=attn, mlp=mlp, sliding_window=w) for w in wins])


def tensor_refs(spec):
    return dense_family_refs(spec)

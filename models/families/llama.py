"""Llama (1/2/3.x): GQA, rotate-half RoPE with llama3 / linear scaling, optional attention and MLP biases."""
from ..spec import LayerSpec
from .common import Cfg, base_spec, dense_family_refs, gqa_attention, mlp_spec

MODEL_TYPES = ("llama",)


def build_spec(cfg: Cfg):
    n = cfg.positive("num_hidden_layers")
    bias = bool(cfg.get("attention_bias", False))
    attn = gqa_attention(cfg, qkv_bias=bias, o_bias=bias)
    mlp = mlp_spec(cfg, bias=bool(cfg.get("mlp_bias", False)))
    return base_spec(cfg, "llama", [LayerSpec(attn=attn, mlp=mlp) for _ in range(n)])


def tensor_refs(spec):
    return dense_family_refs(spec)

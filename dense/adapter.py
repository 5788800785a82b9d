"""Laneformer family adapter (registered in models/registry.py's EXTERNAL_FAMILIES as `kie_moe.dense.adapter`).

Same shape as a models/families adapter: MODEL_TYPES, build_spec(cfg) -> LaneformerSpec, tensor_refs(spec) ->
TensorRefs for the WeightStore; plus reference_decoder(...) (the oracle backend of this family) and
linear_weights / fused_partners for the converter.

Canonical names (what backends ask the WeightStore for); lane tensors keep their lane axis first:

    embed [V, D]                     <- model.tok_embeddings.weight
    final_norm [D] | [L, D]          <- model.norm.weight (shared) | model.norm.scale (per lane)
    lm_head [V, D]                   <- lm_head.weight (absent when tie_word_embeddings)
    layers.{i}.attn_norm / mlp_norm  <- model.layers.{i}.attention_norm / ffn_norm .weight [D] | .scale [L, D]
    layers.{i}.attn.q [L, Hq*Dh/L, D], .k / .v [L, Hkv*Dh/L, D], .o [L, D, Hq*Dh/L]
                                     <- model.layers.{i}.attention.{wq,wk,wv,wo}.weight
    layers.{i}.mlp.gate / .up [L, I/L, D], .down [L, D, I/L]
                                     <- model.layers.{i}.feed_forward.{w1,w3,w2}.weight

With pre_norm_lane_agg the final norm sees the sum of the lanes (one stream), so model.norm is [D] under either
name; every other norm follows replicated_rmsn_scale.
"""
from __future__ import annotations

from kie_moe.models.families.common import Cfg, L as lay, ref
from kie_moe.models.loader import TensorRef
from kie_moe.models.spec import canonical

from .config import LaneformerSpec, spec_from_cfg

MODEL_TYPES = ("laneformer",)

# canonical suffix -> (HF module under model.layers.{i}, HF short name)
_ATTN = (("attn.q", "attention.wq"), ("attn.k", "attention.wk"), ("attn.v", "attention.wv"), ("attn.o", "attention.wo"))
_FFN = (("mlp.gate", "feed_forward.w1"), ("mlp.up", "feed_forward.w3"), ("mlp.down", "feed_forward.w2"))
_NORMS = (("attn_norm", "attention_norm"), ("mlp_norm", "ffn_norm"))


def build_spec(cfg: Cfg) -> LaneformerSpec:
    return spec_from_cfg(cfg)


def lane_shapes(spec: LaneformerSpec) -> dict[str, tuple[int, ...]]:
    """Canonical per-layer suffix -> shape of the lane tensor (input projections [L, out/L, D], outputs
    [L, D, in/L])."""
    Lc, D, Dh = spec.num_lanes, spec.hidden_size, spec.head_dim
    q, kv, f = spec.lane_q_heads * Dh, spec.lane_kv_heads * Dh, spec.lane_ffn
    return {"attn.q": (Lc, q, D), "attn.k": (Lc, kv, D), "attn.v": (Lc, kv, D), "attn.o": (Lc, D, q),
            "mlp.gate": (Lc, f, D), "mlp.up": (Lc, f, D), "mlp.down": (Lc, D, f)}


def _norm_layout(spec: LaneformerSpec, hf_prefix: str):
    if spec.replicated_rmsn_scale:
        return (lay(f"{hf_prefix}.weight", (spec.hidden_size,)),)
    return (lay(f"{hf_prefix}.scale", (spec.num_lanes, spec.hidden_size)),)


def tensor_refs(spec: LaneformerSpec) -> list[TensorRef]:
    V, D = spec.vocab_size, spec.hidden_size
    if spec.pre_norm_lane_agg:
        names = ("weight", "scale") if spec.replicated_rmsn_scale else ("scale", "weight")
        final = tuple(lay(f"model.norm.{n}", (D,)) for n in names)
    else:
        final = _norm_layout(spec, "model.norm")
    out = [ref("embed", lay("model.tok_embeddings.weight", (V, D))),
           ref("final_norm", *final),
           ref("lm_head", lay("lm_head.weight", (V, D)), optional=spec.tie_word_embeddings)]
    shapes = lane_shapes(spec)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        for cname, hf in _NORMS:
            out.append(ref(canonical(i, cname), *_norm_layout(spec, f"{p}.{hf}")))
        for cname, hf in _ATTN + _FFN:
            out.append(ref(canonical(i, cname), lay(f"{p}.{hf}.weight", shapes[cname])))
    return out


def linear_weights(spec: LaneformerSpec) -> list[str]:
    """HF names of the Linear weights a quantizer may convert: every lane tensor, 3-D like stacked experts
    ([L, out/L, D] for wq/wk/wv/w1/w3, [L, D, in/L] for wo/w2; each lane slice is an [out, in] matrix).
    Embeddings, norms and lm_head stay in bf16 (DESIGN.md §4)."""
    return [f"model.layers.{i}.{hf}.weight" for i in range(spec.num_layers) for _, hf in _ATTN + _FFN]


def fused_partners(spec: LaneformerSpec) -> list[tuple[str, ...]]:
    """Groups that read the same input and so share an nvfp4 global scale: (wq, wk, wv) and (w1, w3)."""
    out = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        out.append(tuple(f"{p}.attention.{w}.weight" for w in ("wq", "wk", "wv")))
        out.append(tuple(f"{p}.feed_forward.{w}.weight" for w in ("w1", "w3")))
    return out


def reference_decoder(spec: LaneformerSpec, weights, device="cpu", dtype=None):
    """The oracle: forward(ids [S] int64) -> logits [S, V] float32, KV cache per lane; reset()."""
    from .reference import LaneformerDecoder
    return LaneformerDecoder(spec, weights, device, dtype)

"""Mixtral: Llama attention with an optional sliding window on every layer; softmax router, top-2, always
renormalised; experts w1 (gate), w3 (up), w2 (down) under block_sparse_moe (or mlp in newer exports)."""
from ..spec import LayerSpec, MoESpec, canonical
from .common import Cfg, L, base_spec, dense_family_refs, gqa_attention, ref
from ..loader import TensorRef

MODEL_TYPES = ("mixtral",)


def build_spec(cfg: Cfg):
    n = cfg.positive("num_hidden_layers")
    attn = gqa_attention(cfg)
    moe = MoESpec(num_experts=cfg.positive("num_local_experts"), top_k=cfg.positive("num_experts_per_tok"),
                  intermediate_size=cfg.positive("intermediate_size"), scoring="softmax", norm_topk_prob=True)
    win = cfg.get("sliding_window")
    return base_spec(cfg, "mixtral", [LayerSpec(attn=attn, moe=moe, sliding_window=win) for _ in range(n)], 1e-5)


def tensor_refs(spec):
    out = dense_family_refs(spec)
    D = spec.hidden_size
    for i, lay in enumerate(spec.layers):
        E, I = lay.moe.num_experts, lay.moe.intermediate_size
        p = f"model.layers.{i}"
        out.append(ref(canonical(i, "moe.router"), L(f"{p}.block_sparse_moe.gate.weight", (E, D)),
                       L(f"{p}.mlp.gate.weight", (E, D))))
        for e in range(E):
            def alts(w, shape, fused):
                lays = [L(f"{p}.{blk}.experts.{e}.{w}.weight", shape) for blk in ("block_sparse_moe", "mlp")]
                return tuple(lays) + (fused,)
            c = lambda n: canonical(i, f"moe.experts.{e}.{n}")
            out += [TensorRef(c("gate"), alts("w1", (I, D), L(f"{p}.mlp.experts.gate_up_proj", (E, 2 * I, D), take=(e,), rows=(0, I)))),
                    TensorRef(c("up"), alts("w3", (I, D), L(f"{p}.mlp.experts.gate_up_proj", (E, 2 * I, D), take=(e,), rows=(I, 2 * I)))),
                    TensorRef(c("down"), alts("w2", (D, I), L(f"{p}.mlp.experts.down_proj", (E, D, I), take=(e,))))]
    return out

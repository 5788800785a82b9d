"""gpt-oss: GQA with q/k/v/o biases and one learned sink logit per head, sliding window on alternate layers
(`layer_types`), YaRN RoPE (rotate-half), router with bias and softmax over the top-k logits, experts stored
fused as [E, in, out] with gate/up interleaved (gate = even columns), clamped GLU:
    gate = min(gate, limit); up = clamp(up, -limit, limit); out = (up + 1) * gate * sigmoid(1.702 * gate)."""

from ..spec import LayerSpec, MoESpec, canonical
from .common import Cfg, L, base_spec, dense_family_refs, gqa_attention, layer_windows, ref

MODEL_TYPES = ("gpt_oss",)


def build_spec(cfg: Cfg):
    n = cfg.positive("num_hidden_layers")
    attn = gqa_attention(cfg, qkv_bias=bool(cfg.get("attention_bias", True)),
                         o_bias=bool(cfg.get("attention_bias", True)), sinks=True)
    moe = MoESpec(num_experts=cfg.positive("num_local_experts"), top_k=cfg.positive("num_experts_per_tok"),
                  intermediate_size=cfg.positive("intermediate_size"), scoring="softmax_topk", router_bias=True,
                  expert_act="gptoss_glu", expert_bias=True, swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    default = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    wins = layer_windows(cfg, n, default)
    return base_spec(cfg, "gpt_oss", [LayerSpec(attn=attn, moe=moe, sliding_window=w) for w in wins], 1e-5)


def tensor_refs(spec):
    out = dense_family_refs(spec)
    D = spec.hidden_size
    for i, lay in enumerate(spec.layers):
        E, I = lay.moe.num_experts, lay.moe.intermediate_size
        p = f"model.layers.{i}.mlp"
        out += [ref(canonical(i, "moe.router"), L(f"{p}.router.weight", (E, D))),
                ref(canonical(i, "moe.router_bias"), L(f"{p}.router.bias", (E,)))]
        gu, gub = (f"{p}.experts.gate_up_proj", (E, D, 2 * I)), (f"{p}.experts.gate_up_proj_bias", (E, 2 * I))
        dn, dnb = (f"{p}.experts.down_proj", (E, I, D)), (f"{p}.experts.down_proj_bias", (E, D))
        for e in range(E):
            c = lambda n: canonical(i, f"moe.experts.{e}.{n}")
            out += [ref(c("gate"), L(*gu, take=(e,), transpose=True, rows="even")),
                    ref(c("up"), L(*gu, take=(e,), transpose=True, rows="odd")),
                    ref(c("down"), L(*dn, take=(e,), transpose=True)),
                    ref(c("gate_bias"), L(*gub, take=(e,), rows="even")),
                    ref(c("up_bias"), L(*gub, take=(e,), rows="odd")),
                    ref(c("down_bias"), L(*dnb, take=(e,)))]
    return out

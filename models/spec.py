"""ModelSpec: everything a backend needs to know about an architecture, as frozen dataclasses.

Adapters (models/families/*.py) build a ModelSpec from config.json; backends never look at config.json or at HF
transformers. Canonical tensor names (see `canonical` below) are the contract between the loader and backends:
every Linear weight is [out, in], routed experts are per expert.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeSpec:
    theta: float = 10000.0
    rotary_dim: int = 0               # dims rotated per head (partial rotary < head_dim)
    style: str = "half"               # "half": rotate-half (Llama); "pair": adjacent pairs (complex form)
    scaling: str = "default"          # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position: int = 0
    low_freq_factor: float = 1.0      # llama3
    high_freq_factor: float = 4.0     # llama3
    beta_fast: float = 32.0           # yarn
    beta_slow: float = 1.0            # yarn
    mscale: float = 0.0               # yarn (DeepSeek)
    mscale_all_dim: float = 0.0       # yarn (DeepSeek)
    attention_factor: float | None = None  # yarn: explicit cos/sin multiplier
    truncate: bool = True             # yarn: round the correction range


@dataclass(frozen=True)
class AttentionSpec:
    kind: str                         # "gqa" | "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int                     # gqa: q/k/v head dim; mla: qk_nope + qk_rope
    rope: RopeSpec
    softmax_scale: float
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None        # None | "head" (Qwen3: RMSNorm over head_dim) | "full" (OLMoE: whole projection)
    clip_qkv: float | None = None     # OLMoE
    sinks: bool = False               # gpt-oss: one learned logit per head joins the softmax
    # MLA (DeepSeek-V2/V3)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def o_in(self) -> int:
        return self.num_heads * (self.v_head_dim if self.kind == "mla" else self.head_dim)


@dataclass(frozen=True)
class MLPSpec:
    """Dense SwiGLU MLP: down(act(gate(x)) * up(x))."""
    intermediate_size: int
    act: str = "silu"
    bias: bool = False


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int            # per routed expert
    scoring: str = "softmax"          # softmax | sigmoid | softmax_topk (softmax over the top-k logits: gpt-oss)
    norm_topk_prob: bool = False      # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float = 1.0
    n_group: int = 1                  # group-limited routing (DeepSeek)
    topk_group: int = 1
    group_score: str = "max"          # "max" (V2 group_limited_greedy) | "top2sum" (V3)
    score_correction_bias: bool = False  # V3: bias added for the choice only
    router_bias: bool = False         # gpt-oss
    expert_act: str = "swiglu"        # swiglu | gptoss_glu (clamped, (up + 1) * gate * sigmoid(alpha * gate))
    expert_bias: bool = False
    swiglu_limit: float = 7.0
    glu_alpha: float = 1.702
    shared_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # Qwen2-MoE: sigmoid(gate(x)) scales the shared expert


@dataclass(frozen=True)
class LayerSpec:
    attn: AttentionSpec
    mlp: MLPSpec | None = None
    moe: MoESpec | None = None
    sliding_window: int | None = None  # key j visible from query i iff i - window < j <= i

    @property
    def is_moe(self) -> bool:
        return self.moe is not None


@dataclass(frozen=True)
class ModelSpec:
    family: str                       # adapter name (== model_type)
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    norm_eps: float
    max_position: int
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"     # dtype of the checkpoint's floating weights
    extra: tuple[tuple[str, object], ...] = field(default=())  # family-specific facts, hashable

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def canonical(i: int | None, name: str) -> str:
    """`layers.{i}.{name}` or a top-level name. Names used by backends:

    top level: embed [V, D], final_norm [D], lm_head [V, D] (absent when tied)
    per layer: attn_norm [D], mlp_norm [D]
      gqa: attn.q [Hq*Dh, D], attn.k/.v [Hkv*Dh, D], attn.o [D, Hq*Dh], attn.{q,k,v,o}_bias,
           attn.q_norm / attn.k_norm ([Dh] or the whole projection), attn.sinks [Hq]
      mla: attn.q [H*(nope+rope), D] or attn.q_a [r_q, D] + attn.q_a_norm [r_q] + attn.q_b [H*(nope+rope), r_q];
           attn.kv_a [r_kv + rope, D], attn.kv_a_norm [r_kv], attn.kv_b [H*(nope+v), r_kv], attn.o [D, H*v]
      dense mlp: mlp.gate / mlp.up [I, D], mlp.down [D, I]
      moe: moe.router [E, D] (+ moe.router_bias [E], moe.score_bias [E]),
           moe.experts.{e}.gate / .up [I, D], .down [D, I] (+ .gate_bias/.up_bias [I], .down_bias [D]),
           moe.shared.gate / .up / .down, moe.shared_gate [1, D]
    """
    return name if i is None else f"layers.{i}.{name}"

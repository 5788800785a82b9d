"""LaneformerSpec: the dense Laneformer architecture (DESIGN.md §5) as one frozen dataclass built from config.json.

Laneformer is a Llama-style decoder whose residual stream carries a lane axis, [B, S, L, D]: every lane is a
full-width copy of the hidden state. Input projections are stored per lane, [L, out/L, D]; output projections
[L, D, in/L]. How a lane folds the partial outputs of the lanes back into its stream depends on the layer
(`reduce_mode`); everything a backend needs to decide that is a field here, so no backend reads config.json.

The fields the CLI reads on a ModelSpec (family, vocab_size, hidden_size, num_layers, max_position,
eos_token_ids, bos_token_id, tie_word_embeddings, torch_dtype) have the same names and meanings here, and
`layers` gives the per-layer LayerSpec view (total heads, FFN size, window) for byte and KV-cache accounting.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kie_moe.models.errors import ConfigError
from kie_moe.models.families.common import Cfg, eos_ids
from kie_moe.models.rope import rope_from_config
from kie_moe.models.spec import AttentionSpec, LayerSpec, MLPSpec, RopeSpec

MODEL_TYPE = "laneformer"
LM_HEAD_TYPES = ("replicate",)      # one [V, D] head shared by every lane (the only published type)

# What layer i does with its partials, per sublayer (attention and FFN alike):
ALL = "all"            # early all-reduce: every lane adds sum_m p_m(i)            (i < d, use_early_comm)
SCALED = "scaled"      # no communication: lane l adds sqrt(L) * p_l(i)            (i < d without early comm,
                       #                                                             or i >= d without use_comm)
DELAYED = "delayed"    # lane l adds p_l(i) + sum_{m != l} p_m(i - d)               (i >= d, use_comm)


@dataclass(frozen=True)
class LaneformerSpec:
    family: str                       # always "laneformer"
    vocab_size: int
    hidden_size: int                  # D: width of every lane's copy of the residual stream
    intermediate_size: int            # FFN width summed over lanes (a lane owns intermediate_size / L)
    num_layers: int
    num_heads: int                    # query heads summed over lanes (lane-major: lane l owns Hq/L of them)
    num_kv_heads: int                 # kv heads summed over lanes (lane l owns Hkv/L)
    head_dim: int                     # hidden_size / num_heads (the public layout has no head_dim field)
    num_lanes: int                    # L
    broadcast_delay: int              # d: a partial of layer i reaches the other lanes at layer i + d
    use_comm: bool
    use_early_comm: bool
    replicated_rmsn_scale: bool       # True: norms are one `weight` [D]; False: a `scale` [L, D] per lane
    pre_norm_lane_agg: bool           # final: True = sum lanes, then norm; False = norm each lane, average
    lm_head_type: str
    windows: tuple[int | None, ...]   # per layer; key j visible from query i iff i - window < j <= i
    rope: RopeSpec                    # style "pair" (adjacent pairs, complex form)
    norm_eps: float
    max_position: int
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"

    # ---- derived sizes ---------------------------------------------------------------------------------
    @property
    def lane_q_heads(self) -> int:
        return self.num_heads // self.num_lanes

    @property
    def lane_kv_heads(self) -> int:
        return self.num_kv_heads // self.num_lanes

    @property
    def lane_ffn(self) -> int:
        return self.intermediate_size // self.num_lanes

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def lane_scale(self) -> float:
        """sqrt(L): multiplies a lane's own partial when it hears from nobody (mode SCALED)."""
        return math.sqrt(self.num_lanes)

    def reduce_mode(self, i: int) -> str:
        """ALL / SCALED / DELAYED for layer i (the same for its attention and its FFN sublayer)."""
        if i < self.broadcast_delay:
            return ALL if self.use_early_comm else SCALED
        return DELAYED if self.use_comm else SCALED

    def consumers(self, i: int) -> tuple[int, ...]:
        """Layers whose same-kind sublayer reads the other lanes' partials of layer i (i itself when ALL, i + d
        when that layer is DELAYED). Partials of the last d layers reach no one: lanes stay distinct to the end,
        which is why the final norm aggregates them."""
        out = []
        if self.reduce_mode(i) == ALL:
            out.append(i)
        j = i + self.broadcast_delay
        if j < self.num_layers and self.reduce_mode(j) == DELAYED and j not in out:
            out.append(j)
        return tuple(out)

    @property
    def layers(self) -> tuple[LayerSpec, ...]:
        """ModelSpec-style view: totals over lanes (parameter and KV-cache sizes equal a Llama of that shape)."""
        attn = AttentionSpec(kind="gqa", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim, rope=self.rope, softmax_scale=self.softmax_scale)
        mlp = MLPSpec(intermediate_size=self.intermediate_size)
        return tuple(LayerSpec(attn=attn, mlp=mlp, sliding_window=w) for w in self.windows)

    @property
    def num_params(self) -> int:
        D, V = self.hidden_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        norm = D if self.replicated_rmsn_scale else self.num_lanes * D
        final = D if (self.replicated_rmsn_scale or self.pre_norm_lane_agg) else self.num_lanes * D
        per_layer = D * (2 * q + 2 * kv) + 3 * D * self.intermediate_size + 2 * norm
        return self.num_layers * per_layer + V * D * (1 if self.tie_word_embeddings else 2) + final


def _flag(cfg: Cfg, key: str, default: bool) -> bool:
    v = cfg.d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ConfigError(f"{cfg.path}: field {key!r} must be true or false, got {v!r}")
    return v


def _lane_divides(cfg: Cfg, key: str, lanes: int) -> int:
    v = cfg.positive(key)
    if v % lanes:
        raise ConfigError(f"{cfg.path}: {key}={v} is not divisible by num_lanes={lanes} "
                          f"(every lane owns an equal share)")
    return v


def layer_windows(cfg: Cfg, n: int) -> tuple[int | None, ...]:
    """sliding_window on the first `sliding_window_n_layers` layers (negative: the last |n|), minus
    `unclamped_layers`. Absent sliding_window_n_layers with a window set means every layer; 0 means none."""
    win = cfg.get("sliding_window", None, int)
    nl = cfg.d.get("sliding_window_n_layers")
    if nl is not None and (isinstance(nl, bool) or not isinstance(nl, int)):
        raise ConfigError(f"{cfg.path}: field 'sliding_window_n_layers' must be an integer, got {nl!r}")
    if nl is not None and abs(nl) > n:
        raise ConfigError(f"{cfg.path}: sliding_window_n_layers={nl} but the model has num_hidden_layers={n}")
    unclamped = cfg.d.get("unclamped_layers") or []
    if not isinstance(unclamped, list) or any(isinstance(u, bool) or not isinstance(u, int) for u in unclamped):
        raise ConfigError(f"{cfg.path}: field 'unclamped_layers' must be a list of layer indices, got {unclamped!r}")
    bad = [u for u in unclamped if not -n <= u < n]
    if bad:
        raise ConfigError(f"{cfg.path}: unclamped_layers {bad} out of range for num_hidden_layers={n}")
    free = {u % n for u in unclamped}
    if not win:
        return (None,) * n
    if nl is None:
        clamped = set(range(n))
    elif nl >= 0:
        clamped = set(range(nl))
    else:
        clamped = set(range(n + nl, n))
    return tuple(win if i in clamped and i not in free else None for i in range(n))


def spec_from_cfg(cfg: Cfg) -> LaneformerSpec:
    mt = cfg.d.get("model_type")
    if mt != MODEL_TYPE:
        raise ConfigError(f"{cfg.path}: model_type {mt!r} is not {MODEL_TYPE!r}")
    L = cfg.positive("num_lanes")
    n = cfg.positive("num_hidden_layers")
    D = _lane_divides(cfg, "hidden_size", L)
    inter = _lane_divides(cfg, "intermediate_size", L)
    heads = _lane_divides(cfg, "num_attention_heads", L)
    kv = _lane_divides(cfg, "num_key_value_heads", L) if cfg.d.get("num_key_value_heads") is not None else heads
    if heads % kv:
        raise ConfigError(f"{cfg.path}: num_attention_heads={heads} is not divisible by num_key_value_heads={kv}")
    if D % heads:
        raise ConfigError(f"{cfg.path}: hidden_size={D} is not divisible by num_attention_heads={heads} "
                          f"(head_dim = hidden_size / num_attention_heads)")
    head_dim = D // heads
    if cfg.d.get("head_dim") is not None and cfg.d["head_dim"] != head_dim:
        raise ConfigError(f"{cfg.path}: head_dim={cfg.d['head_dim']} but Laneformer uses hidden_size / "
                          f"num_attention_heads = {head_dim}")
    if head_dim % 2:
        raise ConfigError(f"{cfg.path}: head_dim={head_dim} (hidden_size / num_attention_heads) must be even for RoPE")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{cfg.path}: hidden_act {act!r} is not supported (silu)")
    head_type = cfg.get("lm_head_type", "replicate")
    if head_type not in LM_HEAD_TYPES:
        raise ConfigError(f"{cfg.path}: lm_head_type {head_type!r} is not supported ({', '.join(LM_HEAD_TYPES)})")
    eps = cfg.d.get("norm_eps", cfg.d.get("rms_norm_eps", 1e-5))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ConfigError(f"{cfg.path}: field 'norm_eps' must be a positive number, got {eps!r}")
    try:
        rope = rope_from_config(cfg.d, head_dim, "pair")
    except ValueError as e:
        raise ConfigError(f"{cfg.path}: {str(e).removeprefix('config.json: ')}") from None
    if rope.theta <= 0:
        raise ConfigError(f"{cfg.path}: field 'rope_theta' must be positive, got {rope.theta}")
    return LaneformerSpec(
        family=MODEL_TYPE, vocab_size=cfg.positive("vocab_size"), hidden_size=D, intermediate_size=inter,
        num_layers=n, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, num_lanes=L,
        broadcast_delay=cfg.req("broadcast_delay", int),
        use_comm=_flag(cfg, "use_comm", True), use_early_comm=_flag(cfg, "use_early_comm", True),
        replicated_rmsn_scale=_flag(cfg, "replicated_rmsn_scale", False),
        pre_norm_lane_agg=_flag(cfg, "pre_norm_lane_agg", False), lm_head_type=head_type,
        windows=layer_windows(cfg, n), rope=rope, norm_eps=float(eps),
        max_position=cfg.get("max_position_embeddings", 4096, int),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", False),
        bos_token_id=cfg.get("bos_token_id", None, int), eos_token_ids=eos_ids(cfg),
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"))

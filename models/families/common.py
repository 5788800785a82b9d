"""Shared pieces of the family adapters: config access with field-named errors, and the HF tensor layouts that
most Llama-descended families share."""
from __future__ import annotations

from ..errors import ConfigError
from ..loader import Layout, TensorRef
from ..rope import rope_from_config
from ..spec import AttentionSpec, MLPSpec, MoESpec, canonical


class Cfg:
    """config.json as a dict, with errors that name the field."""

    def __init__(self, d: dict, path: str = "config.json"):
        self.d, self.path = d, path

    def req(self, key: str, kind=int):
        if key not in self.d or self.d[key] is None:
            raise ConfigError(f"{self.path}: required field {key!r} is missing")
        return self._check(key, self.d[key], kind)

    def get(self, key: str, default=None, kind=None):
        v = self.d.get(key)
        if v is None:
            return default
        return self._check(key, v, kind) if kind else v

    def _check(self, key, v, kind):
        if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise ConfigError(f"{self.path}: field {key!r} must be an integer, got {v!r}")
        if kind is float and not isinstance(v, (int, float)):
            raise ConfigError(f"{self.path}: field {key!r} must be a number, got {v!r}")
        if kind is int and v < 0:
            raise ConfigError(f"{self.path}: field {key!r} must be >= 0, got {v}")
        return v

    def positive(self, key: str) -> int:
        v = self.req(key, int)
        if v <= 0:
            raise ConfigError(f"{self.path}: field {key!r} must be positive, got {v}")
        return v

    def divides(self, num_key: str, den_key: str):
        n, d = self.positive(num_key), self.positive(den_key)
        if n % d:
            raise ConfigError(f"{self.path}: {num_key}={n} is not divisible by {den_key}={d}")


def eos_ids(cfg: Cfg) -> tuple[int, ...]:
    e = cfg.get("eos_token_id")
    if e is None:
        return ()
    return tuple(e) if isinstance(e, list) else (int(e),)


def layer_windows(cfg: Cfg, n_layers: int, default_kinds: list[str] | None = None) -> list[int | None]:
    """Per-layer sliding window from `layer_types` (v5) or a family default; None = full attention."""
    kinds = cfg.get("layer_types") or default_kinds or ["full_attention"] * n_layers
    if len(kinds) != n_layers:
        raise ConfigError(f"{cfg.path}: layer_types has {len(kinds)} entries for {n_layers} layers")
    win = cfg.get("sliding_window")
    out = []
    for k in kinds:
        if k == "sliding_attention" and win:
            out.append(int(win))
        elif k in ("full_attention", "sliding_attention"):
            out.append(None)
        else:
            raise ConfigError(f"{cfg.path}: layer_types entry {k!r} is not supported")
    return out


def gqa_attention(cfg: Cfg, *, qkv_bias=False, o_bias=False, qk_norm=None, sinks=False, rope_style="half") -> AttentionSpec:
    hidden = cfg.positive("hidden_size")
    heads = cfg.positive("num_attention_heads")
    kv = cfg.get("num_key_value_heads", heads, int)
    if heads % kv:
        raise ConfigError(f"{cfg.path}: num_attention_heads={heads} is not divisible by num_key_value_heads={kv}")
    head_dim = cfg.get("head_dim", None, int)
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"{cfg.path}: hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        head_dim = hidden // heads
    rotary = int(head_dim * float(cfg.get("partial_rotary_factor", 1.0)))
    rope = rope_from_config(cfg.d, rotary, rope_style)
    return AttentionSpec(kind="gqa", num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rope=rope,
                         softmax_scale=head_dim ** -0.5, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,
                         clip_qkv=cfg.get("clip_qkv"), sinks=sinks)


def L(hf: str, shape, **kw) -> Layout:
    return Layout(hf, tuple(int(s) for s in shape), **kw)


def ref(name: str, *layouts: Layout, optional=False) -> TensorRef:
    return TensorRef(name, tuple(layouts), optional)


def embed_and_head(spec) -> list[TensorRef]:
    V, D = spec.vocab_size, spec.hidden_size
    return [ref("embed", L("model.embed_tokens.weight", (V, D))),
            ref("final_norm", L("model.norm.weight", (D,))),
            ref("lm_head", L("lm_head.weight", (V, D)), optional=spec.tie_word_embeddings)]


def gqa_refs(i: int, a: AttentionSpec, D: int, p: str) -> list[TensorRef]:
    """Llama-style attention of layer i; p = HF prefix `model.layers.{i}.self_attn`."""
    c = lambda n: canonical(i, n)
    out = [ref(c("attn.q"), L(f"{p}.q_proj.weight", (a.q_size, D))),
           ref(c("attn.k"), L(f"{p}.k_proj.weight", (a.kv_size, D))),
           ref(c("attn.v"), L(f"{p}.v_proj.weight", (a.kv_size, D))),
           ref(c("attn.o"), L(f"{p}.o_proj.weight", (D, a.o_in)))]
    if a.qkv_bias:
        out += [ref(c("attn.q_bias"), L(f"{p}.q_proj.bias", (a.q_size,))),
                ref(c("attn.k_bias"), L(f"{p}.k_proj.bias", (a.kv_size,))),
                ref(c("attn.v_bias"), L(f"{p}.v_proj.bias", (a.kv_size,)))]
    if a.o_bias:
        out.append(ref(c("attn.o_bias"), L(f"{p}.o_proj.bias", (D,))))
    if a.qk_norm == "head":
        out += [ref(c("attn.q_norm"), L(f"{p}.q_norm.weight", (a.head_dim,))),
                ref(c("attn.k_norm"), L(f"{p}.k_norm.weight", (a.head_dim,)))]
    elif a.qk_norm == "full":
        out += [ref(c("attn.q_norm"), L(f"{p}.q_norm.weight", (a.q_size,))),
                ref(c("attn.k_norm"), L(f"{p}.k_norm.weight", (a.kv_size,)))]
    if a.sinks:
        out.append(ref(c("attn.sinks"), L(f"{p}.sinks", (a.num_heads,))))
    return out


def norm_refs(i: int, D: int) -> list[TensorRef]:
    p = f"model.layers.{i}"
    return [ref(canonical(i, "attn_norm"), L(f"{p}.input_layernorm.weight", (D,))),
            ref(canonical(i, "mlp_norm"), L(f"{p}.post_attention_layernorm.weight", (D,)))]


def mlp_refs(i: int, name: str, m: MLPSpec, D: int, p: str, names=("gate_proj", "up_proj", "down_proj")) -> list[TensorRef]:
    """SwiGLU MLP; `name` is the canonical prefix (mlp or moe.shared), p the HF prefix."""
    I = m.intermediate_size
    g, u, d = names
    out = [ref(canonical(i, f"{name}.gate"), L(f"{p}.{g}.weight", (I, D))),
           ref(canonical(i, f"{name}.up"), L(f"{p}.{u}.weight", (I, D))),
           ref(canonical(i, f"{name}.down"), L(f"{p}.{d}.weight", (D, I)))]
    if m.bias:
        out += [ref(canonical(i, f"{name}.gate_bias"), L(f"{p}.{g}.bias", (I,))),
                ref(canonical(i, f"{name}.up_bias"), L(f"{p}.{u}.bias", (I,))),
                ref(canonical(i, f"{name}.down_bias"), L(f"{p}.{d}.bias", (D,)))]
    return out


def expert_refs(i: int, moe: MoESpec, D: int, p: str, names=("gate_proj", "up_proj", "down_proj")) -> list[TensorRef]:
    """Routed experts stored per expert (`{p}.{e}.gate_proj.weight`) or fused as transformers v5 keeps them in
    memory (`{p}.gate_up_proj` [E, 2I, D] with gate rows first, `{p}.down_proj` [E, D, I])."""
    E, I = moe.num_experts, moe.intermediate_size
    g, u, d = names
    out = []
    for e in range(E):
        c = lambda n: canonical(i, f"moe.experts.{e}.{n}")
        out += [ref(c("gate"), L(f"{p}.{e}.{g}.weight", (I, D)), L(f"{p}.gate_up_proj", (E, 2 * I, D), take=(e,), rows=(0, I))),
                ref(c("up"), L(f"{p}.{e}.{u}.weight", (I, D)), L(f"{p}.gate_up_proj", (E, 2 * I, D), take=(e,), rows=(I, 2 * I))),
                ref(c("down"), L(f"{p}.{e}.{d}.weight", (D, I)), L(f"{p}.down_proj", (E, D, I), take=(e,)))]
    return out


def mlp_spec(cfg: Cfg, size_key="intermediate_size", bias=False) -> MLPSpec:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{cfg.path}: hidden_act {act!r} is not supported (silu)")
    return MLPSpec(intermediate_size=cfg.positive(size_key), act="silu", bias=bias)


def rms_eps(cfg: Cfg, default=1e-6) -> float:
    return float(cfg.get("rms_norm_eps", default))


def base_spec(cfg: Cfg, family: str, layers: list, eps_default=1e-6):
    from ..spec import ModelSpec
    return ModelSpec(
        family=family, vocab_size=cfg.positive("vocab_size"), hidden_size=cfg.positive("hidden_size"),
        layers=tuple(layers), norm_eps=rms_eps(cfg, eps_default),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids(cfg),
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"))


def dense_family_refs(spec, attn_prefix="self_attn", mlp_prefix="mlp") -> list[TensorRef]:
    """Embeddings, norms, attention and dense MLPs of every layer (MoE layers add their own)."""
    D = spec.hidden_size
    out = embed_and_head(spec)
    for i, lay in enumerate(spec.layers):
        out += norm_refs(i, D) + gqa_refs(i, lay.attn, D, f"model.layers.{i}.{attn_prefix}")
        if lay.mlp is not None:
            out += mlp_refs(i, "mlp", lay.mlp, D, f"model.layers.{i}.{mlp_prefix}")
    return out

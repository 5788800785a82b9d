"""Presets: the config.json of real checkpoints (shapes only, no weights), and a tiny variant of each.

`PRESETS[name]` is the published config.json of that model, with the field names its family uses on the Hub
(v4-style `rope_theta` + `rope_scaling`, which both transformers v5 and models/rope.py read). Three deliberate
differences from the files on the Hub, because a synthetic checkpoint is written in plain bf16 by
models/synth.py and must load without remote code:
  - no `quantization_config` (gpt-oss ships MXFP4 experts, DeepSeek-V3 ships FP8 blocks);
  - no `auto_map` (DeepSeek's remote modeling code; transformers v5 has native deepseek_v2 / deepseek_v3);
  - no generation-time-only fields (`transformers_version`).

`tiny(name)` is the same family with every structural feature the real model has (GQA ratio, head_dim !=
hidden/heads, mixed dense/MoE layers, shared experts, group-limited routing, MLA with or without q_lora, sliding
layers, sinks, YaRN / llama3 RoPE, tied embeddings, ...) at sizes a CPU test builds and decodes in well under a
second. Tiny configs start from the full config and override sizes only, so every other field is inherited.

`PUBLISHED[name]` holds the parameter counts the model's authors published, with the convention they count
"active" in (tests/models/test_synth.py checks models/synth.count_params against them).

Other packages add presets with `register_preset` (the Laneformer family adds `laneformer-2b`); a provider
module listed in `PROVIDERS` is imported on first lookup, the way models/registry.py finds external families,
so models/ never imports a package above it at import time.
"""
from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Published:
    """Parameter counts as the authors published them."""
    total: float                      # parameters in the checkpoint (no MTP / draft heads)
    active: float                     # parameters used per token
    embed_in_active: bool = True      # Qwen, Mistral, OLMoE count the embedding table in "active";
                                      # OpenAI (gpt-oss) and DeepSeek count only the unembedding (lm_head)
    source: str = ""


def _layer_types(n: int, sliding_first: bool = True) -> list[str]:
    # gpt-oss alternates sliding / full, starting with sliding (layer 0 is sliding)
    a, b = ("sliding_attention", "full_attention") if sliding_first else ("full_attention", "sliding_attention")
    return [a if i % 2 == 0 else b for i in range(n)]


# ---- full-size configs (as published on the Hugging Face Hub) ---------------------------------------------------

_QWEN3_MOE_COMMON = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_30B_A3B = {
    **_QWEN3_MOE_COMMON,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_window_layers": 48,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_hidden_layers": 48,
}

QWEN3_235B_A22B = {
    **_QWEN3_MOE_COMMON,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 94,
    "moe_intermediate_size": 1536,
    "num_attention_heads": 64,
    "num_hidden_layers": 94,
}

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}

OLMOE_1B_7B = {  # allenai/OLMoE-1B-7B-0924
    "architectures": ["OlmoeForCausalLM"],
    "model_type": "olmoe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "clip_qkv": None,
    "eos_token_id": 50279,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 1024,
    "max_position_embeddings": 4096,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 16,
    "num_key_value_heads": 16,
    "output_router_logits": False,
    "pad_token_id": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.01,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 50304,
}

_GPT_OSS_COMMON = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_key_value_heads": 8,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 201088,
}

GPT_OSS_20B = {**_GPT_OSS_COMMON, "num_hidden_layers": 24, "num_local_experts": 32, "layer_types": _layer_types(24)}
GPT_OSS_120B = {**_GPT_OSS_COMMON, "num_hidden_layers": 36, "num_local_experts": 128, "layer_types": _layer_types(36)}

DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "pretraining_tp": 1,
    "q_lora_rank": None,              # V2-Lite projects q directly (q_proj), no q_a/q_b
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 102400,
}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,    # the MTP layer (index 61) is not written: decode does not use it
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3-235b-a22b": QWEN3_235B_A22B,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "olmoe-1b-7b": OLMOE_1B_7B,
    "gpt-oss-20b": GPT_OSS_20B,
    "gpt-oss-120b": GPT_OSS_120B,
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
    "deepseek-v3": DEEPSEEK_V3,
    "llama-3.2-1b": LLAMA_3_2_1B,
}

# ---- tiny variants: size overrides on top of the full config ----------------------------------------------------
# Sizes are odd on purpose where the family allows it (vocab 251, hidden 48, ...), so kernels tested on these
# shapes do not pass by accident of a power of two; head_dim stays even (RoPE pairs) and GQA ratios stay > 1
# wherever the real model has GQA.

_TINY_OVERRIDES: dict[str, dict] = {
    # GQA 4:1 with head_dim (16) != hidden / heads (48 / 8 = 6), per-head q/k norm, 8 experts top-2, renormalised
    "qwen3-30b-a3b": dict(hidden_size=48, intermediate_size=96, moe_intermediate_size=24, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                          num_hidden_layers=2, max_window_layers=2, vocab_size=251),
    "qwen3-235b-a22b": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=40, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4,
                            num_hidden_layers=3, max_window_layers=3, vocab_size=253),
    # GQA 4:1, 8 experts top-2 like the real one
    "mixtral-8x7b": dict(hidden_size=64, intermediate_size=56, num_attention_heads=8, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=251),
    # full MHA, q/k norm over the whole projection, top-k not renormalised
    "olmoe-1b-7b": dict(hidden_size=48, intermediate_size=24, num_attention_heads=4, num_key_value_heads=4,
                        num_experts=8, num_experts_per_tok=3, num_hidden_layers=2, vocab_size=251),
    # sinks, biases, YaRN without truncation, alternating sliding (window 4 < test prompts) / full layers,
    # head_dim * heads (64) != hidden (40)
    "gpt-oss-20b": dict(hidden_size=40, intermediate_size=40, head_dim=16, num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, experts_per_token=2,
                        num_hidden_layers=2, layer_types=_layer_types(2), sliding_window=4, vocab_size=251),
    "gpt-oss-120b": dict(hidden_size=48, intermediate_size=48, head_dim=16, num_attention_heads=8,
                         num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=4, experts_per_token=4,
                         num_hidden_layers=4, layer_types=_layer_types(4), sliding_window=4, vocab_size=251),
    # MLA without q_lora, 1 dense layer then MoE, 2 shared experts, softmax greedy routing, YaRN mscale 0.707
    "deepseek-v2-lite": dict(hidden_size=48, intermediate_size=80, moe_intermediate_size=24, kv_lora_rank=16,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, num_attention_heads=4,
                             num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
                             num_hidden_layers=3, vocab_size=251),
    # MLA with q_lora, 2 dense layers then MoE, 1 shared expert, sigmoid + correction bias, 4 groups pick 2,
    # routed_scaling_factor 2.5, YaRN mscale 1.0
    "deepseek-v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, n_group=4, topk_group=2,
                        num_experts_per_tok=4, first_k_dense_replace=2, num_hidden_layers=4, vocab_size=251),
    # tied embeddings, llama3 RoPE scaling, GQA 4:1, explicit head_dim (== hidden / heads, as in the real one)
    "llama-3.2-1b": dict(hidden_size=64, intermediate_size=96, head_dim=8, num_attention_heads=8,
                         num_key_value_heads=2, num_hidden_layers=2, vocab_size=251),
}

PUBLISHED: dict[str, Published] = {
    "qwen3-30b-a3b": Published(30.5e9, 3.3e9, True, "Qwen3 model card: 30.5B total, 3.3B activated"),
    "qwen3-235b-a22b": Published(235e9, 22e9, True, "Qwen3 model card: 235B total, 22B activated"),
    "mixtral-8x7b": Published(46.7e9, 12.9e9, True, "Mistral: 46.7B total, 12.9B active"),
    "olmoe-1b-7b": Published(6.9e9, 1.3e9, True, "OLMoE paper: 6.9B total, 1.3B active"),
    "gpt-oss-20b": Published(20.91e9, 3.61e9, False, "gpt-oss model card: 20.91B total, 3.61B active"),
    "gpt-oss-120b": Published(116.83e9, 5.13e9, False, "gpt-oss model card: 116.83B total, 5.13B active"),
    "deepseek-v2-lite": Published(15.7e9, 2.4e9, False, "DeepSeek-V2 paper: 15.7B total, 2.4B activated"),
    "deepseek-v3": Published(671e9, 37e9, False, "DeepSeek-V3 report: 671B total (+14B MTP), 37B activated"),
    "llama-3.2-1b": Published(1.24e9, 1.24e9, True, "Meta: 1.24B (1.23B) parameters, dense"),
}

_TINY: dict[str, dict] = {}

# Modules that register presets of families living outside models/ (imported lazily; see module docstring).
PROVIDERS: list[str] = ["kie_moe.dense.presets"]
_providers_loaded = False


def register_preset(name: str, config: dict, tiny_config: dict | None = None,
                    published: Published | None = None, *, replace: bool = False) -> None:
    """Add a preset. `tiny_config` is a complete config.json dict (not overrides); without one, `tiny(name)`
    refuses. Re-registering a name is an error unless `replace` (so two packages cannot silently collide)."""
    if not isinstance(config, dict) or "model_type" not in config:
        raise ConfigError(f"preset {name!r}: config must be a config.json dict with a 'model_type' field")
    if name in PRESETS and not replace:
        raise ConfigError(f"preset {name!r} is already registered")
    PRESETS[name] = config
    if tiny_config is not None:
        if tiny_config.get("model_type") != config["model_type"]:
            raise ConfigError(f"preset {name!r}: tiny config has model_type {tiny_config.get('model_type')!r}, "
                              f"the full one {config['model_type']!r}")
        _TINY[name] = tiny_config
    if published is not None:
        PUBLISHED[name] = published


def _load_providers() -> None:
    global _providers_loaded
    if _providers_loaded:
        return
    _providers_loaded = True
    for mod in PROVIDERS:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            # only "the provider is not installed / not written yet" is silent; a broken provider is not
            if e.name is None or not mod.startswith(e.name):
                raise


_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _fit_special_ids(cfg: dict) -> dict:
    """Move bos/eos/pad ids that the tiny vocabulary no longer holds to its top ids (distinct ids stay distinct:
    HF asserts padding_idx < vocab_size, and a generation loop must be able to emit eos)."""
    vocab = cfg["vocab_size"]
    moved: dict[int, int] = {}

    def fit(i):
        if i is None or i < vocab:
            return i
        if i not in moved:
            moved[i] = vocab - 1 - len(moved)
        return moved[i]

    for key in _SPECIAL_IDS:
        if key in cfg:
            v = cfg[key]
            cfg[key] = [fit(i) for i in v] if isinstance(v, list) else fit(v)
    return cfg


def preset_names() -> list[str]:
    _load_providers()
    return list(PRESETS)


def preset(name: str) -> dict:
    """A deep copy of the full-size config.json dict of `name`."""
    _load_providers()
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return copy.deepcopy(PRESETS[name])


def tiny(name: str) -> dict:
    """A deep copy of the tiny config.json dict of `name` (same family and features, test-sized)."""
    _load_providers()
    if name in _TINY:
        return copy.deepcopy(_TINY[name])
    if name in _TINY_OVERRIDES:
        cfg = preset(name)
        cfg.update(copy.deepcopy(_TINY_OVERRIDES[name]))
        return _fit_special_ids(cfg)
    if name in PRESETS:
        raise ConfigError(f"preset {name!r} has no tiny variant (register_preset(..., tiny_config=...))")
    raise ConfigError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})")

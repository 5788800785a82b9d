"""model_type -> family adapter (imported lazily), and `load_model(dir)` -> (ModelSpec, WeightStore)."""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

from .errors import ConfigError
from .families.common import Cfg
from .loader import SafetensorsSource, WeightStore, read_config
from .spec import ModelSpec

# model_type -> module under models/families
FAMILIES = {
    "llama": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen2_moe": "qwen2_moe",
    "mixtral": "mixtral",
    "olmoe": "olmoe",
    "gpt_oss": "gpt_oss",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
}
# Families that live outside models/ (their own package) register a full module path here.
EXTERNAL_FAMILIES = {
    "laneformer": "kie_moe.dense.adapter",
}


def adapter_for(model_type: str | None, path: str = "config.json"):
    if model_type in FAMILIES:
        return importlib.import_module(f"kie_moe.models.families.{FAMILIES[model_type]}")
    if model_type in EXTERNAL_FAMILIES:
        return importlib.import_module(EXTERNAL_FAMILIES[model_type])
    known = ", ".join(sorted(supported_model_types()))
    raise ConfigError(f"{path}: model_type {model_type!r} is not supported (supported: {known})")


def supported_model_types() -> list[str]:
    return [*FAMILIES, *EXTERNAL_FAMILIES]


def spec_from_config(cfg: dict, path: str = "config.json") -> ModelSpec:
    return checked_spec(adapter_for(cfg.get("model_type"), path), cfg, path)


def check_token_ids(ids, vocab_size: int, what: str) -> None:
    """Each of ids an int token id below vocab_size, else a ConfigError naming `what` (an eos id the model can never
    sample would make every generation run to its length limit without a word)."""
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ConfigError(f"{what} {t!r} is not a token id of this model (vocab_size {vocab_size})")


def checked_spec(adapter, cfg: dict, path: str = "config.json"):
    """adapter.build_spec, with the settings no adapter checks on its own refused by name: a ValueError from a
    field's conversion (a rope setting, a number given as text) as the ConfigError it is, a norm epsilon that is
    not a positive number (NaN logits later), routing that asks for more experts than there are."""
    try:
        spec = adapter.build_spec(Cfg(cfg, path))
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        msg = str(e).removeprefix("config.json: ")
        raise ConfigError(msg if msg.startswith(path) else f"{path}: {msg}") from None
    eps = getattr(spec, "norm_eps", None)
    if eps is not None and not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ConfigError(f"{path}: rms_norm_eps must be a positive number, got {eps!r}")
    check_token_ids(spec.eos_token_ids, spec.vocab_size, f"{path}: eos_token_id")
    for i, lay in enumerate(getattr(spec, "layers", ())):
        m = getattr(lay, "moe", None)
        if m is None:
            continue
        if not 1 <= m.top_k <= m.num_experts:
            raise ConfigError(f"{path}: layer {i} routes each token to {m.top_k} experts (num_experts_per_tok) "
                              f"but has {m.num_experts}")
        if m.n_group > 1 and not (1 <= m.topk_group <= m.n_group
                                  and m.top_k <= m.topk_group * (m.num_experts // m.n_group)):
            raise ConfigError(f"{path}: topk_group={m.topk_group} of n_group={m.n_group} groups cannot hold "
                              f"num_experts_per_tok={m.top_k} experts")
    return spec


@dataclass
class LoadedModel:
    path: str
    config: dict
    spec: ModelSpec
    weights: WeightStore


def load_model(model_dir: str) -> LoadedModel:
    import os
    cfg = read_config(model_dir)
    path = os.path.join(model_dir, "config.json")
    adapter = adapter_for(cfg.get("model_type"), path)
    spec = checked_spec(adapter, cfg, path)
    source = open_source(model_dir, cfg)
    ignore = adapter.ignore(spec) if hasattr(adapter, "ignore") else (lambda n: False)
    store = WeightStore(source, adapter.tensor_refs(spec), ignore)
    return LoadedModel(model_dir, cfg, spec, store)


def open_source(model_dir: str, cfg: dict):
    """Plain safetensors, or (when config.json carries a quantization_config) the quantized reader of quant/."""
    src = SafetensorsSource(model_dir)
    if cfg.get("quantization_config"):
        from kie_moe.quant.ingest import QuantizedSource
        return QuantizedSource(src, cfg["quantization_config"])
    return src

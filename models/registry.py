"""model_type -> family adapter (imported lazily), and `load_model(dir)` -> (ModelSpec, WeightStore)."""
from __future__ import annotations

import importlib
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
    adapter = adapter_for(cfg.get("model_type"), path)
    return adapter.build_spec(Cfg(cfg, path))


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
    spec = adapter.build_spec(Cfg(cfg, path))
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

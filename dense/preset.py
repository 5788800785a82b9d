"""Laneformer presets (config.json dicts) and random-weight checkpoints in the public layout.

laneformer-2b. Published (DESIGN.md §5): 15 layers, 8 lanes, 32 query / 16 kv heads, broadcast delay 2, sliding
window on the first 10 layers, about 2.3B parameters (about 4.6 GB in FP16). Not published, so assumed here:
- hidden_size 4096 (head_dim 128, the usual GEMV-friendly head size; 15 layers at ~2.3B need a wide model),
- intermediate_size 6912 (864 per lane; chosen so the total lands on 2.30B),
- vocab_size 32768, untied lm_head,
- sliding_window 1024 over max_position_embeddings 8192, rope_theta 500000, norm_eps 1e-5,
- use_comm and use_early_comm on (DTP with ordinary TP in the first d layers), per-lane norm scales,
  pre_norm_lane_agg on (one norm of the summed lanes before the head).
Total: 15 * (3 * 4096^2 + 3 * 4096 * 6912 + 2 * 8 * 4096) + 2 * 32768 * 4096 + 4096 = 2,298,417,152 parameters
(4.60 GB in FP16 or BF16). The KV cache is 15 * 2 * 16 * 128 * 2 bytes = 122,880 bytes per token in FP16.

laneformer-tiny: 5 layers, 4 lanes, D = 64, every switch of the 2B preset, for tests and `kie demo`.
"""
from __future__ import annotations

import copy
import json
import os
import zlib

import torch
from safetensors.torch import save_file

from kie_moe.models.families.common import Cfg

PRESETS: dict[str, dict] = {
    "laneformer-2b": {
        "model_type": "laneformer",
        "architectures": ["LaneformerForCausalLM"],
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 6912,
        "num_hidden_layers": 15,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "num_lanes": 8,
        "broadcast_delay": 2,
        "use_comm": True,
        "use_early_comm": True,
        "replicated_rmsn_scale": False,
        "pre_norm_lane_agg": True,
        "lm_head_type": "replicate",
        "sliding_window": 1024,
        "sliding_window_n_layers": 10,
        "unclamped_layers": [],
        "rope_theta": 500000.0,
        "norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    },
    "laneformer-tiny": {
        "model_type": "laneformer",
        "architectures": ["LaneformerForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 5,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_lanes": 4,
        "broadcast_delay": 2,
        "use_comm": True,
        "use_early_comm": True,
        "replicated_rmsn_scale": False,
        "pre_norm_lane_agg": True,
        "lm_head_type": "replicate",
        "sliding_window": 8,
        "sliding_window_n_layers": 3,
        "unclamped_layers": [],
        "rope_theta": 10000.0,
        "norm_eps": 1e-5,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    },
}


def preset(name: str, **overrides) -> dict:
    """A copy of preset `name` with config.json fields overridden."""
    if name not in PRESETS:
        raise KeyError(f"no Laneformer preset {name!r} (have: {', '.join(PRESETS)})")
    cfg = copy.deepcopy(PRESETS[name])
    cfg.update(overrides)
    return cfg


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _fill(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int, std: float, norm_jitter: float) -> torch.Tensor:
    """Deterministic per tensor (seeded by name), so values do not depend on sharding; generated in row chunks
    so float32 scratch stays under ~64 MB even for the embedding."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2 ** 63))
    if name.endswith(("norm.weight", "norm.scale")):          # RMSNorm scales start at 1, as in training; tests
        return (1 + norm_jitter * torch.randn(shape, generator=g)).to(dtype)   # jitter them so lanes differ
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1, shape[-1])
    rows = max(1, (16 << 20) // shape[-1])
    for r in range(0, flat.shape[0], rows):
        chunk = flat[r:r + rows]
        chunk.copy_(torch.randn(chunk.shape, generator=g) * std)
    return out


def _std(name: str, shape: tuple[int, ...], num_layers: int) -> float:
    """Default init (as models/synth.py): N(0, 1/fan_in) keeps each projection's activation scale; output
    projections (wo, w2) are further divided by sqrt(2 * num_layers) so the residual grows ~sqrt(2) over the
    whole model; embeddings and lm_head N(0, 1/D). For lane tensors fan_in is the last dim (D, or in/L)."""
    std = shape[-1] ** -0.5
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        std /= (2 * num_layers) ** 0.5
    return std


def write_checkpoint(config: dict, out_dir: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                     shard_bytes: int = 2 << 30, init_std: float | None = None, norm_jitter: float = 0.0) -> list[str]:
    """config.json + random weights in the public Laneformer layout -> the safetensors files written.

    init_std None: fan-in scaled init (`_std`), so a random model decodes sanely in bf16; a number: every weight
    N(0, init_std^2) (tests use a large one so greedy tokens vary). Norm scales are 1 + norm_jitter * N(0, 1)
    (tests jitter them so per-lane scales differ between lanes).

    Tensors are listed by the adapter (the same TensorRefs the loader checks), grouped into shards of at most
    `shard_bytes` in that order, and each shard is generated, written and freed before the next, so peak RAM is
    about one shard. More than one shard -> model-0000k-of-0000n.safetensors + model.safetensors.index.json.
    """
    from .adapter import build_spec, tensor_refs
    spec = build_spec(Cfg(config, os.path.join(out_dir, "config.json")))
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"write_checkpoint: dtype {dtype} is not one of {list(_DTYPE_NAMES.values())}")
    esize = torch.empty((), dtype=dtype).element_size()
    tensors = [(r.layouts[0].hf_name, r.layouts[0].hf_shape) for r in tensor_refs(spec)
               if not (r.optional and r.name == "lm_head")]
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        n = esize * torch.Size(shape).numel()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(config, torch_dtype=_DTYPE_NAMES[dtype])
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    weight_map, total = {}, 0
    for fname, group in zip(files, shards):
        data = {name: _fill(name, shape, dtype, seed, _std(name, shape, spec.num_layers) if init_std is None
                            else init_std, norm_jitter) for name, shape in group}
        total += sum(t.numel() * esize for t in data.values())
        save_file(data, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in data})
        del data
    if len(files) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return [os.path.join(out_dir, f) for f in files]

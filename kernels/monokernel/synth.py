"""Random weights straight into a plan's device buffers (benchmarks and GPU tests: no checkpoint, no host copy),
and real-architecture specs from models.presets (optionally cut to a few layers)."""
from __future__ import annotations

import math

import torch

from kie_moe.models.spec import ModelSpec

from .qarena import QArena


def random_qfill(qa: QArena, bufs: dict, seed: int):
    """Benchmark codes and scales of the right magnitudes (|w| ~ 1/sqrt(in)); never NaN, never all zeros."""
    g = torch.Generator(device=bufs["qw"].device).manual_seed(seed + 1)
    qw = bufs["qw"]
    if qa.fmt <= 2:   # e4m3 codes of N(0, 64^2)-ish values: finite bytes
        for i in range(0, qw.numel(), 1 << 28):
            n = min(1 << 28, qw.numel() - i)
            v = (torch.randn(n, generator=g, device=qw.device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            qw[i:i + n].copy_(v.view(torch.uint8))
    else:             # any byte is two valid e2m1 codes
        qw.random_(0, 256, generator=g)
    k = qa.entries[next(iter(qa.entries))][4] if qa.entries else 1
    bufs["qf32"].fill_(k ** -0.5 / 64 if qa.fmt <= 2 else 16384.0 / 1000.0)
    if qa.fmt == 3:   # e4m3 group scales ~ 1000 * std / 2.5
        bufs["qs8"].copy_(torch.full_like(bufs["qs8"], 0).float().add_(1000 * k ** -0.5 / 2.5)
                          .to(torch.float8_e4m3fn).view(torch.uint8))
    elif qa.fmt == 4:
        bufs["qs8"].fill_(127 + int(round(math.log2(k ** -0.5 / 2.5))))


def preset_spec(arch: str, layers: int | None = None) -> ModelSpec:
    """ModelSpec of a models.presets entry (e.g. "qwen3-30b-a3b"), optionally cut to its first `layers` layers
    (benchmarks and GPU tests: real widths, a depth that leaves room for an fp32 reference)."""
    from kie_moe.models.presets import preset
    from kie_moe.models.registry import spec_from_config
    cfg = preset(arch)
    if layers:
        cfg["num_hidden_layers"] = layers
        if isinstance(cfg.get("layer_types"), list):
            cfg["layer_types"] = cfg["layer_types"][:layers]
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = min(cfg["max_window_layers"], layers)
        if isinstance(cfg.get("sliding_window_n_layers"), int):   # Laneformer: first n (or last |n|) layers
            n = cfg["sliding_window_n_layers"]
            cfg["sliding_window_n_layers"] = max(-layers, min(n, layers))
        if cfg.get("unclamped_layers"):
            cfg["unclamped_layers"] = [u for u in cfg["unclamped_layers"] if -layers <= u < layers]
    return spec_from_config(cfg)


def random_fill(buf: torch.Tensor, arena, seed: int):
    """Benchmark weights: N(0, 1/in) for matrices, 1 for norms (Laneformer's per-lane [L, D] scales too), small
    biases (decodes without inf/NaN)."""
    g = torch.Generator(device=buf.device).manual_seed(seed)
    for name, (off, shape) in arena.entries.items():
        v = buf[off:off + math.prod(shape)]
        if name.endswith("norm"):
            v.fill_(1.0)
        elif len(shape) >= 2:   # matrices, and Laneformer lane stacks [L, out, in]
            v.normal_(0.0, shape[-1] ** -0.5, generator=g)
        else:
            v.normal_(0.0, 0.02, generator=g)

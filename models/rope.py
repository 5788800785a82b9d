"""Rotary position embeddings: frequencies (default, linear, llama3, YaRN) and application in both layouts.

Pure torch; shared by the reference decoder and the GPU backends' host-side tables. Matches HF transformers'
`modeling_rope_utils` numerically (same float32 formulas), which the family tests check end to end.
"""
from __future__ import annotations

import math

import torch

from .spec import RopeSpec


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_factor(rope: RopeSpec) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [rotary_dim/2] float32, multiplier applied to cos and sin)."""
    dim = rope.rotary_dim
    base = rope.theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.scaling == "default":
        return inv_freq, 1.0
    if rope.scaling == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.scaling == "llama3":
        old_ctx = rope.original_max_position
        low_wavelen = old_ctx / rope.low_freq_factor
        high_wavelen = old_ctx / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        llama = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * llama / rope.factor + smooth * llama
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, llama), 1.0
    if rope.scaling == "yarn":
        factor = rope.factor
        if rope.attention_factor is not None:
            att = rope.attention_factor
        elif rope.mscale and rope.mscale_all_dim:
            att = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            att = _yarn_mscale(factor)

        def corr_dim(rot: float) -> float:
            return (dim * math.log(rope.original_max_position / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
        if rope.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
        extrap, interp = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrap_factor = 1 - ramp
        return interp * (1 - extrap_factor) + extrap * extrap_factor, float(att)
    raise ValueError(f"unsupported rope scaling {rope.scaling!r}")


def cos_sin(rope: RopeSpec, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [S] -> cos, sin [S, rotary_dim/2] (float32, attention factor folded in)."""
    inv_freq, att = inv_freq_and_factor(rope)
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos() * att, freqs.sin() * att


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [..., S, H, rotary_dim] (float32); cos/sin [S, rotary_dim/2]. Rotates the first rotary_dim dims.

    half: pairs (j, j + d/2) -- Llama / Qwen / gpt-oss. pair: pairs (2j, 2j + 1) -- DeepSeek, Laneformer.
    """
    d = cos.shape[-1] * 2
    rot, rest = x[..., :d], x[..., d:]
    c, s = cos[:, None, :], sin[:, None, :]          # [S, 1, d/2] broadcast over heads
    if style == "half":
        x1, x2 = rot[..., : d // 2], rot[..., d // 2:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    elif style == "pair":
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        raise ValueError(f"unknown rope style {style!r}")
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def rope_from_config(cfg: dict, rotary_dim: int, style: str = "half") -> RopeSpec:
    """Read RoPE settings from an HF config dict, v5 (`rope_parameters`) or v4 (`rope_theta` + `rope_scaling`)."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    if not params:
        params = dict(legacy)
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(f"config.json: rope type {kind!r} is not supported (default, linear, llama3, yarn)")
    factor = float(params.get("factor") or 1.0)
    orig = int(params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings") or 0)
    if kind == "yarn" and params.get("factor") is None and orig:
        factor = cfg["max_position_embeddings"] / orig
    return RopeSpec(
        theta=float(theta), rotary_dim=rotary_dim, style=style, scaling=kind, factor=factor,
        original_max_position=orig,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )

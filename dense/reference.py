"""Laneformer reference forward: the specification every Laneformer backend (graph, monokernel, DTP across GPUs)
must reproduce. Float32 on CPU, written for reading; lanes are vectorised with einsum over a lane axis.

The public description (DESIGN.md §5) leaves details open; this is what we decided, and what the independent
implementation in tests/dense/ also does:

- Residual stream. x [S, L, D] (batch 1, so the [B, S, L, D] of the description without B). The embedding row
  is copied unscaled into every lane. Every lane is a full-width copy and computes its own sublayers on its own
  copy: lane l normalises x[:, l] with its own scale (scale[l], or the shared weight), projects with its lane
  tensors, attends with its own heads over its own KV cache, and writes a full-width partial p_l [S, D].
- Heads. Lane l owns query heads l*Hq/L ... (l+1)*Hq/L - 1 and kv heads l*Hkv/L ... of the model (lane-major);
  inside a lane, local query head h reads local kv head h // (Hq/Hkv) (ordinary GQA grouping, so globally query
  head h reads kv head h // (Hq/Hkv)). head_dim = D / Hq; softmax scale head_dim^-0.5; no biases.
- RoPE rotates adjacent pairs (2j, 2j+1) of q and k by position * theta^(-2j/head_dim), absolute positions
  continuing across forward calls.
- FFN: p_l = w2[l] @ (silu(w1[l] @ h) * (w3[l] @ h)).
- Reduce, per sublayer (attention partials only meet attention partials, FFN only FFN), layer i, delay d:
    i <  d, use_early_comm:   x_l += sum_m p_m(i)                             (ALL)
    i <  d, no early comm:    x_l += sqrt(L) * p_l(i)                         (SCALED: sqrt(L) multiplies the
    i >= d, no use_comm:      x_l += sqrt(L) * p_l(i)                          lane's own partial, nothing else)
    i >= d, use_comm:         x_l += p_l(i) + (sum_m p_m(i-d) - p_l(i-d))     (DELAYED)
  The delayed term of layer i >= d always reads layer i-d, whatever layer i-d did itself: with use_early_comm
  the other lanes' partials of layers 0..d-1 thus reach a lane twice (at once, and again d layers later), and
  without it once, d layers late. Partials of the last d layers never reach the other lanes.
- Final. pre_norm_lane_agg: h = rmsnorm(sum_l x_l) with the [D] final norm. Otherwise (lm_head_type
  "replicate"): h = mean_l rmsnorm_l(x_l), each lane with its own final scale. logits = lm_head @ h, with one
  lm_head [V, D] (or the embedding when tied).
- Sliding-window layers: key j is visible from query i iff i - window < j <= i.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kie_moe.models.errors import InputError
from kie_moe.models.rope import apply_rope, cos_sin
from kie_moe.models.spec import canonical

from .config import ALL, DELAYED, SCALED, LaneformerSpec

SUBLAYERS = ("attn", "ffn")


# ---- lane math, shared with the N-rank simulation (any subset `l` of the L lanes) -----------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Over the last dim, statistics in float32 (bf16 on GPU); w broadcasts from the right."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def lane_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [S, l, D]; w [D] (shared) or [l, D] (the lanes' own scales, broadcast over S)."""
    return rms_norm(x, w, eps)


def lane_attention(spec: LaneformerSpec, h: torch.Tensor, wq, wk, wv, wo, cache, start: int,
                   window: int | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """h [S, l, D] normed lane streams; wq [l, hq*Dh, D], wk/wv [l, hk*Dh, D], wo [l, D, hq*Dh];
    cache None or (k, v) [l, T0, hk, Dh]. -> (partials [S, l, D], new cache [l, T0 + S, hk, Dh])."""
    S, nl = h.shape[0], h.shape[1]
    hq, hk, Dh = spec.lane_q_heads, spec.lane_kv_heads, spec.head_dim
    q = torch.einsum("sld,lod->lso", h, wq).reshape(nl, S, hq, Dh)        # [l, S, hq, Dh]
    k = torch.einsum("sld,lod->lso", h, wk).reshape(nl, S, hk, Dh)        # [l, S, hk, Dh]
    v = torch.einsum("sld,lod->lso", h, wv).reshape(nl, S, hk, Dh)
    cos, sin = cos_sin(spec.rope, torch.arange(start, start + S, device=h.device))    # [S, Dh/2]
    q, k = apply_rope(q, cos.to(h.dtype), sin.to(h.dtype), "pair"), apply_rope(k, cos.to(h.dtype), sin.to(h.dtype), "pair")
    if cache is not None:
        k, v = torch.cat([cache[0], k], 1), torch.cat([cache[1], v], 1)    # [l, T, hk, Dh]
    T, rep = k.shape[1], hq // hk
    kx, vx = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)     # [l, T, hq, Dh]: head h reads h // rep
    scores = torch.einsum("lshd,lthd->lhst", q.float(), kx.float()) * spec.softmax_scale   # [l, hq, S, T]
    qpos = torch.arange(start, start + S, device=h.device)[:, None]
    kpos = torch.arange(T, device=h.device)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos > qpos - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).to(h.dtype)
    out = torch.einsum("lhst,lthd->lshd", probs, vx).reshape(nl, S, hq * Dh)
    return torch.einsum("lso,ldo->sld", out, wo), (k, v)                   # partials [S, l, D]


def lane_ffn(h: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    """h [S, l, D]; w1/w3 [l, f, D]; w2 [l, D, f] -> partials [S, l, D]."""
    g = torch.einsum("sld,lfd->slf", h, w1)
    u = torch.einsum("sld,lfd->slf", h, w3)
    return torch.einsum("slf,ldf->sld", F.silu(g) * u, w2)


def aggregate_lanes(spec: LaneformerSpec, x: torch.Tensor, final_norm: torch.Tensor,
                    lane_sum: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [S, l, D] -> head input [S, D]. `lane_sum` maps [S, l, D] to the sum over ALL L lanes [S, D] (a local
    sum on one device; local sum + all-reduce across ranks)."""
    if spec.pre_norm_lane_agg:
        return rms_norm(lane_sum(x), final_norm, spec.norm_eps)              # [S, D]
    return lane_sum(lane_rms_norm(x, final_norm, spec.norm_eps)) / spec.num_lanes


def layer_weights(spec: LaneformerSpec, get: Callable[[str], torch.Tensor], lanes: slice | None = None) -> list[dict]:
    """Per layer {suffix: tensor}, lane tensors and per-lane scales restricted to `lanes`."""
    out = []
    for i in range(spec.num_layers):
        d = {}
        for name in ("attn_norm", "mlp_norm", "attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down"):
            t = get(canonical(i, name))
            d[name] = t[lanes] if lanes is not None and t.dim() > 1 else t
        out.append(d)
    return out


def check_positions(spec: LaneformerSpec, start: int, S: int):
    if start + S > spec.max_position:
        raise InputError(f"sequence of {start + S} tokens exceeds max_position_embeddings={spec.max_position}")


# ---- the single-device decoder --------------------------------------------------------------------------------
class LaneformerDecoder:
    """forward(ids [S] int64) -> logits [S, V] float32; positions continue from the cache length; reset()."""

    def __init__(self, spec: LaneformerSpec, weights, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        get = lambda n: weights.get(n).to(self.device, self.dtype)
        self.embed = get("embed")
        self.final_norm = get("final_norm")
        self.lm_head = get("lm_head") if "lm_head" in weights else self.embed
        self.layers = layer_weights(spec, get)
        self.reset()

    def reset(self):
        self.cache: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.spec.num_layers
        self.pos = 0

    def _reduce(self, i: int, p: torch.Tensor, hist: dict, kind: str) -> torch.Tensor:
        """What the lanes add for sublayer `kind` of layer i; p [S, L, D] the partials of layer i."""
        mode = self.spec.reduce_mode(i)
        if mode == ALL:
            return p.sum(1, keepdim=True).expand_as(p)
        if mode == SCALED:
            return self.spec.lane_scale * p
        assert mode == DELAYED
        d = self.spec.broadcast_delay                                       # d = 0: plain TP every layer
        old = p if d == 0 else hist[(kind, i - d)]                          # [S, L, D] from layer i - d
        return p + (old.sum(1, keepdim=True) - old)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        spec, start, S = self.spec, self.pos, ids.shape[0]
        check_positions(spec, start, S)
        x = self.embed[ids.to(self.device)][:, None, :].repeat(1, spec.num_lanes, 1)    # [S, L, D]
        hist: dict[tuple[str, int], torch.Tensor] = {}        # (sublayer, layer) -> partials [S, L, D]
        for i, w in enumerate(self.layers):
            h = lane_rms_norm(x, w["attn_norm"], spec.norm_eps)
            p, self.cache[i] = lane_attention(spec, h, w["attn.q"], w["attn.k"], w["attn.v"], w["attn.o"],
                                              self.cache[i], start, spec.windows[i])
            x = x + self._reduce(i, p, hist, "attn")
            hist[("attn", i)] = p
            h = lane_rms_norm(x, w["mlp_norm"], spec.norm_eps)
            p = lane_ffn(h, w["mlp.gate"], w["mlp.up"], w["mlp.down"])
            x = x + self._reduce(i, p, hist, "ffn")
            hist[("ffn", i)] = p
            for kind in SUBLAYERS:                             # only the last d layers can still be read
                hist.pop((kind, i - spec.broadcast_delay), None)
        self.pos += S
        h = aggregate_lanes(spec, x, self.final_norm, lambda t: t.sum(1))
        return (h @ self.lm_head.T).float()


@torch.no_grad()
def greedy(decoder, prompt: torch.Tensor, max_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Reset, prefill `prompt` [S], then decode one token at a time -> (new tokens, logits of each forward)."""
    decoder.reset()
    logits = [decoder.forward(prompt)]
    tokens = []
    for _ in range(max_new):
        tokens.append(int(logits[-1][-1].argmax()))
        if len(tokens) == max_new:
            break
        logits.append(decoder.forward(torch.tensor([tokens[-1]], dtype=torch.int64)))
    return tokens, logits

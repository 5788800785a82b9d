"""Batched prefill at GPU speed: the whole prompt through the model in a few big ops per layer, filling the KV
cache a decode backend reads (graph: per layer (K, V) [T, Hkv, Dh]; monokernel: [L, 2, Hkv, T, Dh]; MLA: the
latent | rope-key rows [T, r + rd] in both). The reference decoder (models/reference.py) is the oracle: same math,
same rounding points, organised for throughput instead of reading.

Order: layer-major. The residual stream x [S, D] of the whole prompt stays resident (its size is a fraction of one
layer's worth of KV cache); within a layer
  attention  in query chunks of `chunk` tokens (default 2048): q/k/v for the chunk, K/V written into the cache,
             then the chunk attends to cache[..chunk end] -- torch SDPA (FlashAttention on the GPU) with a
             bottom-right causal mask; a sliding window slices the keys to the window and uses an explicit mask;
             attention sinks (gpt-oss) take an exact materialised-softmax path over bounded query slices;
             MLA expands the latent cache through kv_b once per chunk (naive form; its FLOPs are < 1% of the
             layer's).
  MLP / MoE  in token chunks of `moe_chunk` (default: as many tokens as keep the MoE activations under ~2 GB):
             route (the reference's route(), every router kind), sort the (token, slot) pairs by expert, one
             GEMM per expert over its contiguous rows -- torch._grouped_mm (one launch for all experts; CUDA sm90+,
             bf16) or a loop over the active experts -- then the rows go back to (token, slot) order and one
             batched product per token sums the k slots with their routing weights (fp32 accumulation, no
             atomics). No host sync on the grouped path.
Quantized weights are dequantized per layer, just in time, into reusable scratch buffers (prefill_weights.py):
all experts of a layer at once when they fit `scratch_bytes`, else in groups; never a float copy of the model.

Only the last position's logits are computed (the LM head over 8K positions would cost as much as a layer).
"""
from __future__ import annotations

import math
import os
import warnings

import torch
import torch.nn.functional as F

from kie_moe.models.reference import rms_norm, route
from kie_moe.models.rope import apply_rope, cos_sin
from kie_moe.models.spec import AttentionSpec, ModelSpec, MoESpec, canonical

from .prefill_weights import (FLOAT_FMTS, GraphWeights, PlanWeights, PrefillWeights, StoreWeights, dequant_into,
                              expert_range, float_view)
from .weights import WeightHandle

__all__ = ["Prefill", "PrefillWeights", "GraphWeights", "PlanWeights", "StoreWeights", "grouped_mm_available"]

_MOE_ACT_BYTES = 2 << 30          # MoE activations per token chunk
_SINK_SCORE_BYTES = 256 << 20     # fp32 scores of the materialised (sinks) attention path


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """torch._grouped_mm: CUTLASS grouped GEMM on sm90+ in bf16 (torch >= 2.8); CPU builds run it too (tests)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return False        # the CPU's implementation is a loop anyway; tests force it with grouped=True


class Prefill:
    """prefill(ids, caches) -> last-position logits [V] (float32) or None; caches[i] is layer i's cache in the
    backend's layout: (K, V) views indexable as [T, Hkv, Dh] (GQA) or one [T, r + rd] tensor (MLA)."""

    def __init__(self, spec: ModelSpec, weights: PrefillWeights, device: torch.device | str,
                 dtype: torch.dtype | None = None, *, chunk: int | None = None, moe_chunk: int | None = None,
                 scratch_bytes: int | None = None, grouped: bool | None = None):
        self.spec, self.W = spec, weights
        self.device = torch.device(device)
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        self.chunk = chunk or int(os.environ.get("KIE_PREFILL_CHUNK", 2048))
        self.moe_chunk = moe_chunk
        gpu = self.device.type == "cuda"
        self.scratch_bytes = scratch_bytes or ((2 << 30) if gpu else (256 << 20))
        self.grouped = grouped_mm_available(self.device, self.dtype) if grouped is None else grouped
        self._scratch: dict[str, torch.Tensor] = {}
        self._vecs: dict[str, torch.Tensor | None] = {}
        self.stats: dict = {}

    @classmethod
    def for_graph(cls, backend, **kw) -> "Prefill":
        return cls(backend.spec, GraphWeights(backend), backend.device, backend.dtype, **kw)

    @classmethod
    def for_plan(cls, plan, dtype: torch.dtype | None = None, **kw) -> "Prefill":
        return cls(plan.spec, PlanWeights(plan), plan.device, dtype or plan.wdtype, **kw)

    # ---- small helpers -------------------------------------------------------------------------------------------
    def buf(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A reusable scratch tensor (grown, never shrunk): ops run in stream order, so reusing it for the next
        weight is safe once the previous op was queued."""
        n = math.prod(shape)
        b = self._scratch.get(key)
        if b is None or b.numel() < n:
            self._scratch.pop(key, None)
            b = self._scratch[key] = torch.empty(n, dtype=self.dtype, device=self.device)
        return b[:n].view(shape)

    def vec(self, name: str) -> torch.Tensor | None:
        """A norm / bias / sink vector in the compute dtype (cached: vectors are a few KB per layer)."""
        if name not in self._vecs:
            t = self.W.tensor(name)
            self._vecs[name] = None if t is None else t.to(self.device, self.dtype)
        return self._vecs[name]

    def p(self, i: int, name: str) -> torch.Tensor | None:
        return self.vec(canonical(i, name))

    def weight(self, h: WeightHandle, key: str = "lin") -> torch.Tensor:
        """The float [out, in] weight of a Linear: the handle's own tensor, or dequantized into scratch `key`."""
        w = float_view(h, self.dtype)
        if w is not None:
            return w
        if h.fmt in FLOAT_FMTS and h.weight.dtype != self.dtype:
            return h.weight.to(self.dtype)
        return dequant_into(h, self.buf(key, (h.out_features, h.in_features)))

    def linear(self, x: torch.Tensor, h: WeightHandle | str, bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(h, str):
            name = h
            h = self.W.linear(name)
            if h is None:
                raise KeyError(f"prefill: the model has no weight {name!r}")
        eb = torch.empty((), dtype=self.dtype).element_size()
        if h.fmt not in FLOAT_FMTS and h.out_features * h.in_features * eb > self.scratch_bytes:
            # a quantized Linear too big for the scratch at once (an LM head): row blocks
            step = max(128, self.scratch_bytes // eb // h.in_features // 128 * 128)
            return torch.cat([F.linear(x, self.weight(h.rows(r, min(r + step, h.out_features))),
                                       None if bias is None else bias[r:r + step])
                              for r in range(0, h.out_features, step)], dim=-1)
        return F.linear(x, self.weight(h), bias)

    # ---- the prompt ------------------------------------------------------------------------------------------------
    @torch.no_grad()      # not inference_mode: the scratch / cached vectors stay ordinary tensors
    def __call__(self, ids, caches: list, logits: bool = False) -> torch.Tensor | None:
        spec, eps = self.spec, self.spec.norm_eps
        ids = torch.as_tensor(ids, dtype=torch.long).to(self.device)
        S = ids.shape[0]
        if S == 0:
            return None
        if len(caches) != spec.num_layers:
            raise ValueError(f"prefill: {len(caches)} caches for {spec.num_layers} layers")
        self._rope: dict = {}
        emb = self.W.tensor("embed")
        x = emb.index_select(0, ids).to(self.dtype)                                     # [S, D]
        for i, lay in enumerate(spec.layers):
            attend = self._mla if lay.attn.kind == "mla" else self._gqa
            for c0 in range(0, S, self.chunk):
                c1 = min(S, c0 + self.chunk)
                h = rms_norm(x[c0:c1], self.p(i, "attn_norm"), eps)
                x[c0:c1] += attend(i, lay, h, c0, caches[i])
            step = self._moe_chunk(lay.moe) if lay.moe is not None else self.chunk
            for c0 in range(0, S, step):
                c1 = min(S, c0 + step)
                h = rms_norm(x[c0:c1], self.p(i, "mlp_norm"), eps)
                x[c0:c1] += self._moe(i, lay.moe, h) if lay.moe is not None else self._mlp(i, "mlp", h)
        if not logits:
            return None
        last = rms_norm(x[-1:], self.vec("final_norm"), eps)
        return self.linear(last, self.W.lm_head()).float()[0]

    def _moe_chunk(self, m: MoESpec) -> int:
        if self.moe_chunk:
            return self.moe_chunk
        D, I = self.spec.hidden_size, m.intermediate_size
        eb = torch.empty((), dtype=self.dtype).element_size()
        per_tok = m.top_k * (3 * D + 3 * I) * eb + 8 * D                    # xs, ys, yu; g|u, act; logits, out
        return max(self.chunk, (_MOE_ACT_BYTES // per_tok) // self.chunk * self.chunk)

    def _cos_sin(self, rope, c0: int, c1: int):
        key = (rope, c0, c1)
        if key not in self._rope:
            self._rope[key] = cos_sin(rope, torch.arange(c0, c1, device=self.device))
        return self._rope[key]

    # ---- attention ---------------------------------------------------------------------------------------------------
    def _gqa(self, i: int, lay, x: torch.Tensor, c0: int, cache) -> torch.Tensor:
        a, C, eps = lay.attn, x.shape[0], self.spec.norm_eps
        fused = self.W.qkv(i)
        if fused is not None:
            h, b = fused
            qkv = self.linear(x, h, None if b is None else b.to(self.dtype))
            q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        else:
            q = self.linear(x, canonical(i, "attn.q"), self.p(i, "attn.q_bias"))
            k = self.linear(x, canonical(i, "attn.k"), self.p(i, "attn.k_bias"))
            v = self.linear(x, canonical(i, "attn.v"), self.p(i, "attn.v_bias"))
        if a.qk_norm == "full":
            q, k = rms_norm(q, self.p(i, "attn.q_norm"), eps), rms_norm(k, self.p(i, "attn.k_norm"), eps)
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q = q.reshape(C, a.num_heads, a.head_dim)
        k = k.reshape(C, a.num_kv_heads, a.head_dim)
        v = v.reshape(C, a.num_kv_heads, a.head_dim)
        if a.qk_norm == "head":
            q, k = rms_norm(q, self.p(i, "attn.q_norm"), eps), rms_norm(k, self.p(i, "attn.k_norm"), eps)
        cos, sin = self._cos_sin(a.rope, c0, c0 + C)
        q = apply_rope(q.float(), cos, sin, a.rope.style).to(self.dtype)
        k = apply_rope(k.float(), cos, sin, a.rope.style).to(self.dtype)
        K, V = cache
        K[c0:c0 + C].copy_(k)
        V[c0:c0 + C].copy_(v)
        k0 = self._key_start(lay.sliding_window, c0)
        out = self._attend(a, q, K[k0:c0 + C], V[k0:c0 + C], c0, k0, lay.sliding_window, self.p(i, "attn.sinks"))
        return self.linear(out, canonical(i, "attn.o"), self.p(i, "attn.o_bias"))

    def _mla(self, i: int, lay, x: torch.Tensor, c0: int, cache) -> torch.Tensor:
        a, C, eps = lay.attn, x.shape[0], self.spec.norm_eps
        H, nope, rd, r = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
        if a.q_lora_rank:
            q = self.linear(rms_norm(self.linear(x, canonical(i, "attn.q_a")), self.p(i, "attn.q_a_norm"), eps),
                            canonical(i, "attn.q_b"))
        else:
            q = self.linear(x, canonical(i, "attn.q"))
        q = q.view(C, H, nope + rd)
        kv = self.linear(x, canonical(i, "attn.kv_a"))                            # [C, r + rd]
        cos, sin = self._cos_sin(a.rope, c0, c0 + C)
        cache[c0:c0 + C, :r].copy_(rms_norm(kv[:, :r], self.p(i, "attn.kv_a_norm"), eps))
        cache[c0:c0 + C, r:].copy_(apply_rope(kv[:, None, r:].float(), cos, sin, a.rope.style)[:, 0])
        q_pe = apply_rope(q[..., nope:].float(), cos, sin, a.rope.style).to(self.dtype)
        qf = torch.cat([q[..., :nope], q_pe], dim=-1)                              # [C, H, nope + rd]
        k0 = self._key_start(lay.sliding_window, c0)
        rows = cache[k0:c0 + C].to(self.dtype)
        T = rows.shape[0]
        kvb = self.linear(rows[:, :r], canonical(i, "attn.kv_b")).view(T, H, nope + a.v_head_dim)
        k = torch.cat([kvb[..., :nope], rows[:, None, r:].expand(T, H, rd)], dim=-1)
        out = self._attend(a, qf, k, kvb[..., nope:], c0, k0, lay.sliding_window, None)
        return self.linear(out, canonical(i, "attn.o"))

    @staticmethod
    def _key_start(window: int | None, c0: int) -> int:
        """First key position any query of a chunk starting at c0 can see."""
        return max(0, c0 - window + 1) if window else 0

    def _attend(self, a: AttentionSpec, q, k, v, q0: int, k0: int, window, sinks) -> torch.Tensor:
        """q [C, H, Dq] at positions q0.., k [T, Hk, Dq] / v [T, Hk, Dv] at positions k0..q0+C-1 -> [C, H*Dv]."""
        C, H, Dq = q.shape
        T, Dv = k.shape[0], v.shape[-1]
        rep = H // k.shape[1]
        k, v = k.to(self.dtype), v.to(self.dtype)
        if sinks is not None:
            return self._attend_sinks(a, q, k, v, q0, k0, window, sinks, rep)
        kh = k.transpose(0, 1)                                                      # [Hk, T, Dq]
        vh = v.transpose(0, 1)
        if rep > 1:
            kh, vh = kh.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0)
        if Dv != Dq:                                                                # MLA: v padded to q's width
            vh = F.pad(vh, (0, Dq - Dv))
        qh = q.transpose(0, 1).contiguous()[None]                                   # [1, H, C, Dq]
        kh, vh = kh.contiguous()[None], vh.contiguous()[None]
        full = not window or window >= q0 + C                                      # the window hides nothing
        if full and q0 == 0 and T == C:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=a.softmax_scale)
        elif full:
            from torch.nn.attention.bias import causal_lower_right
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(C, T), scale=a.softmax_scale)
        else:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=self._mask(C, T, q0, k0, window),
                                               scale=a.softmax_scale)
        return o[0, ..., :Dv].transpose(0, 1).reshape(C, H * Dv)

    def _mask(self, C: int, T: int, q0: int, k0: int, window) -> torch.Tensor:
        """[C, T] bool: key j (position k0 + j) visible from query i (position q0 + i)."""
        qpos = torch.arange(q0, q0 + C, device=self.device)[:, None]
        kpos = torch.arange(k0, k0 + T, device=self.device)[None, :]
        m = kpos <= qpos
        if window:
            m &= kpos > qpos - window
        return m

    def _attend_sinks(self, a, q, k, v, q0, k0, window, sinks, rep) -> torch.Tensor:
        """Exact softmax with one extra per-head logit (dropped after the softmax), as the reference does, in
        query slices that keep the fp32 score matrix under _SINK_SCORE_BYTES."""
        C, H, _ = q.shape
        T, Dv = k.shape[0], v.shape[-1]
        kf = k.float().repeat_interleave(rep, 1)                                    # [T, H, Dq]
        vf = v.float().repeat_interleave(rep, 1)
        sk = sinks.float()[:, None, None]
        out = torch.empty(C, H, Dv, dtype=self.dtype, device=self.device)
        step = max(1, _SINK_SCORE_BYTES // (4 * H * T))
        for s0 in range(0, C, step):
            s1 = min(C, s0 + step)
            sc = torch.einsum("shd,thd->hst", q[s0:s1].float(), kf) * a.softmax_scale   # [H, s, T]
            sc = sc.masked_fill(~self._mask(s1 - s0, T, q0 + s0, k0, window)[None], float("-inf"))
            sc = torch.cat([sc, sk.expand(-1, s1 - s0, 1)], dim=-1)
            probs = torch.softmax(sc, dim=-1)[..., :-1]
            out[s0:s1] = torch.einsum("hst,thd->shd", probs, vf).to(self.dtype)
        return out.reshape(C, H * Dv)

    # ---- feed-forward ------------------------------------------------------------------------------------------------
    def _mlp(self, i: int, prefix: str, x: torch.Tensor) -> torch.Tensor:
        g = self.linear(x, canonical(i, f"{prefix}.gate"), self.p(i, f"{prefix}.gate_bias"))
        u = self.linear(x, canonical(i, f"{prefix}.up"), self.p(i, f"{prefix}.up_bias"))
        return self.linear(F.silu(g) * u, canonical(i, f"{prefix}.down"), self.p(i, f"{prefix}.down_bias"))

    def _act(self, m: MoESpec, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        if m.expert_act == "swiglu":
            return F.silu(g) * u
        g = g.clamp(max=m.swiglu_limit)
        u = u.clamp(-m.swiglu_limit, m.swiglu_limit)
        return (u + 1) * (g * torch.sigmoid(g * m.glu_alpha))

    def _moe(self, i: int, m: MoESpec, x: torch.Tensor) -> torch.Tensor:
        T, D, k = x.shape[0], x.shape[1], m.top_k
        rb, sb = self.W.tensor(canonical(i, "moe.router_bias")), self.W.tensor(canonical(i, "moe.score_bias"))
        logits = F.linear(x.float(), self.W.tensor(canonical(i, "moe.router")).float(),
                          None if rb is None else rb.float())
        ids, wts = route(m, logits, None if sb is None else sb.float())              # [T, k] each
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)                                    # (token, slot) pairs by expert
        tok = order // k
        eid = flat.index_select(0, order)
        # expert sizes without a host sync (torch.bincount syncs on CUDA to size its output)
        counts = torch.zeros(m.num_experts, dtype=torch.int64, device=self.device).index_add_(
            0, flat, torch.ones_like(flat))
        ys = self._experts(i, m, x.index_select(0, tok), eid, counts)              # [T*k, D], sorted by expert
        yu = torch.empty_like(ys).index_copy_(0, order, ys).view(T, k, D)           # back to (token, slot) order
        # weighted sum over the k slots: one batched [1, k] x [k, D] product per token (fp32 accumulation)
        out = torch.bmm(wts.to(self.dtype)[:, None, :], yu)[:, 0]
        if m.shared_intermediate_size:
            sh = self._mlp(i, "moe.shared", x)
            if m.shared_expert_gate:
                sh = torch.sigmoid(self.linear(x, canonical(i, "moe.shared_gate"))) * sh
            out = out + sh
        return out

    def _expert_groups(self, gate: WeightHandle, up: WeightHandle, down: WeightHandle) -> list[tuple[int, int]]:
        E = gate.num_experts
        if all(float_view(h, self.dtype) is not None for h in (gate, up, down)):
            return [(0, E)]
        eb = torch.empty((), dtype=self.dtype).element_size()
        per = (2 * gate.out_features * gate.in_features + down.out_features * down.in_features) * eb
        G = max(1, min(E, self.scratch_bytes // per))
        return [(e, min(E, e + G)) for e in range(0, E, G)]

    def _expert_weights(self, gate, up, down, e0: int, e1: int):
        """(gate [G, I, D], up [G, I, D], down [G, D, I], fused gate|up [G, 2I, D] or None) of experts e0:e1."""
        fv = [float_view(h, self.dtype) for h in (gate, up, down)]
        if all(t is not None for t in fv):
            return fv[0][e0:e1], fv[1][e0:e1], fv[2][e0:e1], None
        G, I, D = e1 - e0, gate.out_features, gate.in_features
        gu = self.buf("exp_gu", (G, 2 * I, D))
        dequant_into(expert_range(gate, e0, e1), gu[:, :I])
        dequant_into(expert_range(up, e0, e1), gu[:, I:])
        dw = dequant_into(expert_range(down, e0, e1), self.buf("exp_down", (G, down.out_features, I)))
        return gu[:, :I], gu[:, I:], dw, gu

    def _experts(self, i: int, m: MoESpec, xs: torch.Tensor, eid: torch.Tensor, counts: torch.Tensor):
        """Rows of xs sorted by expert (eid [N], counts [E]) through their expert's FFN -> [N, D]."""
        gate, up, down = (self.W.experts(i, p) for p in ("gate", "up", "down"))
        E, I = m.num_experts, m.intermediate_size
        bias = [self.W.expert_bias(i, p, E) for p in ("gate", "up", "down")] if m.expert_bias else [None] * 3
        bias = [None if b is None else b.to(self.dtype) for b in bias]
        groups = self._expert_groups(gate, up, down)
        N, D = xs.shape
        ys = torch.empty(N, down.out_features, dtype=self.dtype, device=self.device)
        grouped = self.grouped and D % 8 == 0 and I % 8 == 0
        host = None
        if len(groups) > 1 or not grouped:
            host = [0] + torch.cumsum(counts, 0).tolist()                            # one sync per layer chunk
        self.stats["moe_path"] = "grouped_mm" if grouped else "loop"
        self.stats["expert_groups"] = len(groups)
        for e0, e1 in groups:
            r0, r1 = (host[e0], host[e1]) if host is not None else (0, N)
            if r1 == r0:
                continue
            wg, wu, wd, gu = self._expert_weights(gate, up, down, e0, e1)
            if grouped:
                try:
                    ys[r0:r1] = self._grouped(m, xs[r0:r1], eid[r0:r1], counts[e0:e1], wg, wu, wd, gu, bias)
                    continue
                except (RuntimeError, NotImplementedError) as err:   # a build / device without the kernel
                    warnings.warn(f"prefill: torch._grouped_mm failed ({err}); looping over experts from now on")
                    self.grouped = grouped = False
                    self.stats.update(moe_path="loop", grouped_mm_error=str(err)[:300])
                    if host is None:
                        host = [0] + torch.cumsum(counts, 0).tolist()
            for e in range(e0, e1):
                a, b = host[e], host[e + 1]
                if a == b:
                    continue
                xe = xs[a:b]
                if gu is not None:
                    h = F.linear(xe, gu[e - e0])
                    g, u = h[:, :I], h[:, I:]
                else:
                    g, u = F.linear(xe, wg[e - e0]), F.linear(xe, wu[e - e0])
                if bias[0] is not None:
                    g, u = g + bias[0][e], u + bias[1][e]
                ys[a:b] = F.linear(self._act(m, g, u), wd[e - e0], None if bias[2] is None else bias[2][e])
        return ys

    def _grouped(self, m: MoESpec, xg, e, counts, wg, wu, wd, gu, bias) -> torch.Tensor:
        """One torch._grouped_mm per matrix for all experts of a group: rows xg [n, D] sorted by expert e [n],
        counts [G] rows per expert."""
        I = m.intermediate_size
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        if gu is not None:
            h = torch._grouped_mm(xg, gu.transpose(-2, -1), offs=offs)
            g, u = h[:, :I], h[:, I:]
        else:
            g = torch._grouped_mm(xg, wg.transpose(-2, -1), offs=offs)
            u = torch._grouped_mm(xg, wu.transpose(-2, -1), offs=offs)
        if bias[0] is not None:
            g, u = g + bias[0].index_select(0, e), u + bias[1].index_select(0, e)
        y = torch._grouped_mm(self._act(m, g, u), wd.transpose(-2, -1), offs=offs)
        return y if bias[2] is None else y + bias[2].index_select(0, e)

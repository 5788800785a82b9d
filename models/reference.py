"""The pure-PyTorch reference decoder: the specification every faster backend must reproduce.

Any ModelSpec, prefill and decode through one `forward(ids)` that appends to a KV cache. Float32 on CPU (bf16 or
fp16 weights are upcast); bf16 allowed on CUDA. Written for reading, not speed: one token's MoE loops over its
top-k experts, attention materialises the score matrix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .rope import apply_rope, cos_sin
from .spec import AttentionSpec, LayerSpec, ModelSpec, MoESpec, canonical


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w, b)


def route(moe: MoESpec, logits: torch.Tensor, score_bias: torch.Tensor | None,
          ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float32) -> (expert ids [T, k], weights [T, k] float32). ids: experts chosen elsewhere
    (e.g. by a lower-precision run, to compare two computations past a router near tie): only their weights."""
    k = moe.top_k
    if moe.scoring == "softmax_topk":                       # gpt-oss: softmax over the chosen logits
        top, ids = torch.topk(logits, k, dim=-1) if ids is None else (logits.gather(1, ids), ids)
        return ids, torch.softmax(top, dim=-1)
    scores = torch.softmax(logits, dim=-1) if moe.scoring == "softmax" else torch.sigmoid(logits)
    if ids is not None:
        return ids, _topk_weights(moe, scores, ids)
    choice = scores + score_bias if score_bias is not None else scores
    if moe.n_group > 1:
        T, E = choice.shape
        grouped = choice.view(T, moe.n_group, E // moe.n_group)
        if moe.group_score == "top2sum":
            gscore = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            gscore = grouped.max(dim=-1).values
        gidx = torch.topk(gscore, moe.topk_group, dim=-1, sorted=False).indices
        gmask = torch.zeros_like(gscore).scatter_(1, gidx, 1.0).bool()
        emask = gmask[:, :, None].expand(T, moe.n_group, E // moe.n_group).reshape(T, E)
        # V3 masks with -inf; V2 with 0 (scores are positive, so the choice is the same)
        choice = choice.masked_fill(~emask, float("-inf") if moe.group_score == "top2sum" else 0.0)
    ids = torch.topk(choice, k, dim=-1, sorted=False).indices
    return ids, _topk_weights(moe, scores, ids)


def _topk_weights(moe: MoESpec, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w = scores.gather(1, ids)
    if moe.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
    return w * moe.routed_scaling_factor


class _LazyWeights:
    """dict-like view: name -> weights.get(name) converted on each access (lm_head falls back to embed)."""

    def __init__(self, weights, device, dtype):
        self.weights, self.device, self.dtype = weights, device, dtype
        self.names = set(weights.names())

    def get(self, name, default=None):
        if name == "lm_head" and name not in self.names:
            name = "embed"
        if name not in self.names:
            return default
        return self.weights.get(name).to(self.device, self.dtype)

    def __getitem__(self, name):
        t = self.get(name)
        if t is None:
            raise KeyError(name)
        return t


class ReferenceDecoder:
    """forward(ids [S]) -> logits [S, V]; positions continue from the cache length."""

    def __init__(self, spec: ModelSpec, weights, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                 lazy: bool = False):
        """lazy: fetch (and convert) each weight from `weights` at every use instead of holding a converted copy --
        for GPU backends whose own weight buffers are the only copy (their prefill runs through this class)."""
        self.spec = spec
        self.group_experts = False    # True: routed experts batched per expert (calibration); False: the oracle's
                                      # per-token loop, summing each token's experts in top-k order as HF does
        self.device = torch.device(device)
        self.dtype = dtype or (torch.float32 if self.device.type == "cpu" else torch.bfloat16)
        if lazy:
            self.w = _LazyWeights(weights, self.device, self.dtype)
        else:
            self.w = {n: weights.get(n).to(self.device, self.dtype) for n in weights.names()}
            if "lm_head" not in self.w:
                self.w["lm_head"] = self.w["embed"]
        self.reset()

    def reset(self):
        self.cache: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.spec.num_layers
        self.pos = 0

    def p(self, i: int, name: str):
        return self.w.get(canonical(i, name))

    # ---- attention -------------------------------------------------------------------------------------
    def _attend(self, a: AttentionSpec, q, k, v, window, sinks, start) -> torch.Tensor:
        """q [S, H, Dq], k [T, H, Dq], v [T, H, Dv] (heads already expanded) -> [S, H*Dv]."""
        S, T = q.shape[0], k.shape[0]
        scores = torch.einsum("shd,thd->hst", q.float(), k.float()) * a.softmax_scale        # [H, S, T]
        qpos = torch.arange(start, start + S, device=q.device)[:, None]
        kpos = torch.arange(T, device=q.device)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos > qpos - window
        scores = scores.masked_fill(~visible[None], float("-inf"))
        if sinks is not None:                                  # extra column per head, dropped after softmax
            scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, S, 1)], dim=-1)
            probs = torch.softmax(scores, dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hst,thd->shd", probs, v.float())
        return out.reshape(S, -1).to(q.dtype)

    def _gqa(self, i: int, lay: LayerSpec, x: torch.Tensor, start: int) -> torch.Tensor:
        a, S = lay.attn, x.shape[0]
        q = linear(x, self.p(i, "attn.q"), self.p(i, "attn.q_bias"))
        k = linear(x, self.p(i, "attn.k"), self.p(i, "attn.k_bias"))
        v = linear(x, self.p(i, "attn.v"), self.p(i, "attn.v_bias"))
        if a.qk_norm == "full":
            q, k = rms_norm(q, self.p(i, "attn.q_norm"), self.spec.norm_eps), rms_norm(k, self.p(i, "attn.k_norm"), self.spec.norm_eps)
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        q = q.view(S, a.num_heads, a.head_dim)
        k = k.view(S, a.num_kv_heads, a.head_dim)
        v = v.view(S, a.num_kv_heads, a.head_dim)
        if a.qk_norm == "head":
            q, k = rms_norm(q, self.p(i, "attn.q_norm"), self.spec.norm_eps), rms_norm(k, self.p(i, "attn.k_norm"), self.spec.norm_eps)
        cos, sin = cos_sin(a.rope, torch.arange(start, start + S, device=x.device))
        q, k = apply_rope(q.float(), cos, sin, a.rope.style).to(x.dtype), apply_rope(k.float(), cos, sin, a.rope.style).to(x.dtype)
        if self.cache[i] is not None:
            k, v = torch.cat([self.cache[i][0], k]), torch.cat([self.cache[i][1], v])
        self.cache[i] = (k, v)
        rep = a.num_heads // a.num_kv_heads
        out = self._attend(a, q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), lay.sliding_window,
                           self.p(i, "attn.sinks"), start)
        return linear(out, self.p(i, "attn.o"), self.p(i, "attn.o_bias"))

    def _mla(self, i: int, lay: LayerSpec, x: torch.Tensor, start: int) -> torch.Tensor:
        a, S, eps = lay.attn, x.shape[0], self.spec.norm_eps
        H, nope, rd, r = a.num_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
        if a.q_lora_rank:
            q = linear(rms_norm(linear(x, self.p(i, "attn.q_a")), self.p(i, "attn.q_a_norm"), eps), self.p(i, "attn.q_b"))
        else:
            q = linear(x, self.p(i, "attn.q"))
        q = q.view(S, H, nope + rd)
        kv = linear(x, self.p(i, "attn.kv_a"))                                   # [S, r + rd]
        latent = rms_norm(kv[:, :r], self.p(i, "attn.kv_a_norm"), eps)          # [S, r]
        cos, sin = cos_sin(a.rope, torch.arange(start, start + S, device=x.device))
        q_pe = apply_rope(q[..., nope:].float(), cos, sin, a.rope.style).to(x.dtype)
        k_pe = apply_rope(kv[:, None, r:].float(), cos, sin, a.rope.style).to(x.dtype)[:, 0]   # [S, rd], shared by heads
        if self.cache[i] is not None:
            latent, k_pe = torch.cat([self.cache[i][0], latent]), torch.cat([self.cache[i][1], k_pe])
        self.cache[i] = (latent, k_pe)
        T = latent.shape[0]
        kvb = linear(latent, self.p(i, "attn.kv_b")).view(T, H, nope + a.v_head_dim)
        k = torch.cat([kvb[..., :nope], k_pe[:, None, :].expand(T, H, rd)], dim=-1)
        qf = torch.cat([q[..., :nope], q_pe], dim=-1)
        out = self._attend(a, qf, k, kvb[..., nope:], lay.sliding_window, None, start)
        return linear(out, self.p(i, "attn.o"))

    # ---- feed-forward ------------------------------------------------------------------------------------
    def _swiglu(self, i: int, prefix: str, x: torch.Tensor) -> torch.Tensor:
        g = linear(x, self.p(i, f"{prefix}.gate"), self.p(i, f"{prefix}.gate_bias"))
        u = linear(x, self.p(i, f"{prefix}.up"), self.p(i, f"{prefix}.up_bias"))
        return linear(F.silu(g) * u, self.p(i, f"{prefix}.down"), self.p(i, f"{prefix}.down_bias"))

    def _expert(self, i: int, moe: MoESpec, e: int, x: torch.Tensor) -> torch.Tensor:
        pre = f"moe.experts.{e}"
        if moe.expert_act == "swiglu":
            return self._swiglu(i, pre, x)
        g = linear(x, self.p(i, f"{pre}.gate"), self.p(i, f"{pre}.gate_bias")).clamp(max=moe.swiglu_limit)
        u = linear(x, self.p(i, f"{pre}.up"), self.p(i, f"{pre}.up_bias")).clamp(-moe.swiglu_limit, moe.swiglu_limit)
        h = (u + 1) * (g * torch.sigmoid(g * moe.glu_alpha))
        return linear(h, self.p(i, f"{pre}.down"), self.p(i, f"{pre}.down_bias"))

    def _moe(self, i: int, moe: MoESpec, x: torch.Tensor) -> torch.Tensor:
        logits = linear(x.float(), self.p(i, "moe.router").float(),
                        None if self.p(i, "moe.router_bias") is None else self.p(i, "moe.router_bias").float())
        bias = self.p(i, "moe.score_bias")
        ids, wts = route(moe, logits, None if bias is None else bias.float())
        out = torch.zeros_like(x)
        if self.group_experts:
            # one call per chosen expert over all its tokens: the same terms, summed in expert order instead of
            # each token's top-k order (models/calibrate.py: 16k tokens in seconds, not a minute)
            for e in torch.unique(ids).tolist():
                tok, slot = (ids == e).nonzero(as_tuple=True)
                y = self._expert(i, moe, e, x[tok]).float() * wts[tok, slot][:, None]
                out.index_add_(0, tok, y.to(x.dtype))
        else:
            for t in range(x.shape[0]):
                for j in range(moe.top_k):
                    out[t] += (self._expert(i, moe, int(ids[t, j]), x[t:t + 1])[0].float() * wts[t, j]).to(x.dtype)
        if moe.shared_intermediate_size:
            sh = self._swiglu(i, "moe.shared", x)
            if moe.shared_expert_gate:
                sh = torch.sigmoid(linear(x, self.p(i, "moe.shared_gate"))) * sh
            out = out + sh
        return out

    # ---- the decoder ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def layer(self, i: int, x: torch.Tensor, start: int) -> torch.Tensor:
        """Decoder layer i on the residual stream x [S, D] at positions start.. (appends to layer i's cache only,
        so calibration can run the stack one layer at a time: models/calibrate.py)."""
        lay, eps = self.spec.layers[i], self.spec.norm_eps
        h = rms_norm(x, self.p(i, "attn_norm"), eps)
        x = x + (self._mla if lay.attn.kind == "mla" else self._gqa)(i, lay, h, start)
        h = rms_norm(x, self.p(i, "mlp_norm"), eps)
        return x + (self._moe(i, lay.moe, h) if lay.moe is not None else self._swiglu(i, "mlp", h))

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [S] int64 -> logits [S, V] float32; extends the KV cache by S positions."""
        spec, start = self.spec, self.pos
        x = self.w["embed"][ids.to(self.device)]
        for i in range(spec.num_layers):
            x = self.layer(i, x, start)
        self.pos += ids.shape[0]
        x = rms_norm(x, self.w["final_norm"], spec.norm_eps)
        return linear(x, self.w["lm_head"]).float()

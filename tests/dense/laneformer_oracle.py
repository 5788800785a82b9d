"""An independent, deliberately plain Laneformer written from the public description (DESIGN.md §5), used as the
test oracle for kie_moe.dense. It shares no code with the package: it reads config.json and the safetensors
files itself, works in float64, loops over lanes, heads and query positions, keeps an explicit history of every
layer's per-lane partials, rotates with complex numbers, and has no KV cache (it recomputes the whole sequence).

The details the description leaves open are settled the same way as in dense/reference.py's docstring: every
lane computes its sublayers on its own full-width copy; sqrt(L) multiplies the lane's own partial; layer i >= d
with use_comm adds the other lanes' partials of layer i - d whatever layer i - d did; pre_norm_lane_agg sums the
lanes then norms with a [D] scale, otherwise each lane is normed with its own final scale and the lanes averaged.
"""
from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import load_file


class OracleLaneformer:
    def __init__(self, model_dir: str):
        self.cfg = c = json.load(open(os.path.join(model_dir, "config.json")))
        self.t = {}
        for f in sorted(os.listdir(model_dir)):
            if f.endswith(".safetensors"):
                self.t.update({k: v.to(torch.float64) for k, v in load_file(os.path.join(model_dir, f)).items()})
        self.L, self.D = c["num_lanes"], c["hidden_size"]
        self.H, self.KV = c["num_attention_heads"], c["num_key_value_heads"]
        self.n, self.d = c["num_hidden_layers"], c["broadcast_delay"]
        self.dh = self.D // self.H
        self.eps = c["norm_eps"]
        self._check_shapes()

    def _check_shapes(self):
        L, D, dh = self.L, self.D, self.dh
        q, kv, f = self.H * dh // L, self.KV * dh // L, self.cfg["intermediate_size"] // L
        for i in range(self.n):
            p = f"model.layers.{i}."
            want = {"attention.wq.weight": (L, q, D), "attention.wk.weight": (L, kv, D), "attention.wv.weight": (L, kv, D),
                    "attention.wo.weight": (L, D, q), "feed_forward.w1.weight": (L, f, D),
                    "feed_forward.w3.weight": (L, f, D), "feed_forward.w2.weight": (L, D, f)}
            for k, s in want.items():
                assert tuple(self.t[p + k].shape) == s, (p + k, self.t[p + k].shape, s)

    # ---- pieces --------------------------------------------------------------------------------------------
    def norm_vector(self, prefix: str, lane: int) -> torch.Tensor:
        if f"{prefix}.weight" in self.t:
            return self.t[f"{prefix}.weight"]                    # shared [D]
        s = self.t[f"{prefix}.scale"]
        return s if s.dim() == 1 else s[lane]                    # per lane [L, D]

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(1, keepdim=True) + self.eps) * w

    def window(self, i: int):
        c = self.cfg
        w, nl = c.get("sliding_window"), c.get("sliding_window_n_layers")
        if not w:
            return None
        unclamped = [u + self.n if u < 0 else u for u in c.get("unclamped_layers") or []]
        if i in unclamped:
            return None
        if nl is None or (nl >= 0 and i < nl) or (nl < 0 and i >= self.n + nl):
            return w
        return None

    def rope(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, heads, dh]: adjacent pairs (2j, 2j+1) as complex numbers times e^(i pos theta^(-2j/dh))."""
        S, nh, dh = x.shape
        theta = self.cfg.get("rope_theta", 10000.0)
        freq = torch.tensor([theta ** (-2.0 * j / dh) for j in range(dh // 2)], dtype=torch.float64)
        rot = torch.polar(torch.ones(S, dh // 2, dtype=torch.float64), torch.arange(S, dtype=torch.float64)[:, None] * freq)
        z = torch.view_as_complex(x.reshape(S, nh, dh // 2, 2).contiguous()) * rot[:, None, :]
        return torch.view_as_real(z).reshape(S, nh, dh)

    def attention(self, i: int, lane: int, h: torch.Tensor) -> torch.Tensor:
        p, S = f"model.layers.{i}.attention", h.shape[0]
        hq, hk, dh = self.H // self.L, self.KV // self.L, self.dh
        q = (h @ self.t[f"{p}.wq.weight"][lane].T).view(S, hq, dh)
        k = (h @ self.t[f"{p}.wk.weight"][lane].T).view(S, hk, dh)
        v = (h @ self.t[f"{p}.wv.weight"][lane].T).view(S, hk, dh)
        q, k = self.rope(q), self.rope(k)
        win = self.window(i)
        allowed = torch.tensor([[j <= s and (win is None or j > s - win) for j in range(S)] for s in range(S)])
        heads = []
        for head in range(hq):
            kvh = head // (hq // hk)                             # this lane's own kv heads only
            sc = (q[:, head] @ k[:, kvh].T) / math.sqrt(dh)      # [S, S]
            sc = torch.where(allowed, sc, torch.tensor(-math.inf, dtype=torch.float64))
            heads.append(torch.softmax(sc, 1) @ v[:, kvh])       # [S, dh]
        return torch.cat(heads, 1) @ self.t[f"{p}.wo.weight"][lane].T        # [S, D]

    def ffn(self, i: int, lane: int, h: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.feed_forward"
        a = h @ self.t[f"{p}.w1.weight"][lane].T
        b = h @ self.t[f"{p}.w3.weight"][lane].T
        return (a * torch.sigmoid(a) * b) @ self.t[f"{p}.w2.weight"][lane].T

    # ---- the model -------------------------------------------------------------------------------------------
    def logits(self, tokens: list[int]) -> torch.Tensor:
        c, L = self.cfg, self.L
        emb = self.t["model.tok_embeddings.weight"]
        lanes = [torch.stack([emb[t] for t in tokens]) for _ in range(L)]        # L x [S, D]
        history = {"attn": [], "ffn": []}                                         # kind -> layer -> L partials
        for i in range(self.n):
            for kind, norm_name in (("attn", "attention_norm"), ("ffn", "ffn_norm")):
                parts = []
                for l in range(L):
                    h = self.rms(lanes[l], self.norm_vector(f"model.layers.{i}.{norm_name}", l))
                    parts.append(self.attention(i, l, h) if kind == "attn" else self.ffn(i, l, h))
                history[kind].append(parts)
                new = []
                for l in range(L):
                    if i < self.d and c["use_early_comm"]:
                        add = sum(parts[m] for m in range(L))
                    elif i >= self.d and c["use_comm"]:
                        old = history[kind][i - self.d]
                        add = parts[l] + sum(old[m] for m in range(L) if m != l)
                    else:
                        add = math.sqrt(L) * parts[l]
                    new.append(lanes[l] + add)
                lanes = new
        if c["pre_norm_lane_agg"]:
            w = self.t.get("model.norm.weight", self.t.get("model.norm.scale"))
            assert w.dim() == 1
            h = self.rms(sum(lanes), w)
        else:
            h = sum(self.rms(lanes[l], self.norm_vector("model.norm", l)) for l in range(L)) / L
        head = self.t.get("lm_head.weight", emb)
        return h @ head.T                                                         # [S, V] float64

    def greedy(self, prompt: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
        """-> new tokens, and the logits a cached decoder would return: prefill [S, V], then [1, V] per step."""
        seq, out = list(prompt), []
        full = self.logits(seq)
        step_logits = [full]
        while True:
            out.append(int(full[-1].argmax()))
            if len(out) == max_new:
                return out, step_logits
            seq.append(out[-1])
            full = self.logits(seq)
            step_logits.append(full[-1:])

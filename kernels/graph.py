"""Backend "graph": a decode step as a sequence of Triton kernel launches, captured once into a CUDA graph and
replayed per token. Prefill runs batched (kernels/prefill.py: grouped expert GEMMs, SDPA attention, reading the
same weight buffers, quantized ones dequantized per layer into scratch) and fills the KV caches these kernels read.

Per step (position and token live on the device, so the graph replays unchanged):
    x = embed[token]                                   (fp32 residual stream [D])
    per layer:  q, k, v = rmsnorm_gemv(x, attn_norm, W_q|W_k|W_v)         (one launch: _fuse_rows; biases fused)
                rope_append(q, k, v -> cache[pos])                        (q/k norm, RoPE, clip fused)
                o = gqa_decode(q, cache, pos)          or the MLA path (absorbed decode)
                (the two as one launch, attention.rope_gqa_decode, unless KIE_FUSED_ROPE_ATTN=0 or OLMoE's
                 full-projection q/k norm: qwen3-30b-a3b fp8 +1.3%, llama-3.2-1b +1.8%, NOTES.md session 9)
                x = W_o o + x
                x = moe_experts(route(x), ...) + x     or dense gemv_glu + gemv, + shared expert
                                                       (fp4 experts read the x8 the router writes)
    logits = rmsnorm_gemv(x, final_norm, lm_head);  token = sample(logits);  pos += 1
Tokens stream back through a pinned host ring, one step behind the device (no host sync inside a step).
"""
from __future__ import annotations

import os
from typing import Iterator

import torch

from kie_moe.models.errors import InputError, Unsupported
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.models.spec import canonical

from .attention import gqa_decode, mla_decode, rope_gqa_decode
from .fp4_mma import pack_for_mma
from .gemv import gemv, gemv_glu, is_fp4, prepare_x8, use_mma
from .moe import (RouterConfig, Routing, fold_router, fold_router_bias, gemv_route, moe_experts, route,
                  use_mma_experts)
from .prefill import Prefill
from .rope import mla_rope_append, rope_append, rope_tables
from .sampling import DeviceSampler, next_step_inputs, next_step_inputs_ref
from .weights import FP8_BLOCK, WeightHandle, dequantize, stored_codes

# RoPE + KV append + decode attention as one launch per layer (attention.rope_gqa_decode; not for OLMoE's
# full-projection q/k norm). On unless KIE_FUSED_ROPE_ATTN=0 (timed: NOTES.md session 9); read at import.
FUSED_ROPE_ATTN = os.environ.get("KIE_FUSED_ROPE_ATTN", "1") != "0"
# q/k/v of fp8_block / mxfp4 / nvfp4 as one launch too (_fuse_rows), and one x8 for unfused fp4 q/k/v; read at
# import, KIE_FUSE_QKV=0 for the A/B (NOTES.md session 14).
FUSE_QKV = os.environ.get("KIE_FUSE_QKV", "1") != "0"
# fp4 inputs handed over in the x8 layout instead of each fp4 GEMV launching prepare_x8 for itself: the routed
# experts (and an fp4 shared expert) read the x8 the router launch writes (route(x8_out=)), an fp4 down projection
# reads its GLU's output written as x8 (gemv_glu(out_x8=)), an fp4 o_proj the attention output written as x8
# (gqa_decode / rope_gqa_decode(out_x8=)); KIE_SHARE_X8=0 for the A/B (NOTES.md session 14).
SHARE_X8 = os.environ.get("KIE_SHARE_X8", "1") != "0"
# Float routed experts (and a float shared expert) read the normed MoE input the router launch writes
# (route(xn_out=)) instead of RMS-norming x in every program: off, as measured in session 20 on an H100 (NOTES.md:
# the expert launch +1-3 points, the decode step 434.3 -> 430.1 tok/s: the router launch's extra writes cost more);
# KIE_ROUTER_XN=1 turns it on.
ROUTER_XN = os.environ.get("KIE_ROUTER_XN", "0") == "1"
# Tensor-core fp4 routed experts (moe.use_mma_experts) read the fp16 xh the router launch writes (route(xh_out=))
# instead of launching prepare_xh themselves: one launch fewer per MoE layer where no fp4 shared expert wants the
# router's x8. On: session 38 measured Mixtral-8x7B nvfp4 256.0 -> 260.9 tok/s (+1.9%), mxfp4 273.6 -> 278.3 (+1.7%)
# on an H100, same tokens for 128 steps (NOTES.md); KIE_ROUTER_XH=0 turns it off.
ROUTER_XH = os.environ.get("KIE_ROUTER_XH", "1") != "0"
# The router launch leaves partial logits and the CUDA-core experts' GLU launch picks the top-k itself (route(defer=
# True), moe_experts(select=)): no last-program ticket + selection tail on the router's critical path (session 20's
# per-launch times: the router is 5.7 us of a ~47 us qwen3-30b-a3b fp8 layer). On: session 21 measured qwen3-30b-a3b
# fp8 434.1 -> 450.3 tok/s, nvfp4 407.9 -> 417.5 on an H100 (NOTES.md); both launches sum the top-k's normaliser in
# one order, so their routing weights are bit-equal (float experts' RMSNorm scale still comes from other sums of x^2,
# ~1 ULP apart: NOTES.md session 21); KIE_SELECT_IN_EXPERTS=0 turns it off.
SELECT_IN_EXPERTS = os.environ.get("KIE_SELECT_IN_EXPERTS", "1") != "0"
# With SELECT_IN_EXPERTS, the router launch is a plain 0.5 MB GEMV between o_proj and the expert GLU (qwen3-30b-a3b
# fp8: ~4 us of a ~46 us layer, session 21), so it is folded into o_proj's launch (moe.gemv_route: extra programs
# stream W_r diag(nw) W_o over the attention output and W_r over nw * the residual; the GLU launch scales the logits
# by its own RMSNorm scale of x'; fp4 experts read nw * x' that o_proj's launch writes as x8 and scale their sums by
# it). Where o_proj is float and the experts run on the CUDA cores. On: session 23 measured qwen3-30b-a3b fp8 447.3
# -> 462.9 tok/s on an H100 (o_proj + router + experts 31.0 -> 29.2 us; NOTES.md). KIE_ROUTER_FOLD=1 (the default)
# keeps the folded rows in the model's dtype (bf16: ~2^-9 relative rounding of each, as HF's bf16 router input has),
# =fp32 in fp32 (2x the bytes, 459.2 tok/s, routing as exact as the router launch's), =0 keeps the router launch.
ROUTER_FOLD = os.environ.get("KIE_ROUTER_FOLD", "1")
# The step's tail in one launch (sampling.next_step_inputs: the draw -> token, pos + 1, x = embed[token] for the next
# step) instead of four torch launches outside the PDL chain (next_step_inputs_ref: clamp, add, gather, copy; until
# session 26 the gather and copy opened the next step), and the token written by the sampler straight into a pinned
# host ring (DeviceSampler(host_ring=True)) instead of a device-to-host copy queued between two graph replays.
# KIE_GRAPH_STEP_TAIL=0 restores the torch launches and the copy for the A/B (NOTES.md session 26).
STEP_TAIL = os.environ.get("KIE_GRAPH_STEP_TAIL", "1") != "0"
# Tensor-core fp4 routed experts (moe.use_mma_experts) stored in packing "mma" (fp4_mma.pack_for_mma, once at
# load), as the quantized lm_head is: the cheaper decode (one AND for the low plane; nvfp4's GLU launch 130 -> 128
# registers, 3 -> 4 programs per SM). KIE_PACK_EXPERTS=0 keeps the checkpoint bytes (NOTES.md session 39).
PACK_EXPERTS = os.environ.get("KIE_PACK_EXPERTS", "1") != "0"
HOST_RING = 64   # tokens the pinned ring holds; the host reads step s - 1 while the device runs step s


class HandleStore:
    """canonical name -> WeightHandle on the device (quantized formats kept as their codes + scales).

    Also a WeightStore-like view (names/get) over the same buffers, so the prefill's reference decoder reads the
    backend's own copy (dequantizing on the fly for quantized formats) instead of holding a second one."""

    def __init__(self, store, device, dtype):
        self.store, self.device, self.dtype = store, device, dtype
        self.h: dict[str, WeightHandle] = {}
        self.dense: dict[str, torch.Tensor] = {}     # views for names served without a handle (norms, biases)

    def handle(self, name: str) -> WeightHandle:
        if name not in self.h:
            q = stored_codes(self.store, name)
            if q is not None:
                self.h[name] = WeightHandle.from_compressed({k: v.to(self.device) for k, v in q.tensors.items()},
                                                            in_features=q.shape[-1])
            else:
                self.h[name] = WeightHandle.from_dense(self.store.get(name).to(self.device, self.dtype).contiguous())
        return self.h[name]

    def stacked(self, names: list[str], key: str) -> WeightHandle:
        """Experts [E, out, in]; each expert's canonical name then reads a view of the stack."""
        return self.put_stack(names, key, WeightHandle.stack([self.handle(n) for n in names]))

    def put_stack(self, names: list[str], key: str, st: WeightHandle) -> WeightHandle:
        """st (e.g. the stack re-packed) as `key`, and its experts' views as `names` (the old stack is then freed)."""
        for e, n in enumerate(names):
            self.h[n] = st.expert(e)
        self.h[key] = st
        return st

    def vec(self, name: str | None) -> torch.Tensor | None:
        if name is None or name not in self.store:
            return None
        if name not in self.dense:
            self.dense[name] = self.store.get(name).to(self.device, torch.float32).contiguous()
        return self.dense[name]

    # WeightStore-like view for the prefill
    def names(self):
        return self.store.names()

    def __contains__(self, name):
        return name in self.store

    def get(self, name):
        h = self.h.get(name)
        if h is None:
            return self.store.get(name)
        if h.fmt in ("bf16", "fp16", "fp32"):
            return h.weight
        return dequantize(h).to(self.dtype)


def _fuse_rows(hs: list[WeightHandle], biases: list) -> tuple[WeightHandle | None, torch.Tensor | None]:
    """q/k/v as one [Nq + 2 Nkv, D] handle (one launch instead of three, and for fp4 one x8 input) when their format
    allows a plain row concatenation: float, fp8 (per-row scales), fp8_block (every part a whole number of
    128-row scale blocks), mxfp4, and nvfp4 whose parts share one global scale (what kie convert and llm-compressor
    write for fused partners: quant.schemes.shared_global_scale); None otherwise (KIE_FUSE_QKV=0: float and fp8
    only, as before session 14)."""
    fmt = hs[0].fmt
    if any(h.fmt != fmt or h.packing != "checkpoint" or h.num_experts for h in hs):
        return None, None
    if fmt not in (("bf16", "fp16", "fp32", "fp8", "fp8_block", "nvfp4", "mxfp4") if FUSE_QKV
                   else ("bf16", "fp16", "fp32", "fp8")):
        return None, None
    if fmt == "fp8_block" and any(h.out_features % FP8_BLOCK for h in hs):
        return None, None
    gs = None
    if fmt == "nvfp4":
        gs = hs[0].global_scale
        if any(not torch.equal(h.global_scale.reshape(-1), gs.reshape(-1)) for h in hs[1:]):
            return None, None
    w = torch.cat([h.weight for h in hs])
    if fmt == "fp8":
        scale = torch.cat([h.scale.expand(h.out_features, 1) for h in hs]).contiguous()
    else:
        scale = None if hs[0].scale is None else torch.cat([h.scale for h in hs])
    h = WeightHandle(fmt, w, scale, gs, w.shape[0], hs[0].in_features)
    b = None if biases[0] is None else torch.cat(biases)
    return h, b


class GraphBackend:
    name = "graph"

    def __init__(self, model, device: torch.device | str = "cuda", dtype: torch.dtype | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # kernels compare devices exactly
            self.device = torch.device("cuda", torch.cuda.current_device())
        # On CPU the same launches run eagerly through Triton's interpreter (tests; no CUDA graph there).
        self.eager = self.device.type != "cuda"
        if self.eager and os.environ.get("TRITON_INTERPRET") != "1":
            raise InputError("graph backend: needs a CUDA GPU (or TRITON_INTERPRET=1 on CPU, for tests)")
        if ROUTER_FOLD not in ("0", "1", "fp32"):
            raise InputError(f"graph backend: KIE_ROUTER_FOLD={ROUTER_FOLD!r}: expected 0, 1 or fp32")
        dtype = dtype or (torch.float32 if self.eager else torch.bfloat16)
        spec = model.spec
        if not hasattr(spec, "layers") or spec.family == "laneformer":
            raise Unsupported(f"graph backend: the {spec.family} family is not supported yet (use monokernel or "
                              "reference)")
        self.spec, self.dtype = spec, dtype
        self.W = W = HandleStore(model.weights, self.device, dtype)
        D, V = spec.hidden_size, spec.vocab_size
        self.embed = model.weights.get("embed").to(self.device, dtype)
        W.dense["embed"] = self.embed
        head = "lm_head" if "lm_head" in model.weights else "embed"
        self.lm_head = W.handle(head)
        if use_mma(self.lm_head, None, None):     # a quantized head on the tensor cores: its codes re-laid once
            self.lm_head = W.h[head] = pack_for_mma(self.lm_head)
        self.layers = []
        for i, lay in enumerate(spec.layers):
            c = lambda n: canonical(i, n)  # noqa: E731
            L = {"spec": lay, "attn_norm": W.vec(c("attn_norm")), "mlp_norm": W.vec(c("mlp_norm"))}
            a = lay.attn
            if a.kind == "gqa":
                for n in ("q", "k", "v", "o"):
                    L[n] = W.handle(c(f"attn.{n}"))
                    L[n + "_bias"] = W.vec(c(f"attn.{n}_bias"))
                L["qkv"], L["qkv_bias"] = _fuse_rows([L["q"], L["k"], L["v"]], [L["q_bias"], L["k_bias"], L["v_bias"]])
                if L["qkv"] is not None:        # the step reads only the fused copy (bytes_per_token counts it once)
                    r0 = 0
                    for n in ("q", "k", "v"):    # and the prefill reads the parts as its row views: one copy held
                        r1 = r0 + L[n].out_features
                        W.h[c(f"attn.{n}")] = L["qkv"].rows(r0, r1)
                        r0 = r1
                        del L[n]
                L["q_norm"], L["k_norm"], L["sinks"] = W.vec(c("attn.q_norm")), W.vec(c("attn.k_norm")), W.vec(c("attn.sinks"))
            else:
                for n in ("q", "q_a", "q_b", "kv_a", "o"):
                    if c(f"attn.{n}") in model.weights:
                        L[n] = W.handle(c(f"attn.{n}"))
                L["q_a_norm"], L["kv_a_norm"] = W.vec(c("attn.q_a_norm")), W.vec(c("attn.kv_a_norm"))
                kvb = W.handle(c("attn.kv_b"))
                L["kv_b"] = kvb.weight if kvb.fmt in ("bf16", "fp16", "fp32") else dequantize(kvb).to(dtype)
            if lay.moe is not None:
                m = lay.moe
                E = m.num_experts
                names = {part: [c(f"moe.experts.{e}.{part}") for e in range(E)] for part in ("gate", "up", "down")}
                for part in ("gate", "up", "down"):
                    L["e_" + part] = W.stacked(names[part], c(f"moe.{part}_stack"))
                # the experts' path, decided once (moe.use_mma_experts; packing "mma" keeps their bytes and layout)
                L["mma_experts"] = use_mma_experts(L["e_gate"], L["e_up"], L["e_down"], m.top_k)
                if PACK_EXPERTS and L["mma_experts"]:
                    for part in ("gate", "up", "down"):   # only the tensor-core experts (and the prefill) read them
                        L["e_" + part] = W.put_stack(names[part], c(f"moe.{part}_stack"), pack_for_mma(L["e_" + part]))
                if m.expert_bias:
                    for part in ("gate", "up", "down"):
                        L["eb_" + part] = torch.stack([W.vec(c(f"moe.experts.{e}.{part}_bias")) for e in range(E)])
                L["router"] = model.weights.get(c("moe.router")).to(self.device, dtype).contiguous()
                W.dense[c("moe.router")] = L["router"]
                L["router_bias"], L["score_bias"] = W.vec(c("moe.router_bias")), W.vec(c("moe.score_bias"))
                L["rcfg"] = RouterConfig(top_k=m.top_k, scoring=m.scoring, norm_topk_prob=m.norm_topk_prob,
                                         routed_scaling_factor=m.routed_scaling_factor, n_group=m.n_group,
                                         topk_group=m.topk_group, group_score="top2" if m.group_score == "top2sum" else "max")
                L["routing"] = Routing(torch.empty(m.top_k, dtype=torch.int32, device=self.device),
                                       torch.empty(m.top_k, dtype=torch.float32, device=self.device),
                                       torch.empty(E, dtype=torch.float32, device=self.device))
                if m.shared_intermediate_size:
                    for part in ("gate", "up", "down"):
                        L["s_" + part] = W.handle(c(f"moe.shared.{part}"))
                    if m.shared_expert_gate:
                        L["s_gate_w"] = W.handle(c("moe.shared_gate"))
            else:
                for part in ("gate", "up", "down"):
                    L["m_" + part] = W.handle(c(f"mlp.{part}"))
                    L["mb_" + part] = W.vec(c(f"mlp.{part}_bias"))
            if self._folds_router(L, lay, D):
                L["router_fold"] = fold_router(L["router"], L["mlp_norm"], L["o"],
                                               torch.float32 if ROUTER_FOLD == "fp32" else None)
                if L.get("o_bias") is not None:    # gpt-oss: o_proj's bias has a logit term of its own
                    L["router_fold_bias"] = fold_router_bias(L["router"], L["mlp_norm"], L["o_bias"])
            self.layers.append(L)
        self.bytes_per_token = self._bytes_per_token()
        self.final_norm = W.vec("final_norm")
        f32 = dict(dtype=torch.float32, device=self.device)
        self.x = torch.zeros(D, **f32)
        self.x2 = torch.zeros(D, **f32)
        self.pos = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.token = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.logits = torch.zeros(V, **f32)
        self.sampler = DeviceSampler(V, self.device, filter=True, ring_size=HOST_RING if STEP_TAIL else 0,
                                     host_ring=STEP_TAIL)
        # the normed MoE input in the x8 layout, written by the router for fp4 experts (one buffer: a CUDA graph
        # records its address)
        self.x8 = torch.zeros(8, D // 8, **f32) if SHARE_X8 and D % 8 == 0 and any(
            lay.moe is not None and is_fp4(L["e_gate"].fmt) for L, lay in zip(self.layers, spec.layers)) else None
        # the same for tensor-core fp4 experts, as prepare_xh's fp16 (ROUTER_XH)
        self.xh = torch.zeros(D, dtype=torch.float16, device=self.device) if any(
            self._router_xh(L, lay) for L, lay in zip(self.layers, spec.layers)) else None
        # the same for float experts, as a plain fp32 [D] vector (ROUTER_XN)
        self.xn = torch.zeros(D, **f32) if ROUTER_XN and any(
            lay.moe is not None and not is_fp4(L["e_gate"].fmt) for L, lay in zip(self.layers, spec.layers)) else None
        self.max_len = 0
        self.graph = None
        self.last_launch = {}

    def _bytes_per_token(self) -> int:
        """Weight + scale bytes one decode step streams: every non-expert handle, top_k/E of each expert stack."""
        n = 0
        for L in self.layers:
            for k, v in L.items():
                if isinstance(v, WeightHandle):
                    frac = L["spec"].moe.top_k / v.num_experts if v.num_experts else 1.0
                    n += int(v.nbytes * frac)
                elif isinstance(v, torch.Tensor) and k in ("router", "router_fold", "kv_b"):
                    n += v.numel() * v.element_size()
        return n + self.lm_head.nbytes

    # ---- buffers that depend on the context length -------------------------------------------------------------
    def _ensure(self, n: int):
        if n <= self.max_len:
            return
        self.max_len = max_len = max(256, 1 << (n - 1).bit_length())
        self.caches = []
        for lay in self.spec.layers:
            a = lay.attn
            if a.kind == "gqa":
                shape = (max_len, a.num_kv_heads, a.head_dim)
                self.caches.append((torch.zeros(shape, dtype=self.dtype, device=self.device),
                                    torch.zeros(shape, dtype=self.dtype, device=self.device)))
            else:
                self.caches.append(torch.zeros(max_len, a.kv_lora_rank + a.qk_rope_head_dim, dtype=self.dtype,
                                               device=self.device))
        a0 = self.spec.layers[0].attn
        self.cos, self.sin = rope_tables(a0.rope, max_len, self.device)
        self.graph = None

    # ---- one decode step: launches only -------------------------------------------------------------------------
    def _attention(self, i, L, a):
        eps = self.spec.norm_eps
        x = self.x
        if a.kind == "gqa":
            if L["qkv"] is not None:
                qkv = gemv(x, L["qkv"], bias=L["qkv_bias"], norm_weight=L["attn_norm"], eps=eps)
                nq, nkv = a.q_size, a.kv_size
                q, k, v = qkv[:nq], qkv[nq:nq + nkv], qkv[nq + nkv:]
            else:   # fp4 parts read one x8 (made once, the norm applied there) instead of one each
                fp4 = [n for n in ("q", "k", "v") if is_fp4(L[n].fmt)]
                x8 = prepare_x8(x, L["attn_norm"], eps) if FUSE_QKV and len(fp4) > 1 else None
                q, k, v = (gemv(x, L[n], bias=L[n + "_bias"], eps=eps,
                                **(dict(x8=x8) if x8 is not None and n in fp4 else dict(norm_weight=L["attn_norm"])))
                           for n in ("q", "k", "v"))
            q, k, v = q.view(a.num_heads, a.head_dim), k.view(a.num_kv_heads, a.head_dim), v.view(a.num_kv_heads, a.head_dim)
            kc, vc = self.caches[i]
            rope_kw = dict(style=a.rope.style, qk_norm=a.qk_norm, q_norm=L["q_norm"], k_norm=L["k_norm"], eps=eps,
                           clip_qkv=a.clip_qkv)
            o8 = self._x8_out(L["o"])      # an fp4 o_proj reads the attention output written as x8
            attn_kw = dict(softmax_scale=a.softmax_scale, window=L["spec"].sliding_window, sinks=L["sinks"],
                           out_x8=o8)
            if FUSED_ROPE_ATTN and a.qk_norm != "full":
                o = rope_gqa_decode(q, k, v, kc, vc, self.pos, self.cos, self.sin, **rope_kw, **attn_kw)
            else:
                rope_append(q, k, v, kc, vc, self.pos, self.cos, self.sin, **rope_kw)
                o = gqa_decode(q, kc, vc, self.pos, **attn_kw)
        else:
            o8 = False
            if "q_a" in L:
                qa = gemv(x, L["q_a"], norm_weight=L["attn_norm"], eps=eps)
                q = gemv(qa, L["q_b"], norm_weight=L["q_a_norm"], eps=eps)
            else:
                q = gemv(x, L["q"], norm_weight=L["attn_norm"], eps=eps)
            kv = gemv(x, L["kv_a"], norm_weight=L["attn_norm"], eps=eps)
            q = q.view(a.num_heads, a.head_dim)
            mla_rope_append(q, kv, self.caches[i], self.pos, self.cos, self.sin, nope=a.qk_nope_head_dim,
                            style=a.rope.style, kv_norm=L["kv_a_norm"], eps=eps)
            o = mla_decode(q, self.caches[i], L["kv_b"], self.pos, nope=a.qk_nope_head_dim, v_head_dim=a.v_head_dim,
                           softmax_scale=a.softmax_scale, window=L["spec"].sliding_window)
        if "router_fold" in L:   # o_proj's launch also writes the MoE router's partial logits (ROUTER_FOLD)
            x8 = self.x8 if is_fp4(L["e_gate"].fmt) else None   # fp4 experts: nw * x' as x8, unscaled
            _, self.pending = gemv_route(o.reshape(-1), L["o"], x, L["router_fold"], L["router"], L["mlp_norm"],
                                         L["rcfg"], bias=L.get("o_bias"), fold_bias=L.get("router_fold_bias"),
                                         router_bias=L["router_bias"], correction_bias=L["score_bias"], eps=eps,
                                         out=self.x2, x8_out=x8, routing=L["routing"])
        else:
            gemv(None if o8 else o.reshape(-1), L["o"], bias=L.get("o_bias"), residual=x, out=self.x2,
                 x8=o if o8 else None)
        self._swap()

    def _ffn(self, L, lay):
        eps, x = self.spec.norm_eps, self.x
        if lay.moe is None:
            h8 = self._x8_out(L["m_down"])
            h = gemv_glu(x, L["m_gate"], L["m_up"], gate_bias=L["mb_gate"], up_bias=L["mb_up"],
                         norm_weight=L["mlp_norm"], eps=eps, out_x8=h8)
            gemv(None if h8 else h, L["m_down"], bias=L["mb_down"], residual=x, out=self.x2, x8=h if h8 else None)
            self._swap()
            return
        m = lay.moe
        xh = self.xh if self._router_xh(L, lay) else None
        x8 = self.x8 if self.x8 is not None and is_fp4(L["e_gate"].fmt) and xh is None else None
        xn = self.xn if self.xn is not None and not is_fp4(L["e_gate"].fmt) else None
        if "router_fold" in L:     # o_proj's launch wrote the partial logits of this x (gemv_route)
            r, defer = self.pending, True
        else:
            defer = SELECT_IN_EXPERTS and not L["mma_experts"]
            r = route(x, L["router"], L["rcfg"], router_bias=L["router_bias"], correction_bias=L["score_bias"],
                      norm_weight=L["mlp_norm"], eps=eps, out=L["routing"], x8_out=x8, xn_out=xn, xh_out=xh,
                      defer=defer)
        act = "gpt_oss" if m.expert_act == "gptoss_glu" else "silu"
        # xn: the router's normed x, so no norm here (residual stays the un-normed x)
        moe_experts(x if xn is None else xn, r.ids, r.weights, L["e_gate"], L["e_up"], L["e_down"], act=act,
                    limit=m.swiglu_limit, alpha=m.glu_alpha, gate_bias=L.get("eb_gate"), up_bias=L.get("eb_up"),
                    down_bias=L.get("eb_down"), residual=x, norm_weight=L["mlp_norm"] if xn is None else None,
                    eps=eps, out=self.x2, x8=x8, select=r if defer else None, mma=L["mma_experts"], xh=xh)
        if m.shared_intermediate_size:
            h8 = self._x8_out(L["s_down"])
            s_xn = xn is not None and not is_fp4(L["s_gate"].fmt)
            h = gemv_glu(xn if s_xn else x, L["s_gate"], L["s_up"], norm_weight=None if s_xn else L["mlp_norm"],
                         eps=eps, x8=x8 if x8 is not None and is_fp4(L["s_gate"].fmt) else None, out_x8=h8)
            sh = gemv(None, L["s_down"], x8=h, out=torch.empty_like(x)) if h8 else gemv(h, L["s_down"])
            if m.shared_expert_gate:
                g = gemv(x, L["s_gate_w"], norm_weight=L["mlp_norm"], eps=eps)
                sh = sh * torch.sigmoid(g)
            self.x2.add_(sh)
        self._swap()

    @staticmethod
    def _folds_router(L: dict, lay, D: int) -> bool:
        """ROUTER_FOLD's layers: a MoE layer whose experts pick the top-k in their GLU launch (select, CUDA cores)
        behind a float o_proj, with the router's RMSNorm (gemv_route's conditions); fp4 experts read the x8 o_proj's
        launch writes (the shared buffer, SHARE_X8), so an fp4 shared expert, which wants the normed x8, keeps the
        router launch."""
        if not (ROUTER_FOLD != "0" and SELECT_IN_EXPERTS and not ROUTER_XN and lay.moe is not None and "o" in L):
            return False
        fp4_shared = "s_gate" in L and is_fp4(L["s_gate"].fmt)
        if is_fp4(L["e_gate"].fmt) and not (SHARE_X8 and D % 8 == 0 and not fp4_shared):
            return False
        return not is_fp4(L["o"].fmt) and L["mlp_norm"] is not None and not L["mma_experts"]

    @staticmethod
    def _router_xh(L: dict, lay) -> bool:
        """ROUTER_XH's layers: a MoE layer whose experts run on the tensor cores (fp4, moe.use_mma_experts) behind
        the router launch (no fold), with no fp4 shared expert (it reads the router's x8)."""
        if not ROUTER_XH or lay.moe is None or "router_fold" in L or not is_fp4(L["e_gate"].fmt):
            return False
        if "s_gate" in L and is_fp4(L["s_gate"].fmt):
            return False
        return L["mma_experts"]

    @staticmethod
    def _x8_out(w: WeightHandle) -> bool:
        """Whether the launch in front of `w` (a GLU before a down projection, attention before o_proj) writes its
        output as x8 (an fp4 GEMV's input layout) for w to read."""
        return SHARE_X8 and is_fp4(w.fmt) and w.in_features % 8 == 0

    def _swap(self):
        """The residual stream ping-pongs between two buffers (the graph records whichever is current), so a
        sublayer's output never needs a copy back."""
        self.x, self.x2 = self.x2, self.x

    def _step(self):
        # x = embed[token] is already there: the previous step's tail (or generate, for the first) wrote it
        for i, (L, lay) in enumerate(zip(self.layers, self.spec.layers)):
            self._attention(i, L, lay.attn)
            self._ffn(L, lay)
        gemv(self.x, self.lm_head, norm_weight=self.final_norm, eps=self.spec.norm_eps, out=self.logits)
        tok = self.sampler(self.logits)
        # -1 (non-finite logits) stays in the sampler's out, which the host reads; the next step embeds a valid id.
        # x is the buffer the step started from (every layer swaps it twice).
        (next_step_inputs if STEP_TAIL else next_step_inputs_ref)(tok, self.token, self.pos, self.embed, self.x)

    # ---- prefill -------------------------------------------------------------------------------------------------
    def prefill(self, ids: list[int]):
        """KV cache positions [0, len(ids)) through the batched prefill (kernels/prefill.py) over this backend's
        own weight buffers; KIE_PREFILL=reference runs the reference decoder's math instead (the oracle, slow)."""
        self._ensure(len(ids) + 1)
        if not ids:
            return
        if os.environ.get("KIE_PREFILL") != "reference":
            if getattr(self, "_prefiller", None) is None:
                self._prefiller = Prefill.for_graph(self)
            self._prefiller(ids, self.caches)
            return
        dec = ReferenceDecoder(self.spec, self.W, self.device, self.dtype, lazy=True)
        dec.forward(torch.tensor(ids, dtype=torch.long, device=self.device))
        n = len(ids)
        for i, (lay, cache) in enumerate(zip(self.spec.layers, dec.cache)):
            if lay.attn.kind == "gqa":
                self.caches[i][0][:n].copy_(cache[0])
                self.caches[i][1][:n].copy_(cache[1])
            else:
                r = lay.attn.kv_lora_rank
                self.caches[i][:n, :r].copy_(cache[0])
                self.caches[i][:n, r:].copy_(cache[1])

    def sampling_fallbacks(self) -> int:
        """The last request's draws whose top-k / top-p fell back to plain temperature sampling (kernels/sampling)."""
        return self.sampler.fallbacks()

    def generate(self, prompt_ids: list[int], p, eos_ids: set[int]) -> Iterator[int]:
        n = len(prompt_ids)
        self._ensure(n + p.max_new_tokens + 1)
        self.prefill(list(prompt_ids[:-1]))
        self.pos.fill_(n - 1)
        self.token.fill_(prompt_ids[-1])
        self.x.copy_(self.embed[prompt_ids[-1]])
        # no seed: a fresh one per request (seed 0 every time gave every unseeded request the same draws)
        self.sampler.configure(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                               seed=p.seed if p.seed is not None else int(torch.randint(0, 2 ** 62, (1,))))
        if self.eager:
            for s in range(p.max_new_tokens):
                self._step()
                tid = int(self.sampler.out[0])
                yield tid
                if tid in eos_ids and not p.ignore_eos:
                    return
            return
        # the sampler's out per step, -1 kept: STEP_TAIL, its own pinned ring (step s in slot s % HOST_RING, written
        # by the kernel); else a copy per step into this one
        ring = self.sampler.ring if STEP_TAIL else torch.zeros(p.max_new_tokens, dtype=torch.int32, pin_memory=True)
        R = ring.numel()
        events = []
        stream = torch.cuda.current_stream(self.device)
        if self.graph is None:
            self._step()                       # step 0 eagerly: compiles every kernel before the capture
            if not STEP_TAIL:
                ring[0:1].copy_(self.sampler.out, non_blocking=True)
            ev = torch.cuda.Event(); ev.record(stream); events.append(ev)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._step()
            self.graph = g
            first = 1
        else:
            first = 0
        for s in range(first, p.max_new_tokens):
            self.graph.replay()
            if not STEP_TAIL:
                ring[s:s + 1].copy_(self.sampler.out, non_blocking=True)
            ev = torch.cuda.Event(); ev.record(stream); events.append(ev)
            if s >= 1:                          # one step behind the device: the next replay is already queued
                events[s - 1].synchronize()
                tid = int(ring[(s - 1) % R])
                yield tid
                if tid in eos_ids and not p.ignore_eos:
                    return
        events[-1].synchronize()
        yield int(ring[(p.max_new_tokens - 1) % R])

"""Monokernel plan: ModelSpec + weights -> packed device buffers + the task table the persistent kernel walks.

Weights. Every float tensor the decode step reads lives in ONE device arena (a 1-D tensor of the weight dtype),
so the kernel takes one pointer and per-layer element offsets (int64: big models pass 2^31 elements) instead of
hundreds of arguments; quantized Linears (fp8 / fp8-block / nvfp4 / mxfp4, one format per Linear kind) live in
qarena.py's buffers instead. Fused partners sit back to back so one task streams them as one matrix: q|k|v rows
form one [Hq*Dh + 2*Hkv*Dh, D] matrix, up rows follow gate rows, expert e's gate of layer i sits at
`egate + e * I * D`. Offsets per layer are the int64 `layers` table [L, NLF] (LF_* columns, -1 = absent); every
group starts on a 64-element boundary, which the kernel asserts (tl.multiple_of) so its loads vectorise.

Tasks. One task = one program's share of one op; the table [T, NF] int32 lists one decode step's tasks in
topological order (F_* columns): opcode, layer, rows (row0, n_rows), kv head or MLA heads, aux (split / expert
slot / LM tile), the counter it waits on with the count it needs per step and a base, the counter it signals,
the offset of its weights (so the first tile's address needs no second lookup). The kernel runs `n_steps`
copies of the table back to back: global task t is step t // T, row t % T, and waits for
`counter >= wcnt * step + wbase`. Counters (NC per layer + LM head + sampler) only grow: nothing is reset
between steps. Every phase waits for the whole previous phase, which also orders every buffer reuse (WAR).

Tile sizes: an op of B bytes becomes ~n_sms * ceil(B / (n_sms * max_task_bytes)) tasks of equal row counts (so
every SM streams about the same bytes in a phase: one task per SM for every op below n_sms * max_task_bytes, by
default 128 KB (512 KB for a Laneformer and for fp4 weights: measured best on the H200), so an op of several waves
gives every program several tasks of which the next one's weights are prefetched while the current one streams),
never smaller than min_task_bytes (a claim + wait costs ~1-2 us).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

import torch

from kie_moe.models.spec import ModelSpec, canonical

from .qarena import FMT_ID, QArena
from .synth import preset_spec, random_fill, random_qfill  # noqa: F401  (preset_spec: re-exported)

# ---- opcodes -------------------------------------------------------------------------------------------------
OP_QKV, OP_ATTN, OP_O, OP_GATEUP, OP_DOWN, OP_ROUTER, OP_EXP_UP, OP_SH_UP, OP_EXP_DOWN, OP_LM, OP_SAMPLE = range(1, 12)
OP_QB, OP_ABSORB, OP_MLA_ATTN, OP_VUP = range(12, 16)   # Multi-head Latent Attention (DeepSeek), see mla.py
OP_REDUCE = 16   # tensor parallel (shard.py): x[rows] += the ranks' partials of one output tile, in rank order
OP_SAMPLE_TILE = 17   # top-k / top-p (runtime: filtered sampling): kernels/sampling.py's tile task over the logits
OP_NAMES = {OP_QKV: "qkv_proj", OP_ATTN: "attention", OP_O: "o_proj", OP_GATEUP: "mlp_gate_up",
            OP_DOWN: "mlp_down", OP_ROUTER: "router", OP_EXP_UP: "expert_gate_up", OP_SH_UP: "shared_gate_up",
            OP_EXP_DOWN: "expert_down", OP_LM: "lm_head", OP_SAMPLE: "sample", OP_QB: "q_b_proj",
            OP_ABSORB: "mla_absorb", OP_MLA_ATTN: "mla_attention", OP_VUP: "mla_v_up", OP_REDUCE: "tp_reduce",
            OP_SAMPLE_TILE: "sample_tile"}

OP_LANE_O, OP_LANE_DOWN, OP_LANE_AGG = range(20, 23)   # Laneformer (lanes.py): output projections of every lane + the
OP_NAMES.update({OP_LANE_O: "lane_o_proj", OP_LANE_DOWN: "lane_down", OP_LANE_AGG: "lane_agg"})  # lane combination
TRACE_W = 9   # int64 fields per traced task (MonokernelBackend.trace; kernels/monokernel/trace.py names them)

# ---- task table columns ----------------------------------------------------------------------------------------
(F_OP, F_LAYER, F_ROW0, F_NROWS, F_AUX, F_WAIT, F_WCNT, F_WBASE, F_SIG, F_WLO, F_WHI, F_XCTR, F_XWAIT) = range(13)
NF = 16   # one 64-byte row (13 fields + 3 zero pads): the kernel's claim loads it as one power-of-two vector
# F_XCTR (tensor-parallel plans): the KCCL counter, in every rank's symmetric region, that a put task signals on
# each rank (o_proj / down / expert_down tiles, LM-head tiles); REDUCE and the sampler wait on theirs (F_WAIT).
# F_XWAIT (tensor-parallel Laneformer, lanes.py): a second wait of a lane output task, on the KCCL counter of the
# same tile of layer i - d (the other ranks' delayed partials), TP signals per step; -1 none. Lane plans put only
# where F_XCTR >= 0.
# F_WLO / F_WHI: the element offset of the task's (first) weight matrix, lo 31 bits + hi: the prefetch address
# comes straight from the task row, not from a second (dependent) load of the layer table

# ---- layer table columns (int64 element offsets into the weight arena) ------------------------------------------
(LF_ATTN_NORM, LF_QKV, LF_QKV_B, LF_Q_NORM, LF_K_NORM, LF_O, LF_O_B, LF_SINKS, LF_MLP_NORM,
 LF_GATE, LF_UP, LF_DOWN, LF_ROUTER, LF_ROUTER_B, LF_SCORE_B,
 LF_EGATE, LF_EUP, LF_EDOWN, LF_EGATE_B, LF_EUP_B, LF_EDOWN_B,
 LF_SGATE, LF_SUP, LF_SDOWN, LF_SH_GATE, LF_WINDOW) = range(26)
# quantized Linears (qarena.py): LF_QKV & co hold byte offsets of the codes; these hold scale / row-factor offsets
(LF_QKV_S, LF_QKV_F, LF_O_S, LF_O_F, LF_GATE_S, LF_GATE_F, LF_DOWN_S, LF_DOWN_F, LF_EGATE_S, LF_EGATE_F,
 LF_EUP_S, LF_EUP_F, LF_EDOWN_S, LF_EDOWN_F, LF_SGATE_S, LF_SGATE_F, LF_SDOWN_S, LF_SDOWN_F) = range(26, 44)
# MLA: LF_QKV = [q_a | kv_a] (or [q | kv_a]) rows, LF_Q_NORM = q_a_norm, LF_K_NORM = kv_a_norm, and
LF_QB, LF_KVB = 44, 45
NLF = 48
# Linears by quantization kind (one format per kind: the FMT_ATTN / FMT_MLP / FMT_EXP constexprs)
QKINDS = {"attn": ("attn.q", "attn.k", "attn.v", "attn.o"), "mlp": ("mlp.gate", "mlp.up", "mlp.down"),
          "exp": ("moe.experts.", "moe.shared.gate", "moe.shared.up", "moe.shared.down")}


def qkind(name: str) -> str | None:
    """'layers.3.moe.experts.7.up' -> 'exp'; None for tensors that always stay float (norms, router, ...)."""
    local = name.split(".", 2)[2] if name.startswith("layers.") else name
    for kind, prefixes in QKINDS.items():
        for p in prefixes:
            if local == p or (p.endswith(".") and local.startswith(p) and local.rsplit(".", 1)[1] in
                              ("gate", "up", "down")):
                return kind
    return None

# counters per layer: inputs of q/k/v ready -> ... ; see `_counter`
_C_QKV, _C_ATTN, _C_O, _C_ROUTE, _C_UP, _C_OUT, _C_QB, _C_ABS, _C_VUP, _C_OSENT, _C_DSENT = range(11)
NC = 11   # counters per layer (the last two: tensor-parallel put tasks, which nobody waits on locally)
_ALIGN = 64  # elements: every tensor starts on a 128-byte boundary (bf16) for vector loads
MLA_HEADS = 16  # heads per MLA attention task: its tl.dot tiles need >= 16 rows


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


@dataclass(frozen=True)
class Dims:
    """Model-wide sizes and feature switches: the kernel's constexprs (one compiled variant per model)."""
    D: int
    V: int
    L: int
    HQ: int
    HKV: int
    DH: int
    ROT: int
    ROPE_PAIR: int          # 1: adjacent pairs (DeepSeek); 0: rotate-half
    QK_NORM: int            # 0 none, 1 per head over Dh, 2 over the whole projection (OLMoE)
    HAS_QKV_BIAS: int
    HAS_O_BIAS: int
    HAS_SINKS: int
    HAS_CLIP: int
    I_DENSE: int
    E: int
    TOPK: int
    I_MOE: int
    I_SH: int
    SCORING: int            # 0 softmax, 1 sigmoid, 2 softmax over the top-k logits (gpt-oss)
    NORM_TOPK: int
    HAS_RBIAS: int
    HAS_SBIAS: int
    EXP_ACT: int            # 0 SwiGLU, 1 gpt-oss clamped GLU
    HAS_EBIAS: int
    HAS_SH_GATE: int
    # runtime floats
    eps: float
    sm_scale: float
    clip: float
    route_scale: float
    glu_limit: float
    glu_alpha: float
    # DeepSeek: Multi-head Latent Attention (HQ heads, HKV = 1 latent; DH = NOPE + ROT), group-limited routing
    MLA: int = 0
    R_Q: int = 0            # q_lora_rank (0: q straight from x)
    R_KV: int = 0
    NOPE: int = 0
    VD: int = 0
    NG: int = 1             # expert groups, groups kept, group score (0 max, 1 sum of the top 2)
    TG: int = 1
    GSCORE: int = 0
    # Laneformer (lanes.py; LANES 0: another family): lanes, broadcast delay, early / delayed communication, per-lane
    # norm scales, final aggregation before the norm (pre_norm_lane_agg)
    LANES: int = 0
    DELAY: int = 0
    EARLY_COMM: int = 0
    USE_COMM: int = 0
    LANE_NORM: int = 0
    PRE_AGG: int = 0
    # weight formats per Linear kind (0 float, else qarena.FMT_ID)
    FMT_ATTN: int = 0
    FMT_MLP: int = 0
    FMT_EXP: int = 0
    # tensor parallel over TP ranks (shard.py; 0: an unsharded plan). 1 is a real sharded plan of one rank: the
    # same put / signal / wait / reduce tasks as N ranks, into its own symmetric region
    TP: int = 0
    # tensor-parallel Laneformer: lanes of the whole model (LANES: this rank's); 0 = LANES (unsharded)
    LANES_ALL: int = 0
    # expert parallelism (shard.py, expert_split "ep"): this rank stores experts [E_LO, E_LO + E_LOC) of E whole;
    # a routed slot whose expert lives elsewhere streams nothing here (its rank adds it through the all-reduce)
    E_LO: int = 0
    E_LOC: int = 0          # 0: all E (no expert parallelism)

    @property
    def NQKV(self) -> int:
        """Rows of the first attention GEMV: q|k|v, or (MLA) q_a|kv_a (q|kv_a without a q LoRA)."""
        if self.MLA:
            return (self.R_Q or self.HQ * self.DH) + self.R_KV + self.ROT
        return (self.HQ + 2 * self.HKV) * self.DH


def model_dims(spec: ModelSpec) -> Dims:
    lay0 = spec.layers[0]
    a = lay0.attn
    if a.kind not in ("gqa", "mla"):
        raise NotImplementedError(f"monokernel: attention kind {a.kind!r} ({spec.family}) is not supported")
    for i, lay in enumerate(spec.layers):
        if lay.attn != a:
            raise NotImplementedError(f"monokernel: layer {i} attention differs from layer 0 ({spec.family})")
        if lay.mlp is not None and lay.mlp.bias:
            raise NotImplementedError(f"monokernel: layer {i}: dense MLP biases are not supported")
        if lay.mlp is not None and lay.mlp.act != "silu":
            raise NotImplementedError(f"monokernel: layer {i}: dense MLP activation {lay.mlp.act!r}")
    dense = {lay.mlp.intermediate_size for lay in spec.layers if lay.mlp is not None}
    moes = {lay.moe for lay in spec.layers if lay.moe is not None}
    if len(dense) > 1 or len(moes) > 1:
        raise NotImplementedError("monokernel: dense (or MoE) layers of different shapes in one model")
    m = next(iter(moes)) if moes else None
    if m is not None and m.n_group > 1 and m.num_experts % m.n_group:
        raise NotImplementedError(f"monokernel: {m.num_experts} experts in {m.n_group} groups")
    mla = a.kind == "mla"
    scoring = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}
    if m is not None and m.scoring not in scoring:
        raise NotImplementedError(f"monokernel: router scoring {m.scoring!r}")
    d = Dims(
        D=spec.hidden_size, V=spec.vocab_size, L=spec.num_layers, HQ=a.num_heads,
        HKV=1 if mla else a.num_kv_heads,
        DH=a.head_dim, ROT=a.rope.rotary_dim or a.head_dim, ROPE_PAIR=int(a.rope.style == "pair"),
        QK_NORM={None: 0, "head": 1, "full": 2}[a.qk_norm], HAS_QKV_BIAS=int(a.qkv_bias), HAS_O_BIAS=int(a.o_bias),
        HAS_SINKS=int(a.sinks), HAS_CLIP=int(a.clip_qkv is not None),
        I_DENSE=next(iter(dense)) if dense else 0,
        E=m.num_experts if m else 0, TOPK=m.top_k if m else 0, I_MOE=m.intermediate_size if m else 0,
        I_SH=m.shared_intermediate_size if m else 0, SCORING=scoring[m.scoring] if m else 0,
        NORM_TOPK=int(m.norm_topk_prob) if m else 0, HAS_RBIAS=int(m.router_bias) if m else 0,
        HAS_SBIAS=int(m.score_correction_bias) if m else 0,
        EXP_ACT={"swiglu": 0, "gptoss_glu": 1}[m.expert_act] if m else 0, HAS_EBIAS=int(m.expert_bias) if m else 0,
        HAS_SH_GATE=int(m.shared_expert_gate) if m else 0,
        eps=spec.norm_eps, sm_scale=a.softmax_scale, clip=float(a.clip_qkv or 0.0),
        route_scale=m.routed_scaling_factor if m else 1.0, glu_limit=m.swiglu_limit if m else 0.0,
        glu_alpha=m.glu_alpha if m else 0.0,
        MLA=int(mla), R_Q=(a.q_lora_rank or 0) if mla else 0, R_KV=a.kv_lora_rank if mla else 0,
        NOPE=a.qk_nope_head_dim if mla else 0, VD=a.v_head_dim if mla else 0,
        NG=m.n_group if m else 1, TG=m.topk_group if m else 1,
        GSCORE=int(m.group_score == "top2sum") if m else 0)
    if getattr(spec, "family", None) == "laneformer":
        from .lanes import lane_dims
        d = lane_dims(spec, d)
    return d


@dataclass
class Arena:
    """Layout of the weight arena: canonical name -> (element offset, shape)."""
    size: int = 0
    entries: dict = field(default_factory=dict)

    def add(self, names_shapes: list[tuple[str, tuple[int, ...]]]) -> int:
        """Place tensors back to back (a fused group) at the next aligned offset; returns the group's offset."""
        off = -(-self.size // _ALIGN) * _ALIGN
        start = off
        for name, shape in names_shapes:
            self.entries[name] = (off, tuple(shape))
            off += math.prod(shape)
        self.size = off
        return start


@dataclass(frozen=True)
class TileConfig:
    """Per-op rows per tile chunk (BLOCK_N, a power of two) and the shared K step."""
    block_k: int
    bn: dict           # op name -> BLOCK_N
    block_t: int       # attention positions per step
    block_p: int       # >= number of LM-head tiles
    xb: int = 0        # x as a broadcast tile in the weight layout (stream.x_load) instead of a broadcast row
    ns: int = 0        # > 0: tl.range(num_stages=ns) pipelined weight loads instead of the explicit double buffer


@dataclass
class Plan:
    spec: ModelSpec
    dims: Dims
    device: torch.device
    wdtype: torch.dtype
    arena: Arena
    weights: torch.Tensor            # [arena.size] wdtype
    layers: torch.Tensor             # [L, NLF] int64
    embed_off: int
    lm_off: int
    final_norm_off: int
    n_sms: int                       # programs in the grid (SMs x programs_per_sm)
    tiles: TileConfig
    op_rows: dict                    # op name -> list[(row0, n_rows)] (static tilings)
    layers_host: torch.Tensor | None = None   # the same table on the CPU
    qarena: QArena | None = None              # quantized Linears (one format), and their device buffers
    qbufs: dict | None = None
    tp_rank: int = 0                          # tensor parallel (dims.TP > 0): this rank, and the layout of
    tp_tiles: int = 0                         # its symmetric region (sym_layout)
    programs_per_sm: int = 1                  # persistent programs per SM (n_sms counts all of them)

    def sym_layout(self) -> dict:
        """Tensor-parallel plans: int32-word offsets in a rank's symmetric region (the same on every rank).
        recv_o / recv_d [TP, D]: row q = rank q's partial of an o_proj / (expert) down output; pv / pi
        [TP, n_lm]: every rank's LM-head tile maxima; ctr: the KCCL counters (F_XCTR), per (layer, attn | mlp,
        tile) and one for the LM head."""
        n, D, L = self.dims.TP, self.dims.D, self.spec.num_layers
        if self.dims.LANES:
            from .lanes import lane_sym_layout
            return lane_sym_layout(self)
        pv = 2 * n * D
        ctr = pv + 2 * n * self.n_lm_tiles
        return dict(recv_o=0, recv_d=n * D, pv=pv, pi=pv + n * self.n_lm_tiles, ctr=ctr,
                    n_ctr=2 * L * self.tp_tiles + 1, words=ctr + 2 * L * self.tp_tiles + 1)

    def names(self) -> list[str]:
        return list(self.arena.entries) + (list(self.qarena.entries) if self.qarena else [])

    def view(self, name: str) -> torch.Tensor:
        """A float tensor of the plan: an arena view, or a dequantized copy of a quantized Linear."""
        if self.qarena is not None and name in self.qarena.entries:
            return self.qarena.dequant(self.qbufs, name)
        off, shape = self.arena.entries[name]
        return self.weights[off:off + math.prod(shape)].view(shape)

    def elem_bytes(self, kind: str | None) -> float:
        """Bytes per weight element streamed by a Linear kind (codes + scales), for tiling and bandwidth."""
        f = {"attn": self.dims.FMT_ATTN, "mlp": self.dims.FMT_MLP, "exp": self.dims.FMT_EXP}.get(kind, 0)
        return {0: self.weights.element_size(), 1: 1.0, 2: 1.0 + 4 / 128, 3: 0.5 + 1 / 16, 4: 0.5 + 1 / 32}[f]

    @property
    def n_lm_tiles(self) -> int:
        return len(self.op_rows["lm"])

    def op_bytes_per_step(self) -> dict[str, float]:
        """Weight bytes one decode step streams per op kind (OP_NAMES; active experts only), for trace.summarize.
        MLA's kv_b split between absorb and v_up is counted whole under mla_absorb."""
        d, eb = self.dims, self.weights.element_size()
        ab, mb, xb = (self.elem_bytes(k) for k in ("attn", "mlp", "exp"))
        out: dict[str, float] = {}

        def add(name, n):
            out[name] = out.get(name, 0.0) + n
        nq = d.HQ * d.DH
        for lay in self.spec.layers:
            if d.MLA:
                add("qkv_proj", d.NQKV * d.D * eb)
                add("q_b_proj", nq * d.R_Q * eb)
                add("mla_absorb", d.HQ * (d.NOPE + d.VD) * d.R_KV * eb)
                add("o_proj", d.D * d.HQ * d.VD * eb)
            elif d.LANES:
                add("qkv_proj", d.NQKV * d.D * eb)
                add("lane_o_proj", d.D * nq * eb)
            else:
                add("qkv_proj", d.NQKV * d.D * ab)
                add("o_proj", d.D * nq * ab)
            if lay.moe is None:
                add("mlp_gate_up", 2 * d.I_DENSE * d.D * (eb if d.LANES else mb))
                add("lane_down" if d.LANES else "mlp_down", d.I_DENSE * d.D * (eb if d.LANES else mb))
            else:
                add("router", d.E * d.D * eb)
                add("expert_gate_up", d.TOPK * 2 * d.I_MOE * d.D * xb)
                if d.I_SH:
                    add("shared_gate_up", 2 * d.I_SH * d.D * xb)
                add("expert_down", (d.TOPK * d.I_MOE + d.I_SH) * d.D * xb)
        add("lm_head", d.V * d.D * eb)
        return out

    def weight_bytes_per_token(self) -> int:
        """Bytes one decode step streams (active experts only; codes + scales), for bandwidth numbers."""
        return int(sum(self.op_bytes_per_step().values()))


# ---- arena layout ----------------------------------------------------------------------------------------------

def layout_arena(spec: ModelSpec, d: Dims, has, qa: QArena | None = None) -> tuple[Arena, list[dict], dict]:
    """-> (arena, per-layer {LF_*: offset}, top-level offsets). `has(name)` says if the checkpoint holds a tensor.
    Linears of a kind whose FMT_* is quantized go to `qa` instead (codes / scales / row-factor offsets)."""
    if d.LANES:
        from .lanes import lane_layout
        return lane_layout(spec, d)
    ar = Arena()
    D = d.D
    fmt = {"attn": d.FMT_ATTN, "mlp": d.FMT_MLP, "exp": d.FMT_EXP}

    def lin(o, col, kind, group, s_col=None, f_col=None):
        """A fused group of Linears: in the float arena, or (quantized kind) in qa."""
        if fmt[kind]:
            o[col], o[s_col], o[f_col] = qa.add(group)
        else:
            o[col] = ar.add(group)

    top = {"embed": ar.add([("embed", (d.V, D))])}
    top["final_norm"] = ar.add([("final_norm", (D,))])
    top["lm_head"] = ar.add([("lm_head", (d.V, D))]) if has("lm_head") else top["embed"]
    layers = []
    for i, lay in enumerate(spec.layers):
        c = lambda n: canonical(i, n)  # noqa: E731
        o = {LF_ATTN_NORM: ar.add([(c("attn_norm"), (D,))]), LF_MLP_NORM: ar.add([(c("mlp_norm"), (D,))])}
        nq, nkv = d.HQ * d.DH, d.HKV * d.DH
        if d.MLA:   # always float (the absorbed attention reads kv_b directly)
            first = [(c("attn.q_a"), (d.R_Q, D))] if d.R_Q else [(c("attn.q"), (nq, D))]
            o[LF_QKV] = ar.add(first + [(c("attn.kv_a"), (d.R_KV + d.ROT, D))])
            if d.R_Q:
                o[LF_Q_NORM] = ar.add([(c("attn.q_a_norm"), (d.R_Q,))])
                o[LF_QB] = ar.add([(c("attn.q_b"), (nq, d.R_Q))])
            o[LF_K_NORM] = ar.add([(c("attn.kv_a_norm"), (d.R_KV,))])
            o[LF_KVB] = ar.add([(c("attn.kv_b"), (d.HQ * (d.NOPE + d.VD), d.R_KV))])
            o[LF_O] = ar.add([(c("attn.o"), (D, d.HQ * d.VD))])
        else:
            lin(o, LF_QKV, "attn", [(c("attn.q"), (nq, D)), (c("attn.k"), (nkv, D)), (c("attn.v"), (nkv, D))],
                LF_QKV_S, LF_QKV_F)
        if d.HAS_QKV_BIAS:
            o[LF_QKV_B] = ar.add([(c("attn.q_bias"), (nq,)), (c("attn.k_bias"), (nkv,)), (c("attn.v_bias"), (nkv,))])
        if d.QK_NORM:
            full = d.QK_NORM == 2
            o[LF_Q_NORM] = ar.add([(c("attn.q_norm"), (nq if full else d.DH,))])
            o[LF_K_NORM] = ar.add([(c("attn.k_norm"), (nkv if full else d.DH,))])
        if not d.MLA:
            lin(o, LF_O, "attn", [(c("attn.o"), (D, nq))], LF_O_S, LF_O_F)
        if d.HAS_O_BIAS:
            o[LF_O_B] = ar.add([(c("attn.o_bias"), (D,))])
        if d.HAS_SINKS:
            o[LF_SINKS] = ar.add([(c("attn.sinks"), (d.HQ,))])
        if lay.moe is None:
            I = lay.mlp.intermediate_size
            # up rows follow gate rows: the kernel finds up at gate + I rows
            lin(o, LF_GATE, "mlp", [(c("mlp.gate"), (I, D)), (c("mlp.up"), (I, D))], LF_GATE_S, LF_GATE_F)
            lin(o, LF_DOWN, "mlp", [(c("mlp.down"), (D, I))], LF_DOWN_S, LF_DOWN_F)
        else:
            E, I = d.E, d.I_MOE
            o[LF_ROUTER] = ar.add([(c("moe.router"), (E, D))])
            if d.HAS_RBIAS:
                o[LF_ROUTER_B] = ar.add([(c("moe.router_bias"), (E,))])
            if d.HAS_SBIAS:
                o[LF_SCORE_B] = ar.add([(c("moe.score_bias"), (E,))])
            ex = lambda e, n: c(f"moe.experts.{e}.{n}")  # noqa: E731
            own = range(d.E_LO, d.E_LO + (d.E_LOC or E))   # the stored experts (all, or this rank's: EP)
            lin(o, LF_EGATE, "exp", [(ex(e, "gate"), (I, D)) for e in own], LF_EGATE_S, LF_EGATE_F)
            lin(o, LF_EUP, "exp", [(ex(e, "up"), (I, D)) for e in own], LF_EUP_S, LF_EUP_F)
            lin(o, LF_EDOWN, "exp", [(ex(e, "down"), (D, I)) for e in own], LF_EDOWN_S, LF_EDOWN_F)
            if d.HAS_EBIAS:
                o[LF_EGATE_B] = ar.add([(ex(e, "gate_bias"), (I,)) for e in own])
                o[LF_EUP_B] = ar.add([(ex(e, "up_bias"), (I,)) for e in own])
                o[LF_EDOWN_B] = ar.add([(ex(e, "down_bias"), (D,)) for e in own])
            if d.I_SH:
                lin(o, LF_SGATE, "exp", [(c("moe.shared.gate"), (d.I_SH, D)), (c("moe.shared.up"), (d.I_SH, D))],
                    LF_SGATE_S, LF_SGATE_F)
                lin(o, LF_SDOWN, "exp", [(c("moe.shared.down"), (D, d.I_SH))], LF_SDOWN_S, LF_SDOWN_F)
                if d.HAS_SH_GATE:
                    o[LF_SH_GATE] = ar.add([(c("moe.shared_gate"), (1, D))])
        o[LF_WINDOW] = lay.sliding_window or 0
        layers.append(o)
    return ar, layers, top


def detect_formats(spec: ModelSpec, names, quantized) -> dict:
    """{kind: FMT} from the quantized tensors present: every Linear of a kind quantized in one scheme, or none."""
    by_kind: dict[str, set] = {}
    for n in names:
        k = qkind(n)
        if k is None:
            continue
        q = quantized(n) if quantized is not None else None
        by_kind.setdefault(k, set()).add(None if q is None else q.scheme)
    out = {}
    for k, schemes in by_kind.items():
        if len(schemes) > 1:
            raise NotImplementedError(f"monokernel: {k} Linears mix formats {sorted(map(str, schemes))}; one "
                                      "format per kind (attention / dense MLP / experts) is supported (the graph "
                                      "backend takes this model: --backend graph, or auto, which moves on to it)")
        sch = next(iter(schemes))
        out[k] = 0 if sch is None else FMT_ID[sch]
    quant = {f for f in out.values() if f}
    if len(quant) > 1:
        raise NotImplementedError(f"monokernel: one quantized format per model, got {sorted(quant)}")
    return out


# ---- tiling ----------------------------------------------------------------------------------------------------

def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The environment variable `name` (else `default`), one of `choices`; anything else is refused naming it."""
    v = os.environ.get(name, default)
    if v not in choices:
        raise ValueError(f"{name}={v!r}: expected {', '.join(choices[:-1])} or {choices[-1]}")
    return v


def env_flag(name: str, default: bool) -> bool:
    """A 0 / 1 switch from the environment (env_choice: anything else is refused naming it)."""
    return env_choice(name, "1" if default else "0", ("0", "1")) == "1"


TASK_KB_OPS = ("qkv", "o", "lm", "gateup", "down", "router", "exp_up", "exp_down", "sh_up")


def task_kb_overrides(text: str | None = None) -> dict[str, int]:
    """KIE_TASK_KB (or text): an op's own max task size in KB, "exp_up:256,lm:512" (ops: TASK_KB_OPS), over the
    plan's one max_task_bytes; so one op's tasks can be sized without moving the others'."""
    text = os.environ.get("KIE_TASK_KB", "") if text is None else text
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        op, _, kb = item.partition(":")
        if op not in TASK_KB_OPS or not kb.isdigit() or int(kb) < 1:
            raise ValueError(f"KIE_TASK_KB: {item!r} is not op:KB with op one of {', '.join(TASK_KB_OPS)} and KB a "
                             f"positive integer")
        out[op] = int(kb)
    return out


def split_rows(n_rows: int, row_bytes: int, n_sms: int, min_task_bytes: int, max_task_bytes: int,
               groups: int = 1) -> list[tuple[int, int]]:
    """Rows [0, n_rows) -> equal (row0, n) tiles. `groups` ops of this shape run side by side (expert slots):
    the task count is chosen for all of them together."""
    total = n_rows * row_bytes * groups
    waves = max(1, -(-total // (n_sms * max_task_bytes)))
    # groups > 1: round down, so all groups' tasks fit the waves (136 = 8 x 17 expert tasks on 132 programs would
    # make a few programs run two in a row, and the phase would last two task times)
    n_tasks = max(1, n_sms * waves // groups) if groups > 1 else n_sms * waves
    n_tasks = max(1, min(n_tasks, n_rows, max(1, total // groups // max(1, min_task_bytes))))
    per = -(-n_rows // n_tasks)
    return [(r, min(per, n_rows - r)) for r in range(0, n_rows, per)]


def _bn(rows: list[tuple[int, int]], cap: int) -> int:
    return min(_pow2(max(n for _, n in rows)), cap)


# ---- the plan ------------------------------------------------------------------------------------------------------

# How the monokernel occupies an SM on the GPU. In isolation one 8-warp program per SM streams a task at 35-48% of
# the probe (fp8 gate/up, benchmarks/stream_probe.py), 2 x 4 warps at 59% and 4 x 4 at 77%: independent programs
# hide each other's load latency and barriers (more warps in one program do not: 1 x 16, 28%). In the whole
# kernel (H200, 2026-12-03, benchmarks/NOTES.md) the extra programs pay off only for a dense model: llama-3.2-1b
# bf16 490 -> 550 tok/s at 2 x 4; qwen3-30b-a3b fp8 134 -> 112 (2 x 4) / 103 (4 x 4): its phases are one small
# task per program, and each extra task repeats the routing, claim, wait and signal. All programs must fit the
# SM's 64K registers (launch_maxnreg) and 228 KB of shared memory (tile_elems) for the cooperative launch.
def gpu_programs_per_sm(d: Dims) -> int:
    return 1 if (d.E or d.LANES or d.MLA) else 2


def fp4_mma_tasks(d: Dims) -> bool:
    """Whether the monokernel runs its nvfp4 / mxfp4 Linears on the tensor cores (mma8.py's WK 3 / 4, fp4_mma's loop;
    KIE_MONO_FP4_MMA, default on): one GPU, no lanes or MLA, every K those tasks read a multiple of 32 (whole
    16-byte pieces and nvfp4 scale pairs). The routed experts' down task has its own condition (fp4_mma_down).
    H100, session 40 (qwen3-30b-a3b): nvfp4 197.7 -> 296.7 tok/s, mxfp4 260.7 -> 316.7."""
    fmts = (d.FMT_ATTN, d.FMT_MLP if d.I_DENSE else -1, d.FMT_EXP if d.E and d.I_MOE else -1)
    return (env_flag("KIE_MONO_FP4_MMA", True) and any(f >= 3 for f in fmts) and not d.LANES and not d.MLA
            and not d.TP and not d.E_LOC and d.D % 32 == 0 and (d.HQ * d.DH) % 32 == 0 and d.I_DENSE % 32 == 0)


def route_in_o(d: Dims) -> bool:
    """Whether a MoE layer's router runs inside its o_proj tasks (KIE_ROUTE_IN_O, default on; 0: the router tasks
    and the ROUTE_ONCE ticket, its A/B: H100, qwen3-30b-a3b fp8 302.4 -> 317.4 tok/s, +5.0%, session 41): each
    o_proj task, once its rows of x are final, adds their share of the router's logits W_r (nw * x) and of
    sum(x^2) into the layer's int64 fixed-point accumulator (ops.route_partial: integer sums, so the result does
    not depend on the order the tasks finish in), and the expert gate / up tasks wait on o_proj and pick the
    top-k from it; the router tasks and their phase (8.1 us of qwen3-30b-a3b's 70 us per layer, H100 trace of
    session 37) are gone, for a longer o_proj task (4.2 -> 5.6 us) and a top-k in every gate / up task (2.6 us).
    One GPU, no lanes (tensor / expert parallel ranks keep the router tasks)."""
    return env_flag("KIE_ROUTE_IN_O", True) and d.E > 0 and not d.TP and not d.E_LOC and not d.LANES


def fused_down(d: Dims) -> bool:
    """Whether a routed expert's down projection runs inside its gate / up tasks (KIE_FUSE_DOWN=1; experiment, off
    until measured): each task adds its h rows' share W_down[e][:, rows] h[rows] (weighted) into x by atomics
    (fused_down.py), so a MoE layer has no expert down tasks and one phase fewer. Needs the router inside o_proj
    (route_in_o: its tasks also copy x for the experts' input), no shared expert, float or per-channel fp8 experts."""
    return (env_flag("KIE_FUSE_DOWN", False) and route_in_o(d) and d.I_MOE > 0 and d.I_SH == 0
            and d.FMT_EXP in (0, 1))


def fused_down_aligned(d: Dims, exp_up_rows) -> bool:
    """fused_down.expert_down_cols' AL: I_MOE and every gate / up task's first row and row count multiples of 16."""
    return d.I_MOE % 16 == 0 and all(r0 % 16 == 0 and n % 16 == 0 for r0, n in exp_up_rows)


def fp4_mma_down(d: Dims) -> bool:
    """Whether the routed experts' down task (and the shared expert's down rows with it) runs on the tensor cores
    for fp4 experts: fp4_mma_tasks, I_MOE and I_SH multiples of 32 (KIE_MONO_FP8_MMA_DOWN=0: its A/B)."""
    return (fp4_mma_tasks(d) and d.E > 0 and d.I_MOE > 0 and d.FMT_EXP >= 3 and d.I_MOE % 32 == 0
            and d.I_SH % 32 == 0 and env_flag("KIE_MONO_FP8_MMA_DOWN", True))


def fp4_packed(d: Dims, name: str) -> bool:
    """Whether the fp4 Linear `name` is stored in packing "mma" (kernels/weights.mma_bytes: fp4_mma's decode with
    one AND for the low plane, 15.7 instead of 17.7 SASS per word): only where every reader is a tensor-core task
    (the shared expert's gate / up stream on the CUDA cores). KIE_MONO_FP4_PACK=0: checkpoint bytes (its A/B)."""
    kind = qkind(name)
    fmt = {"attn": d.FMT_ATTN, "mlp": d.FMT_MLP, "exp": d.FMT_EXP}.get(kind, 0)
    if fmt < 3 or not fp4_mma_tasks(d) or not env_flag("KIE_MONO_FP4_PACK", True):
        return False
    if kind != "exp":
        return True
    if name.endswith(".down"):
        return fp4_mma_down(d)
    return ".moe.experts." in name


def fp4_packed_names(d: Dims, names) -> frozenset:
    """The quantized Linears among `names` stored in packing "mma" (fp4_packed): qarena.packed."""
    return frozenset(n for n in names if fp4_packed(d, n))


GPU_TILE_ELEMS = {1: 16384, 2: 8192, 3: 4096, 4: 4096}     # programs per SM -> elements per weight tile
# ... except a plan whose fp4 Linears stream on the CUDA cores (not fp4_mma_tasks) at one program per SM: twice the
# rows per tile (every op; fp4 ops still get half of it, cap() in build_plan), the decode's issue rate being their
# limit (more rows per loaded x and scale
# step). H100 (monokernel_bench, qwen3-30b-a3b, same tokens): nvfp4 168.2 -> 198.6 tok/s (+18%, session 39's
# --sweep) though ptxas spills 136 B of stack there (offline sm_90, 255 registers; 16384: none); mxfp4 179.9 ->
# 206.9 (+15%, session 40).
GPU_TILE_ELEMS_FP4 = {3: 32768, 4: 32768}                # FMT (qtile.py: 3 nvfp4, 4 mxfp4) -> elements per tile
# ... and such an mxfp4 plan without cp.async stages (plain loads, the explicit double buffer): H100, session 40,
# qwen3-30b-a3b mxfp4 at 32768 tiles 206.9 -> 259.7 tok/s (+26%), same tokens; nvfp4's 197.5 -> 195.5 (so it keeps 3).
GPU_NUM_STAGES_MXFP4 = 0
GPU_BLOCK_T = 32                                         # attention positions per step, at most


def launch_warps(programs_per_sm: int) -> int:
    return 8 if programs_per_sm == 1 else 4


def launch_maxnreg(programs_per_sm: int, num_warps: int) -> int | None:
    """Registers per thread that let `programs_per_sm` programs of `num_warps` warps share an SM's 64K (None:
    ptxas' own 255 fits)."""
    n = 65536 // (programs_per_sm * num_warps * 32) // 8 * 8
    return None if n >= 255 else n


def build_plan(spec: ModelSpec, weights=None, device: str | torch.device = "cpu", *,
               wdtype: torch.dtype | None = None, n_sms: int | None = None, block_k: int | None = None,
               tile_elems: int | None = None, block_t: int | None = None, min_task_bytes: int = 16 << 10,
               x_bcast: bool = False, max_task_bytes: int | None = None, random_seed: int | None = None,
               quantized=None, formats: dict | None = None, programs_per_sm: int | None = None,
               num_stages: int | None = None, tp: tuple[int, int] | None = None,
               experts: tuple[int, int] | None = None) -> Plan:
    """Pack `weights` (WeightStore-like: names(), get(canonical), `in`) into device buffers and tile every op.

    quantized: callable(canonical name) -> quant.schemes.QuantizedTensor | None, the codes of Linears stored
    quantized (default: quant.ingest's reader when `weights` is a quantized checkpoint's store). One format per
    Linear kind (attention / dense MLP / experts), one quantized format per model; router, embeddings, LM head,
    norms and biases stay float. weights=None with random_seed: random weights drawn on the device (benchmarks;
    no host copy), in `formats` ({kind: "fp8" | "fp8-block" | "nvfp4" | "mxfp4"}) where given.
    programs_per_sm: persistent programs per SM (the grid; tiles are sized for all of them); default
    gpu_programs_per_sm(dims) on the GPU, with tile_elems / block_t from GPU_TILE_ELEMS / GPU_BLOCK_T so that
    they all fit the SM (the backend takes launch_warps / launch_maxnreg).
    num_stages: > 0 pipelines each task's weight loads with tl.range(num_stages) (cp.async into shared memory:
    sm_90 compile, [16 x 1024] bf16 tiles, 3 stages: 78 KB of shared memory, no spills); 0: a register double
    buffer. Default 3 on the GPU.
    tp: (rank, world): `spec` / `weights` are rank `rank`'s shard (shard.py: its heads, MLP and expert columns,
    the whole LM head, of which it streams only its vocab piece) and the task table gets the KCCL tasks.
    experts: (first, count): expert parallelism, `weights` hold only these experts (whole; global names)."""
    device = torch.device(device)
    d = model_dims(spec)
    gpu = device.type in ("cuda", "meta")  # meta: an offline compile for the GPU
    if programs_per_sm is None:
        programs_per_sm = gpu_programs_per_sm(d) if gpu else 1
    if wdtype is None:
        wdtype = torch.bfloat16 if gpu else torch.float32
    if n_sms is None:
        n_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    n_sms *= programs_per_sm   # from here on: programs in the grid
    names = set(weights.names()) if weights is not None else None
    if weights is not None and quantized is None:
        quantized = _default_quantized(weights)
    fm = detect_formats(spec, sorted(names), quantized) if names is not None else {}
    fm.update({k: FMT_ID[v] for k, v in (formats or {}).items() if v not in (None, "bf16", "float")})
    if d.MLA:
        fm["attn"] = 0   # MLA's Linears stay float (a quantized checkpoint's store dequantizes them on read)
    d = dataclasses.replace(d, FMT_ATTN=fm.get("attn", 0), FMT_MLP=fm.get("mlp", 0), FMT_EXP=fm.get("exp", 0),
                            TP=tp[1] if tp else 0)
    if experts is not None:
        if not d.E or not (0 <= experts[0] and experts[1] > 0 and experts[0] + experts[1] <= d.E):
            raise ValueError(f"monokernel: experts {experts} outside the model's {d.E}")
        d = dataclasses.replace(d, E_LO=experts[0], E_LOC=experts[1])
    if tp and d.QK_NORM == 2:
        raise NotImplementedError("monokernel tensor parallel: whole-projection q/k norms are not split yet")
    qfmt = max(fm.values(), default=0)
    if d.LANES and qfmt:
        raise NotImplementedError("monokernel laneformer: float weights only (quantized Linears are not planned yet)")
    if d.LANES and tp:   # `spec` is rank tp[0]'s shard (lanes.shard_lanes): LANES of its own, of LANES * world
        d = dataclasses.replace(d, LANES_ALL=d.LANES * tp[1])
    qa = QArena(qfmt) if qfmt else None
    has = (lambda n: n in names) if names is not None else (lambda n: not spec.tie_word_embeddings)
    arena, lay_offs, top = layout_arena(spec, d, has, qa)
    if qa is not None:
        qa.packed = fp4_packed_names(d, qa.entries)
    buf = torch.empty(arena.size, dtype=wdtype, device=device)
    qbufs = qa.allocate(device) if qa is not None else None
    if weights is not None:
        missing = [n for n in arena.entries if n not in names]
        if missing:
            raise KeyError(f"monokernel: weights lack {missing[:3]} (expected by the {spec.family} layout)")
        for name, (off, shape) in arena.entries.items():
            t = weights.get(name)
            if tuple(t.shape) != shape:
                raise ValueError(f"monokernel: {name} has shape {tuple(t.shape)}, the plan expects {shape}")
            buf[off:off + t.numel()].copy_(t.reshape(-1))
        for name in (qa.entries if qa is not None else ()):
            qa.fill(qbufs, name, quantized(name))
    elif device.type != "meta":  # meta: shapes and dtypes only (offline compiles)
        random_fill(buf, arena, random_seed or 0)
        if qa is not None:
            random_qfill(qa, qbufs, random_seed or 0)
    table = torch.full((spec.num_layers, NLF), -1, dtype=torch.int64)
    for i, o in enumerate(lay_offs):
        for k, v in o.items():
            table[i, k] = v

    # ---- tiles: bytes per row of each op (weights + scales; activations are KB) ----
    eb = buf.element_size()
    qb = {k: Plan.elem_bytes(_FmtView(d, buf), k) for k in ("attn", "mlp", "exp")}
    if block_k is None:
        block_k = 1024 if gpu else min(128, _pow2(max(d.D, d.HQ * d.DH, d.I_DENSE, d.I_MOE, d.I_SH)))
    if tile_elems is None:
        # elements per [BLOCK_N, BLOCK_K] weight tile buffer; a program holds two per matrix (double buffering),
        # gate/up ops two matrices, so they get half. 16384 fits sm_90's 255 registers without spills (offline
        # ptxas); larger tiles put more bytes in flight but spill (benchmarks/monokernel_bench.py --sweep).
        tile_elems = GPU_TILE_ELEMS.get(programs_per_sm, 4096) if gpu else 64 * block_k
        fp4 = [GPU_TILE_ELEMS_FP4[f] for f in (d.FMT_ATTN, d.FMT_MLP, d.FMT_EXP) if f in GPU_TILE_ELEMS_FP4]
        if gpu and programs_per_sm == 1 and fp4 and not fp4_mma_tasks(d):
            tile_elems = max(fp4)
    if max_task_bytes is None:
        # H200, 2026-12-03 (benchmarks/NOTES.md): 128 KB tasks beat 512 KB on llama-3.2-1b bf16 (+8.6%) and
        # qwen3-30b-a3b fp8 (+12%), but cost qwen3 nvfp4 2.5% (fp4 tiles are ALU-bound: more tasks, more per-task
        # decode set-up) and the Laneformer 17% (its lane ops read every lane's rows per task)
        max_task_bytes = (512 if d.LANES or max(d.FMT_ATTN, d.FMT_MLP, d.FMT_EXP) >= 3 else 128) << 10
    # The LM head's tasks are at least 512 KB (session 33, H100, qwen3-30b-a3b fp8: 128 -> 512 KB +3.0%, tokens
    # equal): with the late claim every task pays one exposed claim, and its 4,748 tasks of 131 KB per step paid
    # it most (KIE_TASK_KB=lm:N still sets it). The routed experts' gate / up tasks are at least 256 KB (session 34,
    # H100, qwen3-30b-a3b: 128 -> 256 KB fp8 256.2 -> 270.9 tok/s, bf16 180.9 -> 192.0; nvfp4 already 512): one
    # wave of 48-row tasks (128 of them for 132 programs) instead of two of 24 rows, so each task's fixed start (its
    # expert id, x's staging, the first loads: ~4.7 us) is paid once per layer and program (KIE_TASK_KB=exp_up:128
    # the old size).
    op_kb = {"lm": max(512, max_task_bytes >> 10), "exp_up": max(256, max_task_bytes >> 10), **task_kb_overrides()}
    # (an op's own max task size, KIE_TASK_KB, else the plan's)
    sp = lambda n, rb, g=1, op=None: split_rows(n, int(rb), n_sms, min_task_bytes,  # noqa: E731
                                                op_kb[op] << 10 if op in op_kb else max_task_bytes, g)
    o_in = d.HQ * (d.VD if d.MLA else d.DH)
    rows = {"qkv": sp(d.NQKV, d.D * qb["attn"], op="qkv"), "o": sp(d.D, o_in * qb["attn"], op="o"),
            "lm": sp(d.V, d.D * eb, op="lm")}
    if tp:   # this rank's vocab piece [rank * per, (rank + 1) * per) of the whole LM head; as many tiles on every
        per = -(-d.V // tp[1])   # rank (the last piece may be short: its tail tiles are empty)
        lo = tp[0] * per
        rows["lm"] = [(min(lo + r0, d.V), max(0, min(lo + r0 + n, d.V) - min(lo + r0, d.V)))
                      for r0, n in sp(per, d.D * eb)]
    if d.MLA:   # "rows" of the head-wise ops are heads
        if d.R_Q:
            rows["qb"] = sp(d.HQ * d.DH, d.R_Q * eb)
        rows["absorb"] = sp(d.HQ, d.NOPE * d.R_KV * eb)
        rows["vup"] = sp(d.HQ, d.VD * d.R_KV * eb)
        rows["mla_attn"] = [(h, min(MLA_HEADS, d.HQ - h)) for h in range(0, d.HQ, MLA_HEADS)]
    if d.I_DENSE:
        rows["gateup"] = sp(d.I_DENSE, 2 * d.D * qb["mlp"], op="gateup")
        rows["down"] = sp(d.D, d.I_DENSE * qb["mlp"], op="down")
    if d.LANES:   # q|k|v and gate|up tiles of one lane each; the final lane aggregation's tiles
        from .lanes import agg_rows, lane_rows
        lane_rows(d, rows, {"qkv": d.D * eb, "gateup": 2 * d.D * eb}, n_sms, min_task_bytes, max_task_bytes)
        rows["lane_agg"] = agg_rows(d, n_sms)
    if d.E:
        rows["router"] = sp(d.E, d.D * eb, op="router")
        rows["exp_up"] = sp(d.I_MOE, 2 * d.D * qb["exp"], d.TOPK, op="exp_up")
        rows["exp_down"] = sp(d.D, (d.TOPK * d.I_MOE + d.I_SH) * qb["exp"], op="exp_down")
        if d.I_SH:
            rows["sh_up"] = sp(d.I_SH, 2 * d.D * qb["exp"], op="sh_up")
    pairs = ("gateup", "exp_up", "sh_up")
    kind = {"qkv": "attn", "o": "attn", "gateup": "mlp", "down": "mlp", "exp_up": "exp", "exp_down": "exp",
            "sh_up": "exp"}
    fmt_of = {"attn": d.FMT_ATTN, "mlp": d.FMT_MLP, "exp": d.FMT_EXP}

    def cap(op):
        # fp4 tiles decode to fp32 beside a broadcast x tile: half the elements of the others
        elems = tile_elems // (2 if fmt_of.get(kind.get(op), 0) >= 3 else 1)
        return max(1, elems // block_k // (2 if op in pairs else 1))
    bn = {k: _bn(v, cap(k)) for k, v in rows.items() if k not in ("absorb", "vup", "mla_attn")}
    if d.LANES:   # lane output ops step K by a lane's share (lanes.lane_block_k)
        from .lanes import lane_block_k
        bn.update(lane_block_k(d, block_k, tile_elems, rows))
    if d.MLA:   # rows of kv_b per step of the absorb / v-up ops ([BN_KVB, R_KV] tiles)
        bn["kvb"] = max(1, min(_pow2(max(d.NOPE, d.VD)), tile_elems // _pow2(d.R_KV)))
    if block_t is None:
        # attention walks the cache in [BLOCK_T, Dh] tl.dot tiles (>= 16 rows): fewer, larger blocks cut the
        # dependent load round trips of a short context; K and V tiles of a block stay <= 8 fp32 per thread
        # (offline sm_90: [32, 64] spills at 2 x 4 warps, [16, 64] does not; [32, 64] at 1 x 8 does not)
        block_t = 16
        if gpu:
            threads = 32 * launch_warps(programs_per_sm)
            block_t = 32 if d.MLA else max(16, min(GPU_BLOCK_T, 8 * threads // _pow2(d.DH)))
    if num_stages is None:
        num_stages = 3 if gpu else 0
        if gpu and programs_per_sm == 1 and 4 in (d.FMT_ATTN, d.FMT_MLP, d.FMT_EXP) and not fp4_mma_tasks(d):
            num_stages = GPU_NUM_STAGES_MXFP4
    tiles = TileConfig(block_k=block_k, bn=bn, block_t=block_t, block_p=_pow2(len(rows["lm"]) * max(1, d.TP)),
                       xb=int(x_bcast), ns=num_stages)
    tp_tiles = max(len(rows[k]) for k in ("o", "down", "exp_down") if k in rows) if tp else 0
    return Plan(spec, d, device, wdtype, arena, buf, table.to(device), top["embed"], top["lm_head"],
                top["final_norm"], n_sms, tiles, rows, table, qa, qbufs, tp[0] if tp else 0, tp_tiles,
                programs_per_sm)


@dataclass
class _FmtView:
    """Just enough of a Plan for Plan.elem_bytes before the plan exists."""
    dims: Dims
    weights: torch.Tensor


def _default_quantized(weights):
    """The codes of Linears the store holds quantized (kernels.weights.stored_codes), else None: all float."""
    from kie_moe.kernels.weights import stored_codes
    if not (hasattr(weights, "quantized_tensor") or hasattr(getattr(weights, "source", None), "read_quantized")):
        return None
    return lambda name: stored_codes(weights, name)


# ---- the task table --------------------------------------------------------------------------------------------------

def counter_index(layer: int, kind: int) -> int:
    return layer * NC + kind


def n_counters(spec: ModelSpec) -> int:
    return spec.num_layers * NC + 4   # + LM head, sampler, Laneformer's lane aggregation, filtered-sampling tiles


def emit_sample(emit, after, L: int, sample_tiles: int):
    """The step's last phase on one GPU: OP_SAMPLE after every LM-head tile; with sample_tiles > 0 (top-k / top-p:
    the LM tiles store logits) first that many OP_SAMPLE_TILE tasks (vocab tile in aux) after the LM head, and
    OP_SAMPLE after them. emit / after: the builder's own (build_tasks, lanes.build_lane_tasks)."""
    c_lm, c_sample, c_tiles = NC * L, NC * L + 1, NC * L + 3
    if sample_tiles:
        for t in range(sample_tiles):
            emit(OP_SAMPLE_TILE, L - 1, 0, 0, t, *after(c_lm), c_tiles)
        emit(OP_SAMPLE, L - 1, 0, 0, 0, *after(c_tiles), c_sample)
    else:
        emit(OP_SAMPLE, L - 1, 0, 0, 0, *after(c_lm), c_sample)


def build_tasks(plan: Plan, n_splits: int = 1, sample_tiles: int = 0, rin_o: bool | None = None,
                fuse_dn: bool | None = None) -> torch.Tensor:
    """One decode step's tasks [T, NF] int32 in topological order (every wait points at earlier tasks).
    sample_tiles: emit_sample's (one GPU only). rin_o: route_in_o (default: from the environment): no router tasks;
    a MoE layer's o_proj tasks carry aux 1 (add the router partials) and its expert gate / up tasks wait on them.
    fuse_dn: fused_down (default: from the environment; needs rin_o): no expert down tasks, the gate / up tasks
    signal the layer's output counter."""
    if sample_tiles and plan.dims.TP:
        raise ValueError("build_tasks: filtered sampling (sample_tiles) is single-GPU only")
    if plan.dims.LANES:
        from .lanes import build_lane_tasks
        return build_lane_tasks(plan, n_splits, sample_tiles)
    d, spec = plan.dims, plan.spec
    L = spec.num_layers
    c_lm, c_sample = NC * L, NC * L + 1
    if rin_o is None:
        rin_o = route_in_o(d)
    if fuse_dn is None:
        fuse_dn = fused_down(d)
    if fuse_dn and not rin_o:
        raise ValueError("build_tasks: fuse_dn (KIE_FUSE_DOWN) needs the router inside o_proj (rin_o)")
    rows: list[list[int]] = []
    count: dict[int, int] = {}

    lt = plan.layers_host
    wcol = {OP_QKV: LF_QKV, OP_O: LF_O, OP_GATEUP: LF_GATE, OP_DOWN: LF_DOWN, OP_ROUTER: LF_ROUTER,
            OP_SH_UP: LF_SGATE, OP_QB: LF_QB, OP_ABSORB: LF_KVB, OP_VUP: LF_KVB}

    def emit(op, layer, r0, n, aux, wait, wcnt, wbase, sig, xctr=0):
        w = plan.lm_off if op == OP_LM else int(lt[layer, wcol[op]]) if op in wcol else 0
        rows.append([op, layer, r0, n, aux, wait, wcnt, wbase, sig, w & 0x7FFFFFFF, w >> 31, xctr, -1, 0, 0, 0])
        count[sig] = count.get(sig, 0) + 1

    tp, T = d.TP, plan.tp_tiles
    xc_lm = 2 * L * T

    def xc(layer, kind, tile):   # KCCL counter of (layer, 0 = attention | 1 = mlp, output tile)
        return (layer * 2 + kind) * T + tile

    def put_and_reduce(op, i, op_rows, wait, kind, sig_done, aux=0):
        """Unsharded: the op adds into x and signals sig_done. Tensor parallel: each tile computes its partial,
        puts it into every rank's recv row (its own included) and signals their KCCL counter of that tile; then
        one REDUCE per tile waits for all TP partials of it and adds them to x in rank order."""
        if not tp:
            for r0, n in op_rows:
                emit(op, i, r0, n, aux, *wait, sig_done)
            return
        sent = counter_index(i, _C_OSENT if kind == 0 else _C_DSENT)
        for t, (r0, n) in enumerate(op_rows):
            emit(op, i, r0, n, aux, *wait, sent, xc(i, kind, t))
        for t, (r0, n) in enumerate(op_rows):
            emit(OP_REDUCE, i, r0, n, kind, xc(i, kind, t), tp, tp, sig_done)

    def after(ctr):  # wait for every signal `ctr` gets in this step
        return ctr, count[ctr], count[ctr]

    prev = (c_sample, 1, 0)  # layer 0 waits for the previous step's sample (step 0: already satisfied)
    for i, lay in enumerate(spec.layers):
        C = lambda k: counter_index(i, k)  # noqa: E731
        for r0, n in plan.op_rows["qkv"]:
            emit(OP_QKV, i, r0, n, 0, *prev, C(_C_QKV))
        if d.MLA:
            # q_b (with q_a's norm) -> absorb kv_b's k-part into q (+ RoPE, + the token's latent into the cache)
            # -> attention over the latent cache -> kv_b's v-part -> o_proj
            q_ready = C(_C_QKV)
            if d.R_Q:
                for r0, n in plan.op_rows["qb"]:
                    emit(OP_QB, i, r0, n, 0, *after(C(_C_QKV)), C(_C_QB))
                q_ready = C(_C_QB)
            for h0, nh in plan.op_rows["absorb"]:
                emit(OP_ABSORB, i, h0, nh, 0, *after(q_ready), C(_C_ABS))
            for h0, nh in plan.op_rows["mla_attn"]:
                for s in range(n_splits):
                    emit(OP_MLA_ATTN, i, h0, nh, s, *after(C(_C_ABS)), C(_C_ATTN))
            for h0, nh in plan.op_rows["vup"]:
                emit(OP_VUP, i, h0, nh, 0, *after(C(_C_ATTN)), C(_C_VUP))
            o_wait = after(C(_C_VUP))
        else:
            for g in range(d.HKV):
                for s in range(n_splits):
                    emit(OP_ATTN, i, g, s, 0, *after(C(_C_QKV)), C(_C_ATTN))
            o_wait = after(C(_C_ATTN))
        put_and_reduce(OP_O, i, plan.op_rows["o"], o_wait, 0, C(_C_O), aux=int(rin_o and lay.moe is not None))
        if lay.moe is None:
            for r0, n in plan.op_rows["gateup"]:
                emit(OP_GATEUP, i, r0, n, 0, *after(C(_C_O)), C(_C_UP))
            put_and_reduce(OP_DOWN, i, plan.op_rows["down"], after(C(_C_UP)), 1, C(_C_OUT))
        else:
            if not rin_o:
                for r0, n in plan.op_rows["router"]:
                    emit(OP_ROUTER, i, r0, n, 0, *after(C(_C_O)), C(_C_ROUTE))
            for r0, n in plan.op_rows.get("sh_up", []) if d.I_SH else []:
                emit(OP_SH_UP, i, r0, n, 0, *after(C(_C_O)), C(_C_UP))
            up_sig = C(_C_OUT if fuse_dn else _C_UP)   # (fused: the gate / up tasks finish the layer)
            for j in range(d.TOPK):
                for r0, n in plan.op_rows["exp_up"]:
                    emit(OP_EXP_UP, i, r0, n, j, *after(C(_C_O if rin_o else _C_ROUTE)), up_sig)
            if not fuse_dn:
                put_and_reduce(OP_EXP_DOWN, i, plan.op_rows["exp_down"], after(C(_C_UP)), 1, C(_C_OUT))
        prev = after(C(_C_OUT))
    for t, (r0, n) in enumerate(plan.op_rows["lm"]):
        emit(OP_LM, L - 1, r0, n, t, *prev, c_lm, xc_lm)
    if tp:   # every rank's tile maxima, through KCCL (the LM tiles put them into every rank's pv / pi)
        n_lm = plan.n_lm_tiles * tp
        emit(OP_SAMPLE, L - 1, 0, 0, 0, xc_lm, n_lm, n_lm, c_sample)
    else:
        emit_sample(emit, after, L, sample_tiles)
    return torch.tensor(rows, dtype=torch.int32)


def split_tasks(base: torch.Tensor, n_splits: int) -> torch.Tensor:
    """build_tasks(plan, n_splits) from build_tasks(plan, 1), without the Python builder: it takes ~0.2 s for
    qwen3's 37 K tasks and ran at the first launch of every new attention split count (a request that reaches a
    longer context paid it in its latency). Every attention task (OP_ATTN: split in F_NROWS; OP_MLA_ATTN: split in
    F_AUX) becomes n_splits copies, splits 0..n_splits-1 in place, and the tasks that wait on a layer's attention
    counter (o_proj; MLA's v-up) need n_splits times its signals. Dense, MoE, MLA and tensor-parallel tables; the
    Laneformer's (lanes.py) are built by its own builder. tests/monokernel/test_plan.py: equal to build_tasks."""
    if n_splits == 1:
        return base
    op = base[:, F_OP]
    rep = torch.where((op == OP_ATTN) | (op == OP_MLA_ATTN), n_splits, 1)
    t = base.repeat_interleave(rep, dim=0)
    first = (torch.cumsum(rep, 0) - rep).repeat_interleave(rep)     # row of each copy's first copy
    k = (torch.arange(t.shape[0]) - first).to(t.dtype)              # split index of each copy
    op = t[:, F_OP]
    t[:, F_NROWS] = torch.where(op == OP_ATTN, k, t[:, F_NROWS])
    t[:, F_AUX] = torch.where(op == OP_MLA_ATTN, k, t[:, F_AUX])
    on_attn = ((op == OP_O) | (op == OP_VUP)) & (t[:, F_WAIT] % NC == _C_ATTN)
    for f in (F_WCNT, F_WBASE):
        t[:, f] = torch.where(on_attn, t[:, f] * n_splits, t[:, f])
    return t


def describe_task(tasks: torch.Tensor, i: int) -> str:
    """'o_proj layer 3 rows 16..31' -- for watchdog errors."""
    op, layer, r0, n, aux = (int(v) for v in tasks[i, :5])
    name = OP_NAMES.get(op, f"op{op}")
    if op == OP_ATTN:
        where = f"kv head {r0} split {n}"
    elif op in (OP_ABSORB, OP_VUP, OP_MLA_ATTN):
        where = f"heads {r0}..{r0 + n - 1}" + (f" split {aux}" if op == OP_MLA_ATTN else "")
    elif op == OP_SAMPLE:
        where = ""
    elif op == OP_SAMPLE_TILE:
        where = f"vocab tile {aux}"
    elif op == OP_REDUCE:
        where = f"{('o_proj', 'mlp_down', 'lane_agg')[aux]} rows {r0}..{r0 + n - 1}"
    else:
        extra = f" slot {aux}" if op == OP_EXP_UP else f" tile {aux}" if op == OP_LM else ""
        where = f"rows {r0}..{r0 + n - 1}{extra}"
    return f"{name} layer {layer} {where}".strip()

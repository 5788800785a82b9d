"""Laneformer in the monokernel (one GPU): the planner's side. Device code: lane_ops.py. Semantics: dense/reference.py
(the oracle) and DESIGN.md §5.

State. The residual stream is x [LANES, D] (fp32), one full-width copy per lane, followed in the same buffer by
the LM head's input xf [D] and the partial history hist [2 (attn | ffn), RING, LANES, D] (`state_size`). The
kernel's x pointer is lane 0's row, so a plan without lanes sees the usual x [D].

Weights keep their lane axis in the arena, and the lane tensors of one layer sit back to back as the other
families' fused groups do: wq|wk|wv = [L, q/L, D] ++ [L, kv/L, D] ++ [L, kv/L, D] is the usual [NQKV, D] q|k|v
matrix with lane-major heads (so attention is plain GQA over the q/k/v buffer), w1|w3 is the [2 I, D] gate|up
pair with lane-major columns; wo [L, D, q/L] and w2 [L, D, I/L] stay lane-stacked.

Tasks (per layer, in this order):
  qkv_proj     rows of q|k|v, never across a lane boundary: a task's rows belong to one lane (F_AUX = lane), read
               that lane's stream x[lane] and normalise it with its own scale (attn_norm [L, D], or [D] shared)
  attention    per kv head (lane-major heads: unchanged)
  lane_o       rows r0..r_end of D for ALL lanes: the task streams wo[m, r0:r_end, :] for every lane m, so it holds
               every lane's partial p_m of its rows and the lane combination of those rows is local to it:
                 layer i < d:   use_early_comm -> x_l += sum_m p_m(i);  else x_l += sqrt(L) p_l(i)
                 layer i >= d:  use_comm -> x_l += p_l(i) + sum_m p_m(i-d) - p_l(i-d);  else sqrt(L) p_l(i)
               p(i-d) comes from the history ring (slot (i-d) % RING, written by layer i-d's task of the same rows;
               RING = d + 1 slots, so a slot is never read and written by the same layer)
  mlp_gate_up  gate|up rows of one lane (F_AUX = lane) over x[lane] with its ffn_norm scale
  lane_down    as lane_o over w2 and the FFN hidden h [I] (lane-major); in the last layer with pre_norm_lane_agg it
               also writes xf[r] = sum_l x_l[r] (F_AUX = 1), the LM head's input before its [D] norm
  lane_agg     (after the last layer, without pre_norm_lane_agg only) xf = mean_l rmsnorm_l(x_l) (each lane with its
               final scale), then the LM head runs without a norm
The LM head and the sampler are the other families' (the sampler writes the next token's embedding into every lane).

Multi-GPU later (DTP): the partial buffers are lane-indexed ([.., LANES, D]), so a rank that owns lanes [a, b) would
compute and keep p_m for its own m only and receive the other ranks' pre-summed partials (dense/lanes.py) into a
symmetric buffer; the combination above then reads `sum_m p_m` from there instead of summing its own lanes.
"""
from __future__ import annotations

import math

import torch

from kie_moe.models.spec import canonical

from . import plan as P


def is_laneformer(spec) -> bool:
    return getattr(spec, "family", None) == "laneformer"


def lane_dims(spec, d):
    """The Laneformer fields of plan.Dims."""
    import dataclasses
    L = spec.num_lanes
    for name, n in (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads),
                    ("intermediate_size", spec.intermediate_size)):
        if n % L:
            raise NotImplementedError(f"monokernel laneformer: {name}={n} is not divisible by num_lanes={L}")
    if spec.lm_head_type != "replicate":
        raise NotImplementedError(f"monokernel laneformer: lm_head_type {spec.lm_head_type!r}")
    return dataclasses.replace(d, LANES=L, DELAY=spec.broadcast_delay, EARLY_COMM=int(spec.use_early_comm),
                               USE_COMM=int(spec.use_comm), LANE_NORM=int(not spec.replicated_rmsn_scale),
                               PRE_AGG=int(spec.pre_norm_lane_agg))


def ring(d) -> int:
    """Slots of the partial history: layer i writes slot i % RING, layer i + d reads it (only layers i < L do)."""
    return min(d.DELAY, d.L) + 1


def state_size(d) -> int:
    """fp32 words of the kernel's x buffer: lanes [LANES, D], xf [D], history [2, RING, LANES, D]."""
    if not d.LANES:
        return d.D
    return d.D * (d.LANES + 1 + 2 * ring(d) * d.LANES)


def kernel_meta(plan) -> dict:
    """The Laneformer constexprs of kernel.monokernel (zeros / ones for other families)."""
    d, t = plan.dims, plan.tiles
    return dict(LANES=d.LANES, DELAY=d.DELAY, RING=ring(d) if d.LANES else 1, EARLY_COMM=d.EARLY_COMM,
                USE_COMM=d.USE_COMM, LANE_NORM=d.LANE_NORM, PRE_AGG=d.PRE_AGG,
                LANE_SCALE=math.sqrt(d.LANES) if d.LANES else 1.0, BLOCK_L=P._pow2(max(d.LANES, 1)),
                BK_O=t.bn.get("o_k", t.block_k), BK_DOWN=t.bn.get("down_k", t.block_k))


# ---- arena -----------------------------------------------------------------------------------------------------------

def lane_layout(spec, d) -> tuple[P.Arena, list[dict], dict]:
    """plan.layout_arena for a Laneformer: canonical names and shapes (dense/adapter.py), lane axis first."""
    ar = P.Arena()
    D, L = d.D, d.LANES
    qL, kL, fL = d.HQ * d.DH // L, d.HKV * d.DH // L, d.I_DENSE // L
    norm = (L, D) if d.LANE_NORM else (D,)
    top = {"embed": ar.add([("embed", (d.V, D))])}
    top["final_norm"] = ar.add([("final_norm", norm if d.LANE_NORM and not d.PRE_AGG else (D,))])
    top["lm_head"] = ar.add([("lm_head", (d.V, D))]) if not spec.tie_word_embeddings else top["embed"]
    layers = []
    for i in range(spec.num_layers):
        c = lambda n: canonical(i, n)  # noqa: E731
        o = {P.LF_ATTN_NORM: ar.add([(c("attn_norm"), norm)]), P.LF_MLP_NORM: ar.add([(c("mlp_norm"), norm)])}
        o[P.LF_QKV] = ar.add([(c("attn.q"), (L, qL, D)), (c("attn.k"), (L, kL, D)), (c("attn.v"), (L, kL, D))])
        o[P.LF_O] = ar.add([(c("attn.o"), (L, D, qL))])
        o[P.LF_GATE] = ar.add([(c("mlp.gate"), (L, fL, D)), (c("mlp.up"), (L, fL, D))])
        o[P.LF_DOWN] = ar.add([(c("mlp.down"), (L, D, fL))])
        o[P.LF_WINDOW] = spec.windows[i] or 0
        layers.append(o)
    return ar, layers, top


# ---- tiling ----------------------------------------------------------------------------------------------------------

def split_segments(segments: list[int], row_bytes: float, n_sms: int, min_task_bytes: int,
                   max_task_bytes: int) -> list[tuple[int, int]]:
    """Consecutive segments of rows (lanes) -> (row0, n) tiles that never cross a segment boundary, as balanced as
    split_rows' tiles: the smallest tile height whose tile count fits the waves split_rows would use."""
    total = sum(segments) * row_bytes
    waves = max(1, -(-int(total) // (n_sms * max_task_bytes)))
    target = max(len(segments), min(n_sms * waves, int(total // max(1, min_task_bytes)) or 1))
    lo, hi = 1, max(segments)
    while lo < hi:   # smallest height t with sum(ceil(seg / t)) <= target
        t = (lo + hi) // 2
        if sum(-(-s // t) for s in segments) <= target:
            hi = t
        else:
            lo = t + 1
    out, r = [], 0
    for s in segments:
        k = -(-s // lo)
        per = -(-s // k)
        out += [(r + a, min(per, s - a)) for a in range(0, s, per)]
        r += s
    return out


def lane_rows(d, rows: dict, row_bytes: dict, n_sms: int, min_task_bytes: int, max_task_bytes: int):
    """Override plan.build_plan's q|k|v and gate|up tilings with lane-homogeneous ones (o / down: rows of D for
    all lanes, the same tiling as a dense model's o_proj / down)."""
    L = d.LANES
    qL, kL, fL = d.HQ * d.DH // L, d.HKV * d.DH // L, d.I_DENSE // L
    sp = lambda segs, rb: split_segments(segs, rb, n_sms, min_task_bytes, max_task_bytes)  # noqa: E731
    rows["qkv"] = sp([qL] * L + [kL] * L + [kL] * L, row_bytes["qkv"])
    rows["gateup"] = sp([fL] * L, row_bytes["gateup"])


def lane_k(d, op: str) -> int:
    """K of a lane output op: a lane's share of the attention output (o) or of the FFN hidden (down)."""
    return (d.HQ * d.DH if op == "o" else d.I_DENSE) // d.LANES


def lane_block_k(d, block_k: int, tile_elems: int, rows: dict) -> dict:
    """Tiles of the lane output ops: their K (a lane's share, often below block_k) gets a K step of its own, the
    next power of two up to block_k ("o_k" / "down_k": the kernel's BK_O / BK_DOWN); rows per tile ("o" / "down":
    BLOCK_N) as a block_k-wide tile of the same budget would have, so a narrower K step makes a smaller tile, not a
    taller one (sm_90 offline build of laneformer-2b, fp16: [32, 512] lane_o tiles took 137 KB of shared memory for
    the 3-stage pipeline and spilled; [16, 512] 78 KB, no spills)."""
    out = {}
    for op in ("o", "down"):
        out[op + "_k"] = min(block_k, P._pow2(lane_k(d, op)))
        out[op] = P._bn(rows[op], max(1, tile_elems // block_k))
    return out


def qkv_lane(d, r: int) -> int:
    """The lane that row r of the q|k|v matrix belongs to (heads are lane-major in each of q, k, v)."""
    nq, nkv = d.HQ * d.DH, d.HKV * d.DH
    if r < nq:
        return r // (nq // d.LANES)
    return (r - nq) % nkv // (nkv // d.LANES)


# ---- task table ------------------------------------------------------------------------------------------------------

def build_lane_tasks(plan, n_splits: int = 1) -> torch.Tensor:
    """plan.build_tasks for a Laneformer (the columns and counters of plan.py; see the module docstring)."""
    d, spec = plan.dims, plan.spec
    L = spec.num_layers
    c_lm, c_sample, c_agg = P.NC * L, P.NC * L + 1, P.NC * L + 2
    lt = plan.layers_host
    rows: list[list[int]] = []
    count: dict[int, int] = {}
    wcol = {P.OP_QKV: P.LF_QKV, P.OP_LANE_O: P.LF_O, P.OP_GATEUP: P.LF_GATE, P.OP_LANE_DOWN: P.LF_DOWN}

    def emit(op, layer, r0, n, aux, wait, wcnt, wbase, sig):
        w = plan.lm_off if op == P.OP_LM else int(lt[layer, wcol[op]]) if op in wcol else 0
        row = [op, layer, r0, n, aux, wait, wcnt, wbase, sig, w & 0x7FFFFFFF, w >> 31]
        rows.append(row + [0] * (P.NF - len(row)))
        count[sig] = count.get(sig, 0) + 1

    def after(ctr):
        return ctr, count[ctr], count[ctr]

    fL = d.I_DENSE // d.LANES
    prev = (c_sample, 1, 0)
    for i in range(L):
        C = lambda k: P.counter_index(i, k)  # noqa: E731
        for r0, n in plan.op_rows["qkv"]:
            emit(P.OP_QKV, i, r0, n, qkv_lane(d, r0), *prev, C(P._C_QKV))
        for g in range(d.HKV):
            for s in range(n_splits):
                emit(P.OP_ATTN, i, g, s, 0, *after(C(P._C_QKV)), C(P._C_ATTN))
        for r0, n in plan.op_rows["o"]:
            emit(P.OP_LANE_O, i, r0, n, 0, *after(C(P._C_ATTN)), C(P._C_O))
        for r0, n in plan.op_rows["gateup"]:
            emit(P.OP_GATEUP, i, r0, n, r0 // fL, *after(C(P._C_O)), C(P._C_UP))
        last_xf = int(i == L - 1 and bool(d.PRE_AGG))
        for r0, n in plan.op_rows["down"]:
            emit(P.OP_LANE_DOWN, i, r0, n, last_xf, *after(C(P._C_UP)), C(P._C_OUT))
        prev = after(C(P._C_OUT))
    if not d.PRE_AGG:
        for r0, n in plan.op_rows["lane_agg"]:
            emit(P.OP_LANE_AGG, L - 1, r0, n, 0, *prev, c_agg)
        prev = after(c_agg)
    for t, (r0, n) in enumerate(plan.op_rows["lm"]):
        emit(P.OP_LM, L - 1, r0, n, t, *prev, c_lm)
    emit(P.OP_SAMPLE, L - 1, 0, 0, 0, *after(c_lm), c_sample)
    return torch.tensor(rows, dtype=torch.int32)


def agg_rows(d, n_sms: int) -> list[tuple[int, int]]:
    """lane_agg tiles: every task reads all of x (each lane's norm), so few, wide ones (at most 1 per 256 rows)."""
    n = max(1, min(n_sms, d.D // 256))
    per = -(-d.D // n)
    return [(r, min(per, d.D - r)) for r in range(0, d.D, per)]

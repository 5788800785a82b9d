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

Over N GPUs (Delayed Tensor Parallelism; shard_lanes + plan.build_plan(tp=(rank, N)); shard.py runs the ranks):
rank r owns lanes [r L/N, (r+1) L/N) -- their weights (lane axis sliced), norm scales, residual streams and KV heads;
the rank's plan is an ordinary lane plan of L/N lanes (LANES; LANES_ALL = L for sqrt(L) and the final mean).
  - every lane output task computes its lanes' partials p_m of its rows, and when some layer reads layer i's
    partials (F_XCTR >= 0) writes the pre-summed S_r = sum_{m of r} p_m into its row of the (layer, sublayer) slot
    of every rank's symmetric `recv` [2 L, N, D] (its own included) and signals that tile's KCCL counter there;
  - a DELAYED layer i (i >= d > 0, use_comm) first waits (F_XWAIT) for the KCCL counter of the same tile of layer
    i - d -- the other ranks' partials d layers late, normally long there -- then combines locally:
    x_l += p_l + (sum_q S_q(i-d) - p_l(i-d)), own p_l(i-d) from the local history ring;
  - a layer that needs the same layer's total (i < d with use_early_comm; every layer when d = 0 with use_comm)
    cannot wait inside its output task (every rank's task would wait for the others'), so it puts and signals
    only; an OP_REDUCE task per tile (aux 0 / 1) waits for the N signals and applies the combination;
  - SCALED layers add sqrt(L) p_l and put only when a DELAYED layer reads them;
  - final aggregation: lane_agg tasks put the rank's sum over its lanes (of x with pre_norm_lane_agg, else of the
    lanes' final norms) into every rank's `recv_f` [N, D]; an OP_REDUCE task (aux 2) per tile writes xf = the
    rank-ordered sum (/ L without pre_norm_lane_agg); then shard.py's LM head (vocab pieces + max / argmax put).
Slots are per (layer, sublayer), never reused within a step; across steps a rank overwrites a peer's slot only
after that peer's sampler ran (which needed every rank's final partial), so no slot is written before it was read.
With N = 1 the same tasks run and the arithmetic is the unsharded plan's, bit for bit.
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
    n_all = d.LANES_ALL or d.LANES
    return dict(LANES=d.LANES, DELAY=d.DELAY, RING=ring(d) if d.LANES else 1, EARLY_COMM=d.EARLY_COMM,
                USE_COMM=d.USE_COMM, LANE_NORM=d.LANE_NORM, PRE_AGG=d.PRE_AGG, LANES_ALL=max(n_all, 1),
                LANE_SCALE=math.sqrt(n_all) if d.LANES else 1.0, BLOCK_L=P._pow2(max(d.LANES, 1)),
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

def build_lane_tasks(plan, n_splits: int = 1, sample_tiles: int = 0) -> torch.Tensor:
    """plan.build_tasks for a Laneformer (the columns and counters of plan.py; see the module docstring)."""
    d, spec = plan.dims, plan.spec
    L = spec.num_layers
    c_lm, c_sample, c_agg = P.NC * L, P.NC * L + 1, P.NC * L + 2
    lt = plan.layers_host
    rows: list[list[int]] = []
    count: dict[int, int] = {}
    wcol = {P.OP_QKV: P.LF_QKV, P.OP_LANE_O: P.LF_O, P.OP_GATEUP: P.LF_GATE, P.OP_LANE_DOWN: P.LF_DOWN}

    def emit(op, layer, r0, n, aux, wait, wcnt, wbase, sig, xctr=-1, xwait=-1):
        w = plan.lm_off if op == P.OP_LM else int(lt[layer, wcol[op]]) if op in wcol else 0
        rows.append([op, layer, r0, n, aux, wait, wcnt, wbase, sig, w & 0x7FFFFFFF, w >> 31, xctr, xwait, 0, 0, 0])
        count[sig] = count.get(sig, 0) + 1

    def after(ctr):
        return ctr, count[ctr], count[ctr]

    tp, T = d.TP, plan.tp_tiles
    xc = lambda layer, kind, tile: (layer * 2 + kind) * T + tile  # noqa: E731   KCCL counters (lane_sym_layout)
    xc_lm = 2 * L * T

    def lane_out(op, i, kind, wait, done, sent):
        """A sublayer's lane output tasks (tensor parallel: their puts, delayed waits, same-layer reduces)."""
        op_rows = plan.op_rows["o" if kind == 0 else "down"]
        aux = int(kind == 1 and i == L - 1 and bool(d.PRE_AGG) and not tp)   # unsharded: the last down writes xf
        if not tp:
            for r0, n in op_rows:
                emit(op, i, r0, n, aux, *wait, done)
            return
        same = same_layer_total(d, i)
        for t, (r0, n) in enumerate(op_rows):
            emit(op, i, r0, n, 0, *wait, sent if same else done, xc(i, kind, t) if sends(d, i) else -1,
                 xc(i - d.DELAY, kind, t) if delayed(d, i) else -1)
        if same:
            for t, (r0, n) in enumerate(op_rows):
                emit(P.OP_REDUCE, i, r0, n, kind, xc(i, kind, t), tp, tp, done)

    fL = d.I_DENSE // d.LANES
    prev = (c_sample, 1, 0)
    for i in range(L):
        C = lambda k: P.counter_index(i, k)  # noqa: E731
        for r0, n in plan.op_rows["qkv"]:
            emit(P.OP_QKV, i, r0, n, qkv_lane(d, r0), *prev, C(P._C_QKV))
        for g in range(d.HKV):
            for s in range(n_splits):
                emit(P.OP_ATTN, i, g, s, 0, *after(C(P._C_QKV)), C(P._C_ATTN))
        lane_out(P.OP_LANE_O, i, 0, after(C(P._C_ATTN)), C(P._C_O), C(P._C_OSENT))
        for r0, n in plan.op_rows["gateup"]:
            emit(P.OP_GATEUP, i, r0, n, r0 // fL, *after(C(P._C_O)), C(P._C_UP))
        lane_out(P.OP_LANE_DOWN, i, 1, after(C(P._C_UP)), C(P._C_OUT), C(P._C_DSENT))
        prev = after(C(P._C_OUT))
    if tp:   # every rank's lanes: its sum (of x, or of the final norms) put, then xf = the rank-ordered sum
        agg = plan.op_rows["lane_agg"]
        for t, (r0, n) in enumerate(agg):
            emit(P.OP_LANE_AGG, L - 1, r0, n, 0, *prev, P.counter_index(L - 1, P._C_QB), xc_lm + 1 + t)
        for t, (r0, n) in enumerate(agg):
            emit(P.OP_REDUCE, L - 1, r0, n, 2, xc_lm + 1 + t, tp, tp, c_agg)
        prev = after(c_agg)
    elif not d.PRE_AGG:
        for r0, n in plan.op_rows["lane_agg"]:
            emit(P.OP_LANE_AGG, L - 1, r0, n, 0, *prev, c_agg)
        prev = after(c_agg)
    for t, (r0, n) in enumerate(plan.op_rows["lm"]):
        emit(P.OP_LM, L - 1, r0, n, t, *prev, c_lm, xc_lm if tp else -1)
    if tp:   # every rank's LM-head tile maxima, through KCCL (as shard.py's plain TP)
        n_lm = plan.n_lm_tiles * tp
        emit(P.OP_SAMPLE, L - 1, 0, 0, 0, xc_lm, n_lm, n_lm, c_sample)
    else:
        P.emit_sample(emit, after, L, sample_tiles)
    return torch.tensor(rows, dtype=torch.int32)


# ---- tensor parallel (DTP): which layers exchange what --------------------------------------------------------------

def same_layer_total(d, i: int) -> bool:
    """Layer i adds the total of its own partials over all lanes: an ALL layer (i < d, use_early_comm), or every
    layer of d = 0 with use_comm (p + (total - p)). Tensor parallel: its combination is a REDUCE task's."""
    return bool((i < d.DELAY and d.EARLY_COMM) or (d.DELAY == 0 and d.USE_COMM))


def delayed(d, i: int) -> bool:
    """Layer i reads layer i - d's partials of every lane (DELAYED, d > 0): its output tasks wait for them."""
    return bool(d.USE_COMM and 0 < d.DELAY <= i)


def sends(d, i: int) -> bool:
    """Some layer reads layer i's pre-summed partials: i itself (same_layer_total) or i + d (delayed)."""
    return same_layer_total(d, i) or bool(d.USE_COMM and d.DELAY > 0 and i + d.DELAY < d.L)


def lane_sym_layout(plan) -> dict:
    """plan.Plan.sym_layout of a tensor-parallel Laneformer (int32-word offsets, the same on every rank):
    recv [2 L, TP, D]: row ((i * 2 + sublayer) * TP + q) = rank q's pre-summed partial of layer i's attention (0)
    or FFN (1) sublayer; recv_f [TP, D]: rank q's sum over its lanes for the final aggregation; pv / pi [TP, n_lm]:
    LM-head tile maxima; ctr: KCCL counters, (layer, sublayer, tile) -> (i * 2 + k) * T + tile, then the LM head,
    then one per lane_agg tile."""
    n, D, L, T = plan.dims.TP, plan.dims.D, plan.spec.num_layers, plan.tp_tiles
    n_lm, n_agg = plan.n_lm_tiles, len(plan.op_rows["lane_agg"])
    recv_f = 2 * L * n * D
    pv = recv_f + n * D
    ctr = pv + 2 * n * n_lm
    n_ctr = 2 * L * T + 1 + n_agg
    return dict(recv=0, recv_f=recv_f, pv=pv, pi=pv + n * n_lm, ctr=ctr, n_ctr=n_ctr, words=ctr + n_ctr)


_LANE_AXIS = ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")


def shard_lanes(spec, weights, rank: int, world: int):
    """-> (rank `rank`'s LaneformerSpec: L / N lanes with their heads and FFN share; a store of its weights: the
    lane tensors and per-lane norm scales of lanes [rank L/N, (rank+1) L/N), embeddings / LM head / shared norms
    whole). Its plan is an ordinary lane plan of L / N lanes (build_plan(tp=(rank, world)) adds the KCCL tasks)."""
    import dataclasses
    from kie_moe.models.errors import ConfigError, InputError
    from .shard import DictStore
    if not 0 <= rank < world:
        raise InputError(f"rank {rank} outside world {world}")
    L = spec.num_lanes
    if L % world:
        raise ConfigError(f"laneformer tensor parallel: {world} ranks cannot split num_lanes={L} (each rank owns "
                          "whole lanes)")
    n = L // world
    lanes = slice(rank * n, (rank + 1) * n)
    out = {}
    for name in weights.names():
        t = weights.get(name)
        local = name.split(".", 2)[2] if name.startswith("layers.") else name
        if local in _LANE_AXIS or (local in ("attn_norm", "mlp_norm", "final_norm") and t.dim() == 2):
            t = t[lanes]
        out[name] = t.contiguous()
    rspec = dataclasses.replace(spec, num_lanes=n, num_heads=spec.num_heads // world,
                                num_kv_heads=spec.num_kv_heads // world,
                                intermediate_size=spec.intermediate_size // world)
    return rspec, DictStore(out, "<laneformer tensor-parallel shard>")


def agg_rows(d, n_sms: int) -> list[tuple[int, int]]:
    """lane_agg tiles: every task reads all of x (each lane's norm), so few, wide ones (at most 1 per 256 rows)."""
    n = max(1, min(n_sms, d.D // 256))
    per = -(-d.D // n)
    return [(r, min(per, d.D - r)) for r in range(0, d.D, per)]

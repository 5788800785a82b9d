"""The monokernel: ONE persistent Triton kernel that runs whole decode steps, many of them per launch.

grid = SMs x programs per SM (plan.gpu_programs_per_sm: 2 for dense models, 1 otherwise; cooperative launch, so a
grid that cannot be resident at once fails instead of hanging). Each program claims the
next task from an atomic cursor in topological order (plan.build_tasks), and for each task:
  1. issues the task's first weight tile loads (weights never depend on activations: HBM keeps streaming across
     the dependency below),
  2. waits for its input counter (kccl.sync.wait: bounded, aborts on the stop flag),
  3. computes and stores, then 4. signals its output counter (bar.sync + one release-add),
  5. claims its successor (KIE_CLAIM=late, the default: the next task goes to whichever program frees first; see
     _claim_wait for "ahead", which claims right after step 1 and hides the claim's round trip but lets a program
     that waits hold two tasks of one phase, and "wait").
No deadlock either way: the lowest unfinished claimed task is always some program's *current* task, and all its
inputs are earlier tasks, hence finished. Triton has no break/continue: `t = t_next` at the bottom of the
`while t < n_total` loop, and the stop flag (EOS, host stop, watchdog) turns it into n_total.

Ops: GEMV tiles (stream.py), GQA attention per kv head and split (ops.py; the last split of a head to finish
combines them for the o_proj), MLA absorb / attention / v_up (mla.py), the MoE router inside the o_proj tasks
(RIN_O, plan.route_in_o: integer partial logits, ops.route_partial) with the top-k picked by each expert task
(ops.route_lg; KIE_ROUTE_IN_O=0: router tasks, ops.route), LM-head tiles and the sampler, which writes the token
ring and the next step's input (or, during an in-kernel prefill, feeds the prompt's next token).
Laneformer (LANES > 0; lanes.py, lane_ops.py): x holds one stream per lane; q|k|v and gate|up tasks read their
lane's (F_AUX), lane_o / lane_down tasks stream every lane's output rows and combine the lanes' partials in
place. Over TP ranks (Delayed Tensor Parallelism) a rank holds its lanes only: lane output tasks put the rank's
pre-summed partial (F_XCTR >= 0) and a delayed layer's tasks first wait for layer i - d's KCCL counter (F_XWAIT);
same-layer totals and the final aggregation go through REDUCE tasks (aux 0 / 1 / 2).
Weight formats: FMT_ATTN / FMT_MLP / FMT_EXP (constexprs, kernels/tiles.py's FMT_ID) say where each Linear
kind lives: the float arena (wa) or the quantized buffers of qarena.py (codes qw: read as e4m3 bytes or u32
words; scales qs8 / qf32; per-row factors qf32). Router, LM head, embeddings, norms and biases are always float.

Under TRITON_INTERPRET=1 the same kernel runs on the CPU (USE_ASM=False); programs run one after another, so
program 0 claims every task in order and every wait is either satisfied or reported at once.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kie_moe.kccl.sync import (clock64, flag_is_set, globaltimer, put_span, read_counter, signal, signal_peer,
                               st_release_sys, wait)

from . import plan as P
from .lane_ops import lane_final_mean, lane_final_reduce, lane_out_tile, lane_reduce, lane_sum, stream_lane_out
from .mma8 import mma8_down_task, mma8_first, mma8_glu_task, mma8_task
from .mla import mla_absorb_task, mla_attention_task, mla_vup_task
from .fused_down import expert_down_cols
from .prefetch import prefetch_cols, prefetch_rows
from .ops import (attention_task, embed_row, kv_split_range, load_logits, pick_token, route, route_acc_logits,
                  route_acc_zero, route_lg, route_partial, vec_dot_norm)
from .stream import stream_expert_down, stream_gemv, stream_glu, tile
from ..sampling import sample_final_task, sample_tile_task

# ctrl words (int32, device): written by the kernel, read by the host after the launch
CT_STOP, CT_ERR, CT_ERR_TASK, CT_ERR_HAVE, CT_ERR_NEED, CT_REASON, CT_NTOK, CT_YIELD = range(8)
# CT_REASON: 1 EOS, 2 host stop flag, 3 non-finite logits (the ring's last token is -1); 0 max tokens
N_CTRL = 8      # then 3 words per program: its watchdog record (task + 1, counter value, target)
WAIT_YIELD = 3   # interpreter only: a KCCL wait another rank has not satisfied yet (see _kccl_wait)

_OP_QKV = tl.constexpr(P.OP_QKV)
_OP_ATTN = tl.constexpr(P.OP_ATTN)
_OP_O = tl.constexpr(P.OP_O)
_OP_GATEUP = tl.constexpr(P.OP_GATEUP)
_OP_DOWN = tl.constexpr(P.OP_DOWN)
_OP_ROUTER = tl.constexpr(P.OP_ROUTER)
_OP_EXP_UP = tl.constexpr(P.OP_EXP_UP)
_OP_SH_UP = tl.constexpr(P.OP_SH_UP)
_OP_EXP_DOWN = tl.constexpr(P.OP_EXP_DOWN)
_OP_LM = tl.constexpr(P.OP_LM)
_OP_SAMPLE = tl.constexpr(P.OP_SAMPLE)
_OP_LANE_O = tl.constexpr(P.OP_LANE_O)
_OP_LANE_DOWN = tl.constexpr(P.OP_LANE_DOWN)
_OP_LANE_AGG = tl.constexpr(P.OP_LANE_AGG)
TRACE_W = tl.constexpr(P.TRACE_W)   # int64 fields of a traced task's row (trace.py)
_OP_QB = tl.constexpr(P.OP_QB)
_OP_ABSORB = tl.constexpr(P.OP_ABSORB)
_OP_MLA_ATTN = tl.constexpr(P.OP_MLA_ATTN)
_OP_VUP = tl.constexpr(P.OP_VUP)
_OP_REDUCE = tl.constexpr(P.OP_REDUCE)
_OP_SAMPLE_TILE = tl.constexpr(P.OP_SAMPLE_TILE)
_CT_YIELD = tl.constexpr(CT_YIELD)
_WAIT_YIELD = tl.constexpr(WAIT_YIELD)
_NF = tl.constexpr(P.NF)
_N_CTRL = tl.constexpr(N_CTRL)
_NLF = tl.constexpr(P.NLF)


@triton.jit
def _claim(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, USE_ASM: tl.constexpr):
    """Claim the next task and fetch its table row (one 64-byte vector load) while the current task streams.
    The interpreter reads fields one by one instead (cheaper there than vector extraction)."""
    t = tl.atomic_add(cursor_ptr, 1, sem="relaxed")
    if USE_ASM:
        row = tl.load(tasks_ptr + (t % n_tasks) * _NF + offs_f, mask=(offs_f < _NF) & (t < n_total), other=0)
    else:
        row = offs_f
    return t, row


@triton.jit
def _field(rowv, row, offs_f, k: tl.constexpr, USE_ASM: tl.constexpr):
    """Field k of the claimed task's row: from the row vector _claim loaded (GPU), or one plain load of the table
    row (the interpreter, where that is cheaper than extracting from the vector)."""
    if USE_ASM:
        v = tl.sum(tl.where(offs_f == k, rowv, 0), axis=0)
    else:
        v = tl.load(row + k)
    return v


@triton.jit
def _claim_if(now: tl.constexpr, cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, USE_ASM: tl.constexpr):
    """_claim when `now`; else placeholders (CLAIM 2: the loop's bottom claims)."""
    if now:
        t, row = _claim(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, USE_ASM)
    else:
        t = n_total
        row = offs_f
    return t, row


@triton.jit
def _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target, stop_ptr, timeout_ns,
                USE_ASM: tl.constexpr, NT: tl.constexpr, MODE: tl.constexpr, tr, trace_on, CLAIM: tl.constexpr):
    """A task's successor claim and its input wait, in the order KIE_CLAIM picks (runtime.py):
    0 "ahead": claim, then wait. The claim's round trip hides behind the wait, but a program that reaches a phase
      early (its previous task done) holds two of that phase's tasks, and the second starts only after the first:
      session 32's H200 trace has the q/k/v tasks' ready times spread over 9.6 us, the expert down's over 8.5-12.
    1 "wait": wait, then claim: a waiting program holds one task; the claim hides behind the task's work.
    2 "late": wait only; the successor is claimed after this task's signal (the loop's bottom), by whichever
      program frees first, at the price of one exposed claim per task.
    (The sampler and the tensor-parallel REDUCE tasks, whose waits differ, claim before their wait unless "late".)"""
    if CLAIM == 0:
        t, row = _claim(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, USE_ASM)
        st = _wait(wctr, target, stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on)
    else:
        st = _wait(wctr, target, stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on)
        t, row = _claim_if(CLAIM == 1, cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, USE_ASM)
    return t, row, st


@triton.jit
def _wp(FMT: tl.constexpr, wa_ptr, qw8_ptr, qw32_ptr, off):
    """Typed pointer to a Linear's weights: float elements (wa), e4m3 bytes or u32 words of packed e2m1 (qw;
    `off` in bytes, 128-byte aligned)."""
    if FMT == 0:
        p = wa_ptr + tl.multiple_of(off, 64)
    elif FMT <= 2:
        p = qw8_ptr + tl.multiple_of(off, 128)
    else:
        p = qw32_ptr + tl.multiple_of(off // 4, 32)
    return p


@triton.jit
def _wbase(FMT: tl.constexpr, wa_ptr, qw8_ptr, qw32_ptr):
    """_wp's pointer type, at the start of its buffer."""
    if FMT == 0:
        p = wa_ptr
    elif FMT <= 2:
        p = qw8_ptr
    else:
        p = qw32_ptr
    return p


@triton.jit
def _wu(FMT: tl.constexpr, off):
    """A byte (or float element) offset in the units of _wp's pointer."""
    if FMT >= 3:
        u = off // 4
    else:
        u = off
    return u


@triton.jit
def _edown(FMT: tl.constexpr, wa_ptr, qw8_ptr, qw32_ptr, lrow, e, D: tl.constexpr, RU_I: tl.constexpr):
    """Routed expert e's down rows [D, I_MOE] (RU_I units of _wp's pointer each) in _wp's pointer type."""
    off = _wu(FMT, tl.multiple_of(tl.load(lrow + P.LF_EDOWN), 64))
    return _wbase(FMT, wa_ptr, qw8_ptr, qw32_ptr) + off + e * (D * RU_I)


@triton.jit
def _down_share_l2(wd, r0, r_end, D: tl.constexpr, I_MOE: tl.constexpr, FMT: tl.constexpr, USE_ASM: tl.constexpr):
    """A gate / up task's share of its expert's down rows wd [D, I_MOE] into L2: rows r0 D / I_MOE .. r_end D /
    I_MOE (the slot's tasks together cover all D; KIE_DOWN_L2)."""
    d0 = r0 * D // I_MOE
    prefetch_rows(wd, d0, r_end * D // I_MOE - d0, I_MOE, FMT, USE_ASM)


@triton.jit
def _wq(FMT: tl.constexpr, wa_ptr, qw32_ptr, off):
    """u32 view of a Linear's weights for the tensor-core tasks (mma8.py): e4m3 bytes or packed e2m1 (fp8, nvfp4,
    mxfp4; `off` in bytes) or the arena's bf16 / fp16 elements (`off` in elements, even)."""
    if FMT >= 1:
        p = qw32_ptr + off // 4
    else:
        p = wa_ptr.to(tl.pointer_type(tl.uint32)) + off // 2
    return p


@triton.jit
def _sp(FMT: tl.constexpr, qf32_ptr, qs8f_ptr, qs8u_ptr, off):
    """Typed pointer to a quantized Linear's scales (unused for float and fp8)."""
    if FMT == 3:
        p = qs8f_ptr + off
    elif FMT == 4:
        p = qs8u_ptr + off
    else:
        p = qf32_ptr + off
    return p


@triton.jit
def _publish_route(ids, wts, ids_ptr, wts_ptr, on, TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """A layer's picked experts (ops.route: ids, weights [BLOCK_TOPK]) into its rids / rwts rows when `on`."""
    if on:
        offs_j = tl.arange(0, BLOCK_TOPK)
        tl.store(ids_ptr + offs_j, ids, mask=offs_j < TOPK)
        tl.store(wts_ptr + offs_j, wts, mask=offs_j < TOPK)


@triton.jit
def _wait(wctr, target, stop_ptr, timeout_ns, USE_ASM: tl.constexpr, NT: tl.constexpr, MODE: tl.constexpr, tr,
          trace_on):
    if MODE == 2:   # benchmark mode "no waits": streaming speed without dependency latency (wrong results)
        st = 0
    else:
        st = wait(wctr, target, stop_ptr, timeout_ns, USE_ASM, False, NT)
    if MODE == 3:
        _stamp(tr, 1, trace_on)
    return st


@triton.jit
def _stamp(tr, k: tl.constexpr, on):
    """MODE 3 (trace): record (globaltimer, clock64) as event k of this task: 0 start, 1 input ready, 2 done."""
    if on:
        tl.store(tr + k, globaltimer())
        tl.store(tr + 3 + k, clock64())


@triton.jit
def _kccl_wait(ctr, target, stop_ptr, timeout_ns, USE_ASM: tl.constexpr, NT: tl.constexpr, MODE: tl.constexpr):
    """Wait on a KCCL counter that other ranks signal (system scope). Under the interpreter ranks run one after
    another, so a counter a peer has not reached yet is not an error but a yield point: WAIT_YIELD makes the
    program record the task and leave; the host (shard.py) runs the other ranks and resumes this one there."""
    if MODE == 2:
        st = 0
    else:
        st = wait(ctr, target, stop_ptr, timeout_ns, USE_ASM, True, NT)
        if USE_ASM == 0:
            st = tl.where(st == 2, _WAIT_YIELD, st)
    return st


@triton.jit
def _tp_put(ptr, poff_ptr, n0, n1, ctr_ptr, TP: tl.constexpr, USE_ASM: tl.constexpr, BLOCK: tl.constexpr):
    """ptr[n0:n1] (this rank's row of a symmetric recv buffer) into every rank's copy (ours included: the same
    code for one rank), each followed by a signal of that rank's KCCL counter `ctr_ptr`."""
    tl.debug_barrier()   # the partial's stores (every thread) before the copies read them
    for q in range(0, TP):
        put_span(ptr, poff_ptr, q, n0, n1, BLOCK)
        signal_peer(ctr_ptr, poff_ptr, q, USE_ASM)


@triton.jit
def _tp_reduce(recv_ptr, x_ptr, r0, r_end, D: tl.constexpr, TP: tl.constexpr, BLOCK: tl.constexpr):
    """x[r] += sum_q recv[q, r] for r in [r0, r_end), summed in rank order (bit-identical on every rank; with one
    rank x + recv[0], exactly the unsharded x + y)."""
    for k0 in range(r0, r_end, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        m = offs < r_end
        acc = tl.load(recv_ptr + offs, mask=m, other=0.0, cache_modifier=".cg")
        for q in range(1, TP):
            acc += tl.load(recv_ptr + q * D + offs, mask=m, other=0.0, cache_modifier=".cg")
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m, other=0.0, cache_modifier=".cg") + acc, mask=m)


# Runtime integers vary per launch (positions, counts, seeds): without this, Triton would specialise on value 1
# and on divisibility by 16 and recompile this large kernel (~10 s) for new combinations.
_DYNAMIC = ["trace_cap", "n_tasks", "n_steps", "start_pos", "kv_tmax", "n_splits", "n_lm", "n_eos", "ignore_eos",
            "n_forced",
            "do_sample", "seed", "timeout_ns", "embed_off", "lm_off", "fnorm_off", "tp_rank", "sym_pv_off",
            "sym_ctr_off"]


@triton.jit(do_not_specialize=_DYNAMIC)
def monokernel(
    # plan: tasks, layer table, float arena, quantized buffers (qarena.py), KV cache, RoPE tables
    tasks_ptr, layers_ptr, wa_ptr, qw8_ptr, qw32_ptr, qf32_ptr, qs8f_ptr, qs8u_ptr, kv_ptr, cos_ptr, sin_ptr,
    # activations (fp32) and per-layer routing
    x_ptr, qkv_ptr, ao_ptr, am_ptr, al_ptr, acnt_ptr, h_ptr, rlog_ptr, rids_ptr, rwts_ptr, sg_ptr,
    pv_ptr, pi_ptr,
    # SFILTER (top-k / top-p): the LM head's logits [vocab] fp32, then a kernels/sampling.DeviceSampler's buffers
    # (params, rng, part_f, part_i, cand, gum_f, gum_i, status, out) over n_stiles vocab tiles
    slg_ptr, sparams_ptr, srng_ptr, spf_ptr, spi_ptr, scand_ptr, sgf_ptr, sgi_ptr, sstat_ptr, sout_ptr, n_stiles,
    vocab,
    # control
    cnt_ptr, cursor_ptr, ctrl_ptr, ring_ptr, hostflag_ptr, eos_ptr, forced_ptr,
    # MODE 3: int64 [trace_cap, TRACE_W] per task (claim order): globaltimer at start / input ready / done, the same
    # in clock64, the program id, then clock64 stamps inside some tasks (kernels/monokernel/trace.py)
    trace_ptr, trace_cap,
    # tensor parallel (TP > 0): this rank's symmetric region as f32 / i32 (one allocation), the distances to every
    # rank's copy (kccl.sync.peer), and the region's layout (plan.sym_layout)
    symf_ptr, symi_ptr, poff_ptr, tp_rank, sym_pv_off, sym_ctr_off,
    n_tasks, n_steps, start_pos, kv_tmax, n_splits, n_lm, n_eos, ignore_eos, n_forced,
    do_sample, inv_temp, seed, timeout_ns, embed_off, lm_off, fnorm_off,
    eps, sm_scale, clip, route_scale, glu_limit, glu_alpha,
    # tensor-core tasks (mma8.py; MMA8: fp8 ones, KIE_MONO_FP8_MMA=1; MMA16 1 / 2: those on a bf16 / fp16 arena,
    # KIE_MONO_W16_MMA=1; MMA4: nvfp4 / mxfp4 ones, KIE_MONO_FP4_MMA, their e4m3 scales decoded from the bits
    # when E4B, their codes in packing "mma" when RP4 (plan.fp4_packed: every Linear those tasks read); MMA_DN: the
    # experts' down task too): fp32 scratch, MSCR words per program
    mscr_ptr,
    # ROUTE_ONCE (KIE_ROUTE_ONCE=1): int32 [L] tickets of the router tasks (zeroed per launch; the N_ROUTER-th of a
    # layer's step picks the top-k)
    rtk_ptr,
    # RIN_O (plan.route_in_o): int64 [L, E + 1] fixed-point router accumulators (ops.route_partial; zeroed per
    # launch, then by each layer's first expert down task once the gate / up tasks read them)
    racc_ptr,
    # model constexprs (plan.Dims)
    D: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, DH: tl.constexpr, ROT: tl.constexpr,
    ROPE_PAIR: tl.constexpr, QK_NORM: tl.constexpr, HAS_QKV_BIAS: tl.constexpr, HAS_O_BIAS: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_CLIP: tl.constexpr, I_DENSE: tl.constexpr, E: tl.constexpr, TOPK: tl.constexpr,
    I_MOE: tl.constexpr, I_SH: tl.constexpr, SCORING: tl.constexpr, NORM_TOPK: tl.constexpr,
    HAS_RBIAS: tl.constexpr, HAS_SBIAS: tl.constexpr, EXP_ACT: tl.constexpr, HAS_EBIAS: tl.constexpr,
    HAS_SH_GATE: tl.constexpr, FMT_ATTN: tl.constexpr, FMT_MLP: tl.constexpr, FMT_EXP: tl.constexpr,
    MLA: tl.constexpr, R_Q: tl.constexpr, R_KV: tl.constexpr, NOPE: tl.constexpr, VD: tl.constexpr,
    NG: tl.constexpr, TG: tl.constexpr, GSCORE: tl.constexpr,
    # Laneformer (lanes.kernel_meta; LANES 0: any other family)
    LANES: tl.constexpr, DELAY: tl.constexpr, RING: tl.constexpr, EARLY_COMM: tl.constexpr, USE_COMM: tl.constexpr,
    LANE_NORM: tl.constexpr, PRE_AGG: tl.constexpr, LANES_ALL: tl.constexpr, LANE_SCALE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BK_O: tl.constexpr, BK_DOWN: tl.constexpr,
    # tiles
    BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_DOWN: tl.constexpr, BN_ROUTER: tl.constexpr,
    BN_EUP: tl.constexpr, BN_EDOWN: tl.constexpr, BN_SUP: tl.constexpr, BN_LM: tl.constexpr,
    BN_QB: tl.constexpr, BN_KVB: tl.constexpr, BLOCK_RKV: tl.constexpr, BLOCK_RD: tl.constexpr,
    BLOCK_HG: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr, BLOCK_EOS: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_XS: tl.constexpr,
    ROUTE_ONCE: tl.constexpr, N_ROUTER: tl.constexpr, DOWN_L2: tl.constexpr, CLAIM: tl.constexpr,
    BLOCK_QG: tl.constexpr,
    XB: tl.constexpr, NS: tl.constexpr, USE_ASM: tl.constexpr, NT: tl.constexpr, MODE: tl.constexpr = 0,
    TP: tl.constexpr = 0, E_LO: tl.constexpr = 0, E_LOC: tl.constexpr = 0,
    SFILTER: tl.constexpr = False, K_CAND: tl.constexpr = 1, SBLOCK_V: tl.constexpr = 1, SBLOCK_T: tl.constexpr = 1,
    SBLOCK_C: tl.constexpr = 1, MMA8: tl.constexpr = False, MMA16: tl.constexpr = 0, MMA_DN: tl.constexpr = False,
    MSCR: tl.constexpr = 4, MMA4: tl.constexpr = False, E4B: tl.constexpr = False, RP4: tl.constexpr = False,
    # attention's tl.dot precision (ops.attention_task PREC; KIE_ATTN_DOT)
    ATTN_PREC: tl.constexpr = "ieee",
    # the router inside o_proj (plan.route_in_o); BLOCK_RO: a power of two >= an o_proj task's rows
    RIN_O: tl.constexpr = False, BLOCK_RO: tl.constexpr = 16,
    # the top-k 4 slots per reduction (ops.route_lg MERGE; KIE_TOPK_MERGE)
    TOPK_MERGE: tl.constexpr = False,
    # a routed expert's down inside its gate / up task (plan.fused_down, KIE_FUSE_DOWN; needs RIN_O): no expert down
    # tasks; x holds [2, D] (the experts' input copy at D) and racc [L, 2, E + 1] (by step parity); FD_AL: every
    # gate / up task's rows and I_MOE are multiples of 16 (fused_down.expert_down_cols' vector loads)
    FUSE_DN: tl.constexpr = False, FD_AL: tl.constexpr = False, FD_BD: tl.constexpr = 16, FD_NS: tl.constexpr = 0,
):
    """MODE 0: decode. Benchmark-only modes (wrong tokens, for locating time): 1 = tasks only claim, wait and
    signal (the sampler still runs): the cost of scheduling + dependency latency; 2 = no waits: streaming speed.
    MODE 3: decode as MODE 0, and time stamps of the first trace_cap tasks into trace_ptr (GPU only)."""
    pid = tl.program_id(0)
    stop_ptr = ctrl_ptr + 0  # CT_STOP
    n_total = n_tasks * n_steps
    NQ: tl.constexpr = HQ * DH
    O_K: tl.constexpr = HQ * VD if MLA else NQ          # o_proj's input: v of every head (MLA) / attention out
    # MLA offsets in the qkv buffer: [q_a | kv_a] (or [q | kv_a]) from qkv_proj, then q (from q_b), q_lat, q_pe
    KVA_OFF: tl.constexpr = R_Q if R_Q > 0 else NQ
    NQKV1: tl.constexpr = KVA_OFF + R_KV + ROT
    Q_OFF: tl.constexpr = NQKV1 if R_Q > 0 else 0
    QLAT_OFF: tl.constexpr = NQKV1 + (NQ if R_Q > 0 else 0)
    QPE_OFF: tl.constexpr = QLAT_OFF + HQ * R_KV
    LAT_W: tl.constexpr = R_KV + ROT                     # MLA cache row: latent | k_pe
    # a D-long weight row in units of _wp's pointer (elements, e4m3 bytes, u32 words) and its scale entries
    RU_D_MLP: tl.constexpr = D // 8 if FMT_MLP >= 3 else D
    RU_D_EXP: tl.constexpr = D // 8 if FMT_EXP >= 3 else D
    RU_I_EXP: tl.constexpr = I_MOE // 8 if FMT_EXP >= 3 else I_MOE
    # ... and in the units of the tables' offsets (elements of the float arena, bytes of the quantized codes)
    RB_D_MLP: tl.constexpr = D // 2 if FMT_MLP >= 3 else D
    RB_D_EXP: tl.constexpr = D // 2 if FMT_EXP >= 3 else D
    EXP_AL: tl.constexpr = (I_MOE * RU_D_EXP) % 16 == 0   # an expert's stride keeps 16-byte alignment
    SC_D_MLP: tl.constexpr = (D + 127) // 128 if FMT_MLP == 2 else (D // 16 if FMT_MLP == 3 else D // 32)
    SC_D_EXP: tl.constexpr = (D + 127) // 128 if FMT_EXP == 2 else (D // 16 if FMT_EXP == 3 else D // 32)
    # Laneformer: x is [LANES, D] (one stream per lane), then the LM head's input xf [D], then the partial history
    NLX: tl.constexpr = LANES if LANES > 0 else 1
    XF_OFF: tl.constexpr = LANES * D
    HIST_OFF: tl.constexpr = (LANES + 1) * D
    LM_NORM: tl.constexpr = 1 if LANES == 0 else PRE_AGG   # else lane_agg leaves xf normalised
    NSTR: tl.constexpr = D * LANE_NORM                      # a lane's row of a [LANES, D] norm scale
    # which ops run on the tensor cores (mma8.py), their weights' kind WK (0 e4m3, 1 bf16, 2 fp16, 3 nvfp4, 4
    # mxfp4) and whether they have row factors (fp8's row scales, nvfp4's 2^14 / global scale)
    MM_ATTN: tl.constexpr = ((MMA8 and FMT_ATTN == 1) or (MMA16 > 0 and FMT_ATTN == 0)
                             or (MMA4 and FMT_ATTN >= 3))
    MM_MLP: tl.constexpr = (MMA8 and FMT_MLP == 1) or (MMA16 > 0 and FMT_MLP == 0) or (MMA4 and FMT_MLP >= 3)
    MM_EXP: tl.constexpr = (MMA8 and FMT_EXP == 1) or (MMA16 > 0 and FMT_EXP == 0) or (MMA4 and FMT_EXP >= 3)
    W_ATTN: tl.constexpr = MMA16 if FMT_ATTN == 0 else (FMT_ATTN if FMT_ATTN >= 3 else 0)
    W_MLP: tl.constexpr = MMA16 if FMT_MLP == 0 else (FMT_MLP if FMT_MLP >= 3 else 0)
    W_EXP: tl.constexpr = MMA16 if FMT_EXP == 0 else (FMT_EXP if FMT_EXP >= 3 else 0)
    F_ATTN: tl.constexpr = FMT_ATTN == 1 or FMT_ATTN == 3
    F_MLP: tl.constexpr = FMT_MLP == 1 or FMT_MLP == 3
    F_EXP: tl.constexpr = FMT_EXP == 1 or FMT_EXP == 3
    XM_OFF: tl.constexpr = D if FUSE_DN else 0         # the routed experts' input copy of x (FUSE_DN)
    RSTR: tl.constexpr = 2 * (E + 1) if FUSE_DN else E + 1   # a layer's racc words (FUSE_DN: one row per parity)
    RPAR: tl.constexpr = E + 1 if FUSE_DN else 0             # ... and the odd steps' row in them
    offs_f = tl.arange(0, 16)
    t, rowv = _claim(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, USE_ASM)
    while t < n_total:
        step = t // n_tasks
        row = tasks_ptr + (t - step * n_tasks) * _NF   # (the interpreter's fields; unused on the GPU)
        op = _field(rowv, row, offs_f, P.F_OP, USE_ASM)
        layer = _field(rowv, row, offs_f, P.F_LAYER, USE_ASM)
        r0 = _field(rowv, row, offs_f, P.F_ROW0, USE_ASM)
        nr = _field(rowv, row, offs_f, P.F_NROWS, USE_ASM)
        aux = _field(rowv, row, offs_f, P.F_AUX, USE_ASM)
        wc = _field(rowv, row, offs_f, P.F_WAIT, USE_ASM)
        target = _field(rowv, row, offs_f, P.F_WCNT, USE_ASM) * step + _field(rowv, row, offs_f, P.F_WBASE, USE_ASM)
        sig = _field(rowv, row, offs_f, P.F_SIG, USE_ASM)
        woff = (_field(rowv, row, offs_f, P.F_WHI, USE_ASM).to(tl.int64) * 2147483648
                + _field(rowv, row, offs_f, P.F_WLO, USE_ASM))
        xctr = symi_ptr + sym_ctr_off
        xc = 0    # the KCCL counter a put task signals on every rank (lane plans: -1 = no put)
        xw = -1   # lane output tasks of a delayed layer: the KCCL counter of layer i - DELAY's tile (-1: none)
        if TP > 0:
            xc = _field(rowv, row, offs_f, P.F_XCTR, USE_ASM)
            xw = _field(rowv, row, offs_f, P.F_XWAIT, USE_ASM)
            xctr += xc
        if MODE == 1:
            op = tl.where(op == _OP_SAMPLE, op, 0)
        tr = trace_ptr + t.to(tl.int64) * TRACE_W
        trace_on = (MODE == 3) & (t < trace_cap)
        if MODE == 3:
            _stamp(tr, 0, trace_on)
        wctr = cnt_ptr + wc
        r_end = r0 + nr
        pos = start_pos + step
        lrow = layers_ptr + layer * _NLF
        st = 0
        lx = x_ptr   # Laneformer: a q|k|v or gate|up task reads its lane's (F_AUX) stream and norm scale
        lnw = 0
        if LANES > 0:
            lx = x_ptr + aux * D
            lnw = aux * NSTR
        # Every branch: issue the weight loads, claim the next task, wait for the input, compute. Offsets read
        # from the tables are multiples of 64 elements / 128 bytes (plan.Arena, qarena): tl.multiple_of tells
        # Triton, so weight loads vectorise (16-byte ld.global.v4 instead of 2-byte loads).
        if op == _OP_QKV:
            w = _wp(FMT_ATTN, wa_ptr, qw8_ptr, qw32_ptr, woff)
            sq = _sp(FMT_ATTN, qf32_ptr, qs8f_ptr, qs8u_ptr, tl.load(lrow + P.LF_QKV_S))
            prefetch_rows(w, r0, nr, D, FMT_ATTN, USE_ASM)   # the whole task into L2 before the wait
            if MM_ATTN:   # on the tensor cores (mma8.py): the first step's loads before the wait
                wq = tl.multiple_of(_wq(FMT_ATTN, wa_ptr, qw32_ptr, woff), 32)
                first = mma8_first(wq, D, r0, r_end, NT // 32, W_ATTN, sq)
            else:
                w0, s0 = tile(w, sq, D, r0, r_end, 0, 1, FMT_ATTN, BN_QKV, BLOCK_K)
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if MM_ATTN:
                if st == 0:
                    mma8_task(first, wq, qf32_ptr + tl.load(lrow + P.LF_QKV_F), D, r0, r_end, lx,
                              wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_ATTN_NORM), 64) + lnw, eps,
                              wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_QKV_B), 64), qkv_ptr, qkv_ptr,
                              mscr_ptr + pid * MSCR, True, HAS_QKV_BIAS, False, NT // 32, BLOCK_XS, F_ATTN,
                              W_ATTN, tr, trace_on, MODE == 3, sq, E4B, RP4)
            elif st == 0:
                stream_gemv(w, sq, qf32_ptr + tl.load(lrow + P.LF_QKV_F), w0, s0, D, r0, r_end, lx,
                            wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_ATTN_NORM), 64) + lnw, eps,
                            wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_QKV_B), 64), qkv_ptr, qkv_ptr, 0, pv_ptr,
                            pi_ptr, 0, 1.0, 0, 0, True, HAS_QKV_BIAS, False, False, FMT_ATTN, BN_QKV, BLOCK_K, XB, NS)
        elif op == _OP_ATTN:
            k_head = kv_ptr + (layer * 2 * HKV + r0).to(tl.int64) * kv_tmax * DH  # cache [L, 2, HKV, T_max, DH]
            v_head = k_head + HKV * kv_tmax * DH
            kv_lo, kv_hi = kv_split_range(pos, tl.load(lrow + P.LF_WINDOW).to(tl.int32), n_splits, nr)
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if MLA == 0:   # (an MLA model never has these tasks: do not compile them)
                if st == 0:
                    attention_task(r0, nr, n_splits, pos, kv_lo, kv_hi, qkv_ptr, k_head, v_head, cos_ptr, sin_ptr,
                                   wa_ptr + tl.load(lrow + P.LF_Q_NORM), wa_ptr + tl.load(lrow + P.LF_K_NORM),
                                   ao_ptr, am_ptr, al_ptr, acnt_ptr + layer * HKV + r0,
                                   wa_ptr + tl.load(lrow + P.LF_SINKS), eps, sm_scale, clip, tr, trace_on, HQ, HKV,
                                   DH, ROT, ROPE_PAIR, QK_NORM, HAS_CLIP, HAS_SINKS, BLOCK_R, BLOCK_H, BLOCK_C,
                                   BLOCK_D, BLOCK_T, BLOCK_X, BLOCK_QG, NT, MODE == 3, ATTN_PREC, USE_ASM)
        elif op == _OP_O:
            w = _wp(FMT_ATTN, wa_ptr, qw8_ptr, qw32_ptr, woff)
            sq = _sp(FMT_ATTN, qf32_ptr, qs8f_ptr, qs8u_ptr, tl.load(lrow + P.LF_O_S))
            prefetch_rows(w, r0, nr, O_K, FMT_ATTN, USE_ASM)
            if RIN_O:   # the router's [E, nr] slice this task adds into the layer's logits (aux 1: a MoE layer)
                racc = racc_ptr + layer * RSTR + (step % 2) * RPAR
                wr = wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_ROUTER), 64)
                if aux != 0:
                    prefetch_cols(wr, r0, nr, D, E, USE_ASM, BLOCK_E)
            if MM_ATTN:   # (the tensor-core tasks exclude TP and MLA: x += W_o ao in place)
                wq = tl.multiple_of(_wq(FMT_ATTN, wa_ptr, qw32_ptr, woff), 32)
                first = mma8_first(wq, O_K, r0, r_end, NT // 32, W_ATTN, sq)
            else:
                w0, s0 = tile(w, sq, O_K, r0, r_end, 0, 1, FMT_ATTN, BN_O, BLOCK_K)
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if MM_ATTN:
                if st == 0:
                    mma8_task(first, wq, qf32_ptr + tl.load(lrow + P.LF_O_F), O_K, r0, r_end, ao_ptr, ao_ptr, eps,
                              wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_O_B), 64), x_ptr, x_ptr,
                              mscr_ptr + pid * MSCR, False, HAS_O_BIAS, True, NT // 32, BLOCK_XS, F_ATTN,
                              W_ATTN, tr, trace_on, MODE == 3, sq, E4B, RP4)
            else:
                if TP > 0:   # a launch that is ending puts nothing (peers may already be zeroing for the next one)
                    if st == 0:
                        st = flag_is_set(stop_ptr, USE_ASM, NT).to(tl.int32)
                yo = x_ptr
                if TP > 0:   # the partial goes to our row of every rank's recv_o, not into x
                    yo = symf_ptr + tp_rank * D
                if st == 0:
                    if MLA:   # the v_up tasks left v [H * VD] in h
                        xin = h_ptr
                    else:     # the attention tasks left every head's output in ao's row 0 (ops.head_combine)
                        xin = ao_ptr
                    stream_gemv(w, sq, qf32_ptr + tl.load(lrow + P.LF_O_F), w0, s0, O_K, r0, r_end, xin, xin, eps,
                                wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_O_B), 64), yo, yo, 0, pv_ptr, pi_ptr,
                                0, 1.0, 0, 0, False, HAS_O_BIAS, TP == 0, False, FMT_ATTN, BN_O, BLOCK_K, XB, NS)
                    if TP > 0:
                        _tp_put(yo, poff_ptr, r0, r_end, xctr, TP, USE_ASM, BLOCK_X)
            if RIN_O:   # (one GPU: rows r0..r_end of x are final now)
                if (st == 0) & (aux != 0):
                    tl.debug_barrier()   # every thread's x stores before the rows are read back
                    route_partial(x_ptr, wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_MLP_NORM), 64), wr, racc, r0, nr,
                                  D, E, BLOCK_E, BLOCK_RO, XM_OFF)
        elif op == _OP_QB:   # MLA: q = q_b(RMSNorm(q_a))
            w = wa_ptr + tl.multiple_of(woff, 64)
            w0, s0 = tile(w, qf32_ptr, R_Q, r0, r_end, 0, 1, 0, BN_QB, BLOCK_K)
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if MLA:
                if st == 0:
                    stream_gemv(w, qf32_ptr, qf32_ptr, w0, s0, R_Q, r0, r_end, qkv_ptr,
                                wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_Q_NORM), 64), eps, wa_ptr, qkv_ptr + Q_OFF,
                                qkv_ptr, 0, pv_ptr, pi_ptr, 0, 1.0, 0, 0, True, False, False, False, 0, BN_QB,
                                BLOCK_K, XB, NS)
        elif op == _OP_ABSORB:
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if MLA:
                if st == 0:
                    mla_absorb_task(r0, nr, pos, qkv_ptr + Q_OFF, wa_ptr + tl.multiple_of(woff, 64),
                                    qkv_ptr + QLAT_OFF, qkv_ptr + QPE_OFF, qkv_ptr + KVA_OFF,
                                    wa_ptr + tl.load(lrow + P.LF_K_NORM),
                                    kv_ptr + layer.to(tl.int64) * kv_tmax * LAT_W, cos_ptr, sin_ptr, eps,
                                    DH, NOPE, VD, R_KV, ROT, ROPE_PAIR, BN_KVB, BLOCK_RKV, BLOCK_H)
        elif op == _OP_MLA_ATTN:
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if MLA:
                if st == 0:
                    mla_attention_task(r0, nr, aux, n_splits, pos, qkv_ptr + QLAT_OFF, qkv_ptr + QPE_OFF,
                                       kv_ptr + layer.to(tl.int64) * kv_tmax * LAT_W, ao_ptr, am_ptr, al_ptr,
                                       sm_scale, HQ, R_KV, ROT, BLOCK_HG, BLOCK_RKV, BLOCK_RD, BLOCK_T)
        elif op == _OP_VUP:
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if MLA:
                if st == 0:
                    mla_vup_task(r0, nr, n_splits, ao_ptr, am_ptr, al_ptr, wa_ptr + tl.multiple_of(woff, 64), h_ptr,
                                 HQ, NOPE, VD, R_KV, BN_KVB, BLOCK_RKV)
        elif op == _OP_LANE_O:   # Laneformer: wo of every lane for rows r0..r_end of D, then the lane combination
            if LANES > 0:
                w = wa_ptr + tl.multiple_of(woff, 64)
                for lane in tl.static_range(LANES):   # every lane's block of the task's rows into L2
                    prefetch_rows(w + lane * (D * (NQ // LANES)), r0, nr, NQ // LANES, 0, USE_ASM)
                w0, s0 = lane_out_tile(w, qf32_ptr, NQ // LANES, D, r0, r_end, 0, 1, LANES, 0, BN_O, BK_O)
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if TP > 0:   # DTP: a delayed layer also needs every rank's partials of layer i - DELAY (long there)
                if st == 0:
                    if xw >= 0:
                        wctr = symi_ptr + sym_ctr_off + xw   # (the watchdog reports this wait)
                        target = TP * (step + 1)
                        st = _kccl_wait(wctr, target, stop_ptr, timeout_ns, USE_ASM, NT, MODE)
                if st == 0:
                    st = flag_is_set(stop_ptr, USE_ASM, NT).to(tl.int32)
            if LANES > 0:
                if st == 0:
                    xin = ao_ptr   # every head's output (lane-major), as the o_proj's (ops.head_combine)
                    stream_lane_out(w, qf32_ptr, qf32_ptr, w0, s0, NQ // LANES, r0, r_end, xin, x_ptr,
                                    x_ptr + HIST_OFF, x_ptr + XF_OFF, layer, 0, 0, LANE_SCALE, symf_ptr, tp_rank, D,
                                    LANES, DELAY, RING, EARLY_COMM, USE_COMM, 0, BLOCK_L, BN_O, BK_O, XB, NS, TP)
                    if TP > 0:
                        if xc >= 0:   # our pre-summed partial of these rows into every rank's slot of (layer, attn)
                            _tp_put(symf_ptr + (layer * 2) * (TP * D) + tp_rank * D, poff_ptr, r0, r_end, xctr, TP,
                                    USE_ASM, BLOCK_X)
        elif op == _OP_LANE_DOWN:   # Laneformer: w2 of every lane, the lane combination; aux: also write xf
            if LANES > 0:
                w = wa_ptr + tl.multiple_of(woff, 64)
                for lane in tl.static_range(LANES):
                    prefetch_rows(w + lane * (D * (I_DENSE // LANES)), r0, nr, I_DENSE // LANES, 0, USE_ASM)
                w0, s0 = lane_out_tile(w, qf32_ptr, I_DENSE // LANES, D, r0, r_end, 0, 1, LANES, 0, BN_DOWN,
                                       BK_DOWN)
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if TP > 0:
                if st == 0:
                    if xw >= 0:
                        wctr = symi_ptr + sym_ctr_off + xw   # (the watchdog reports this wait)
                        target = TP * (step + 1)
                        st = _kccl_wait(wctr, target, stop_ptr, timeout_ns, USE_ASM, NT, MODE)
                if st == 0:
                    st = flag_is_set(stop_ptr, USE_ASM, NT).to(tl.int32)
            if LANES > 0:
                if st == 0:
                    stream_lane_out(w, qf32_ptr, qf32_ptr, w0, s0, I_DENSE // LANES, r0, r_end, h_ptr, x_ptr,
                                    x_ptr + HIST_OFF, x_ptr + XF_OFF, layer, 1, aux, LANE_SCALE, symf_ptr, tp_rank,
                                    D, LANES, DELAY, RING, EARLY_COMM, USE_COMM, 0, BLOCK_L, BN_DOWN, BK_DOWN, XB,
                                    NS, TP)
                    if TP > 0:
                        if xc >= 0:
                            _tp_put(symf_ptr + (layer * 2 + 1) * (TP * D) + tp_rank * D, poff_ptr, r0, r_end, xctr,
                                    TP, USE_ASM, BLOCK_X)
        elif op == _OP_LANE_AGG:   # Laneformer without pre_norm_lane_agg: xf = mean of the lanes' final norms
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if TP > 0:
                if st == 0:
                    st = flag_is_set(stop_ptr, USE_ASM, NT).to(tl.int32)
            if LANES > 0:
                if st == 0:
                    if TP > 0:   # this rank's lanes' sum into our row of every rank's recv_f, then a REDUCE (aux 2)
                        fo = symf_ptr + sym_pv_off - TP * D + tp_rank * D
                        if PRE_AGG:
                            lane_sum(x_ptr, fo, r0, r_end, D, LANES, BLOCK_L, BLOCK_X)
                        else:
                            lane_final_mean(x_ptr, wa_ptr + fnorm_off, fo, r0, r_end, eps, D, LANES, LANE_NORM,
                                            BLOCK_L, BLOCK_X, 0)
                        _tp_put(fo, poff_ptr, r0, r_end, xctr, TP, USE_ASM, BLOCK_X)
                    else:
                        lane_final_mean(x_ptr, wa_ptr + fnorm_off, x_ptr + XF_OFF, r0, r_end, eps, D, LANES,
                                        LANE_NORM, BLOCK_L, BLOCK_X)
        elif op == _OP_GATEUP:
            # up rows follow gate rows (codes, scales, factors)
            wg = _wp(FMT_MLP, wa_ptr, qw8_ptr, qw32_ptr, woff)
            wu = wg + I_DENSE * RU_D_MLP
            s_off = tl.load(lrow + P.LF_GATE_S)
            f_off = tl.load(lrow + P.LF_GATE_F)
            sg_ = _sp(FMT_MLP, qf32_ptr, qs8f_ptr, qs8u_ptr, s_off)
            su_ = _sp(FMT_MLP, qf32_ptr, qs8f_ptr, qs8u_ptr, s_off + I_DENSE * SC_D_MLP)
            prefetch_rows(wg, r0, nr, D, FMT_MLP, USE_ASM)
            prefetch_rows(wu, r0, nr, D, FMT_MLP, USE_ASM)
            if MM_MLP:   # on the tensor cores (mma8.py; its loads follow the wait, the rows are in L2 by then)
                t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                                   stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
                if st == 0:
                    mma8_glu_task(_wq(FMT_MLP, wa_ptr, qw32_ptr, woff),
                                  _wq(FMT_MLP, wa_ptr, qw32_ptr, woff + I_DENSE * RB_D_MLP), qf32_ptr + f_off,
                                  qf32_ptr + f_off + I_DENSE, D, r0, r_end, lx,
                                  wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_MLP_NORM), 64) + lnw, eps, wa_ptr,
                                  wa_ptr, h_ptr, glu_limit, glu_alpha, mscr_ptr + pid * MSCR, False, 0, NT // 32,
                                  BLOCK_XS, F_MLP, W_MLP, tr, trace_on, MODE == 3, sg_, su_, E4B, RP4)
            else:
                g0, gs0 = tile(wg, sg_, D, r0, r_end, 0, 1, FMT_MLP, BN_GU, BLOCK_K)
                u0, us0 = tile(wu, su_, D, r0, r_end, 0, 1, FMT_MLP, BN_GU, BLOCK_K)
                t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                                   stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
                if st == 0:
                    stream_glu(wg, wu, sg_, su_, qf32_ptr + f_off, qf32_ptr + f_off + I_DENSE, g0, u0, gs0, us0, D,
                               r0, r_end, lx, wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_MLP_NORM), 64) + lnw, eps,
                               wa_ptr, wa_ptr, h_ptr, glu_limit, glu_alpha, False, 0, FMT_MLP, BN_GU, BLOCK_K, XB,
                               NS)
        elif op == _OP_DOWN:
            w = _wp(FMT_MLP, wa_ptr, qw8_ptr, qw32_ptr, woff)
            sq = _sp(FMT_MLP, qf32_ptr, qs8f_ptr, qs8u_ptr, tl.load(lrow + P.LF_DOWN_S))
            prefetch_rows(w, r0, nr, I_DENSE, FMT_MLP, USE_ASM)
            if MM_MLP:
                wq = tl.multiple_of(_wq(FMT_MLP, wa_ptr, qw32_ptr, woff), 32)
                first = mma8_first(wq, I_DENSE, r0, r_end, NT // 32, W_MLP, sq)
            else:
                w0, s0 = tile(w, sq, I_DENSE, r0, r_end, 0, 1, FMT_MLP, BN_DOWN, BLOCK_K)
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if TP > 0:
                if st == 0:
                    st = flag_is_set(stop_ptr, USE_ASM, NT).to(tl.int32)
            yd = x_ptr
            if TP > 0:   # our row of every rank's recv_d
                yd = symf_ptr + TP * D + tp_rank * D
            if MM_MLP:   # (no TP: into x)
                if st == 0:
                    mma8_task(first, wq, qf32_ptr + tl.load(lrow + P.LF_DOWN_F), I_DENSE, r0, r_end, h_ptr, h_ptr,
                              eps, wa_ptr, x_ptr, x_ptr, mscr_ptr + pid * MSCR, False, False, True, NT // 32, BLOCK_XS,
                              F_MLP, W_MLP, tr, trace_on, MODE == 3, sq, E4B, RP4)
            elif st == 0:
                stream_gemv(w, sq, qf32_ptr + tl.load(lrow + P.LF_DOWN_F), w0, s0, I_DENSE, r0, r_end, h_ptr, h_ptr,
                            eps, wa_ptr, yd, yd, 0, pv_ptr, pi_ptr, 0, 1.0, 0, 0, False, False, TP == 0, False,
                            FMT_MLP, BN_DOWN, BLOCK_K, XB, NS)
                if TP > 0:
                    _tp_put(yd, poff_ptr, r0, r_end, xctr, TP, USE_ASM, BLOCK_X)
        elif op == _OP_ROUTER:
            w = wa_ptr + tl.multiple_of(woff, 64)
            w0, s0 = tile(w, qf32_ptr, D, r0, r_end, 0, 1, 0, BN_ROUTER, BLOCK_K)
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if st == 0:
                stream_gemv(w, qf32_ptr, qf32_ptr, w0, s0, D, r0, r_end, x_ptr,
                            wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_MLP_NORM), 64), eps,
                            wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_ROUTER_B), 64), rlog_ptr + layer * E,
                            rlog_ptr, 0, pv_ptr, pi_ptr, 0, 1.0, 0, 0, True, HAS_RBIAS, False, False, 0, BN_ROUTER,
                            BLOCK_K, XB, NS)
                if ROUTE_ONCE:   # the layer's last router task (a ticket) picks the top-k for every expert task
                    tl.debug_barrier()   # all of this task's logit stores precede the release below
                    tk = tl.atomic_add(rtk_ptr + layer, 1, sem="acq_rel", scope="gpu")
                    if tk % N_ROUTER == N_ROUTER - 1:
                        ids, wts = route(rlog_ptr + layer * E, wa_ptr + tl.load(lrow + P.LF_SCORE_B), route_scale, E,
                                         TOPK, SCORING, NORM_TOPK, HAS_SBIAS, BLOCK_E, BLOCK_TOPK, NG, TG, GSCORE,
                                         BLOCK_G, TOPK_MERGE)
                        _publish_route(ids, wts, rids_ptr + layer * TOPK, rwts_ptr + layer * TOPK, True, TOPK,
                                       BLOCK_TOPK)
        elif op == _OP_SH_UP:
            wg = _wp(FMT_EXP, wa_ptr, qw8_ptr, qw32_ptr, woff)
            wu = wg + I_SH * RU_D_EXP
            s_off = tl.load(lrow + P.LF_SGATE_S)
            f_off = tl.load(lrow + P.LF_SGATE_F)
            sg_ = _sp(FMT_EXP, qf32_ptr, qs8f_ptr, qs8u_ptr, s_off)
            su_ = _sp(FMT_EXP, qf32_ptr, qs8f_ptr, qs8u_ptr, s_off + I_SH * SC_D_EXP)
            prefetch_rows(wg, r0, nr, D, FMT_EXP, USE_ASM)
            prefetch_rows(wu, r0, nr, D, FMT_EXP, USE_ASM)
            g0, gs0 = tile(wg, sg_, D, r0, r_end, 0, 1, FMT_EXP, BN_SUP, BLOCK_K)
            u0, us0 = tile(wu, su_, D, r0, r_end, 0, 1, FMT_EXP, BN_SUP, BLOCK_K)
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if st == 0:
                nw = wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_MLP_NORM), 64)
                stream_glu(wg, wu, sg_, su_, qf32_ptr + f_off, qf32_ptr + f_off + I_SH, g0, u0, gs0, us0, D, r0,
                           r_end, x_ptr, nw, eps, wa_ptr, wa_ptr, h_ptr + TOPK * I_MOE, glu_limit, glu_alpha, False,
                           0, FMT_EXP, BN_SUP, BLOCK_K, XB, NS)
                if HAS_SH_GATE:
                    if r0 == 0:  # one task computes the shared expert's sigmoid gate
                        s = vec_dot_norm(wa_ptr + tl.load(lrow + P.LF_SH_GATE), x_ptr, nw, D, eps, BLOCK_K)
                        tl.store(sg_ptr, tl.sigmoid(s))
        elif op == _OP_EXP_UP:
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if st == 0:
                if ROUTE_ONCE:   # the router's last task published the ids (before its signal, which we waited on)
                    e = tl.load(rids_ptr + layer * TOPK + aux, cache_modifier=".cg").to(tl.int64)
                else:   # every expert task picks the (tiny) top-k itself: no extra phase
                    if RIN_O:   # from the accumulator every o_proj task added its share to before its signal
                        rb_ = racc_ptr + layer * RSTR
                        lg = route_acc_logits(rb_ + (step % 2) * RPAR,
                                              wa_ptr + tl.load(lrow + P.LF_ROUTER_B), eps, D, E, HAS_RBIAS, BLOCK_E)
                        if FUSE_DN:   # no down tasks: one task zeroes the other parity's row for the next step
                            if (aux == 0) & (r0 == 0):
                                route_acc_zero(rb_ + ((step + 1) % 2) * (E + 1), E, BLOCK_E)
                    else:       # from the router tasks' logits
                        lg = load_logits(rlog_ptr + layer * E, E, BLOCK_E)
                    ids, wts = route_lg(lg, wa_ptr + tl.load(lrow + P.LF_SCORE_B), route_scale, E, TOPK, SCORING,
                                        NORM_TOPK, HAS_SBIAS, BLOCK_E, BLOCK_TOPK, NG, TG, GSCORE, BLOCK_G,
                                        TOPK_MERGE)
                    # (one task publishes ids / weights for expert_down and the host)
                    _publish_route(ids, wts, rids_ptr + layer * TOPK, rwts_ptr + layer * TOPK, (aux == 0) & (r0 == 0),
                                   TOPK, BLOCK_TOPK)
                    e = tl.sum(tl.where(tl.arange(0, BLOCK_TOPK) == aux, ids, 0), axis=0).to(tl.int64)
                if MODE == 3:   # the trace's `mid` event: this task knows its expert
                    if trace_on:
                        tl.store(tr + 8, clock64() + e * 0)
                re_ = r_end
                nr_ = nr
                if E_LOC > 0:   # expert parallel: a slot routed to another rank's expert streams no rows here
                    mine = (e >= E_LO) & (e < E_LO + E_LOC)
                    e = tl.where(mine, e - E_LO, 0)
                    re_ = tl.where(mine, r_end, r0)
                    nr_ = tl.where(mine, nr, 0)
                # 16-byte aligned, said on the pointers themselves: Triton loses _wp's hint through this sum and
                # loaded the tiles byte by byte (sm_90 SASS of qwen3's expert gate/up loop: 64 LDG.U8 per step,
                # not pipelined, 1,095 instructions per step)
                wg = _wp(FMT_EXP, wa_ptr, qw8_ptr, qw32_ptr, tl.load(lrow + P.LF_EGATE)) + e * (I_MOE * RU_D_EXP)
                wu = _wp(FMT_EXP, wa_ptr, qw8_ptr, qw32_ptr, tl.load(lrow + P.LF_EUP)) + e * (I_MOE * RU_D_EXP)
                if EXP_AL:
                    wg = tl.multiple_of(wg, 16)
                    wu = tl.multiple_of(wu, 16)
                sg_ = _sp(FMT_EXP, qf32_ptr, qs8f_ptr, qs8u_ptr, tl.load(lrow + P.LF_EGATE_S) + e * (I_MOE * SC_D_EXP))
                su_ = _sp(FMT_EXP, qf32_ptr, qs8f_ptr, qs8u_ptr, tl.load(lrow + P.LF_EUP_S) + e * (I_MOE * SC_D_EXP))
                prefetch_rows(wg, r0, nr_, D, FMT_EXP, USE_ASM)   # experts are known only now
                prefetch_rows(wu, r0, nr_, D, FMT_EXP, USE_ASM)
                if DOWN_L2 and FUSE_DN:   # the fused down reads columns of every row: the slot's tasks' shares of
                    # the rows (together all of them) go out with the gate / up rows, in L2 by the loop's end
                    _down_share_l2(_edown(FMT_EXP, wa_ptr, qw8_ptr, qw32_ptr, lrow, e, D, RU_I_EXP), r0, re_, D,
                                   I_MOE, FMT_EXP, USE_ASM)
                if MM_EXP:   # on the tensor cores (mma8.py; no expert parallelism)
                    eoff = e * (I_MOE * RB_D_EXP)
                    mma8_glu_task(_wq(FMT_EXP, wa_ptr, qw32_ptr, tl.load(lrow + P.LF_EGATE) + eoff),
                                  _wq(FMT_EXP, wa_ptr, qw32_ptr, tl.load(lrow + P.LF_EUP) + eoff),
                                  qf32_ptr + tl.load(lrow + P.LF_EGATE_F) + e * I_MOE,
                                  qf32_ptr + tl.load(lrow + P.LF_EUP_F) + e * I_MOE, D, r0, re_, x_ptr + XM_OFF,
                                  wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_MLP_NORM), 64), eps,
                                  wa_ptr + tl.load(lrow + P.LF_EGATE_B) + e * I_MOE,
                                  wa_ptr + tl.load(lrow + P.LF_EUP_B) + e * I_MOE, h_ptr + aux * I_MOE, glu_limit,
                                  glu_alpha, mscr_ptr + pid * MSCR, HAS_EBIAS, EXP_ACT, NT // 32, BLOCK_XS,
                                  F_EXP, W_EXP, tr, trace_on, MODE == 3, sg_, su_, E4B, RP4)
                else:
                    g0, gs0 = tile(wg, sg_, D, r0, re_, 0, 1, FMT_EXP, BN_EUP, BLOCK_K)
                    u0, us0 = tile(wu, su_, D, r0, re_, 0, 1, FMT_EXP, BN_EUP, BLOCK_K)
                    stream_glu(wg, wu, sg_, su_, qf32_ptr + tl.load(lrow + P.LF_EGATE_F) + e * I_MOE,
                               qf32_ptr + tl.load(lrow + P.LF_EUP_F) + e * I_MOE, g0, u0, gs0, us0, D, r0, re_,
                               x_ptr + XM_OFF, wa_ptr + tl.multiple_of(tl.load(lrow + P.LF_MLP_NORM), 64), eps,
                               wa_ptr + tl.load(lrow + P.LF_EGATE_B) + e * I_MOE,
                               wa_ptr + tl.load(lrow + P.LF_EUP_B) + e * I_MOE,
                               h_ptr + aux * I_MOE, glu_limit, glu_alpha, HAS_EBIAS, EXP_ACT, FMT_EXP, BN_EUP,
                               BLOCK_K, XB, NS)
                if FUSE_DN:   # this task's columns of expert e's down, weighted, added into x (fused_down.py)
                    tl.debug_barrier()   # every thread's h stores before they are read back
                    wt = tl.sum(tl.where(tl.arange(0, BLOCK_TOPK) == aux, wts, 0.0), axis=0)
                    expert_down_cols(_edown(FMT_EXP, wa_ptr, qw8_ptr, qw32_ptr, lrow, e, D, RU_I_EXP),
                                     qf32_ptr + tl.load(lrow + P.LF_EDOWN_F) + e * D,
                                     wa_ptr + tl.load(lrow + P.LF_EDOWN_B) + e * D, h_ptr + aux * I_MOE, wt, r0, nr_,
                                     x_ptr, r0 == 0, D, I_MOE, F_EXP, HAS_EBIAS, FD_AL, FD_BD, FD_NS)
                elif DOWN_L2:   # this tile's share of expert e's down rows ([D, I_MOE]: rows r0 D / I_MOE ..
                    # r_end D / I_MOE; a slot's tiles cover all D) into L2 while the gate / up phase finishes, so
                    # the down tasks' loads hit L2 instead of queueing for HBM after their wait (KIE_DOWN_L2)
                    _down_share_l2(_edown(FMT_EXP, wa_ptr, qw8_ptr, qw32_ptr, lrow, e, D, RU_I_EXP), r0, re_, D,
                                   I_MOE, FMT_EXP, USE_ASM)
        elif op == _OP_EXP_DOWN:
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if TP > 0:
                if st == 0:
                    st = flag_is_set(stop_ptr, USE_ASM, NT).to(tl.int32)
            ye = x_ptr
            if TP > 0:
                ye = symf_ptr + TP * D + tp_rank * D
            if RIN_O:   # every gate / up task of the layer read its accumulator: zero it for the next step
                if (st == 0) & (r0 == 0):
                    route_acc_zero(racc_ptr + layer * (E + 1), E, BLOCK_E)
            if st == 0:
                if USE_ASM and not DOWN_L2:   # the routed experts' rows of this task, all slots at once, into L2
                    eb = _wbase(FMT_EXP, wa_ptr, qw8_ptr, qw32_ptr) + _wu(FMT_EXP, tl.load(lrow + P.LF_EDOWN))
                    for j in tl.static_range(TOPK):
                        e = tl.load(rids_ptr + layer * TOPK + j).to(tl.int64)
                        if E_LOC > 0:   # expert parallel: this rank's slots only
                            e = e - E_LO
                            prefetch_rows(eb + e * (D * RU_I_EXP), r0, tl.where((e >= 0) & (e < E_LOC), nr, 0),
                                          I_MOE, FMT_EXP, USE_ASM)
                        else:
                            prefetch_rows(eb + e * (D * RU_I_EXP), r0, nr, I_MOE, FMT_EXP, USE_ASM)
                if MMA_DN:   # on the tensor cores (mma8.py; no TP, no EP: into x)
                    mma8_down_task(_wq(FMT_EXP, wa_ptr, qw32_ptr, 0), tl.load(lrow + P.LF_EDOWN),
                                   tl.load(lrow + P.LF_SDOWN), qf32_ptr,
                                   tl.load(lrow + P.LF_EDOWN_F), tl.load(lrow + P.LF_SDOWN_F),
                                   wa_ptr + tl.load(lrow + P.LF_EDOWN_B), r0, r_end, h_ptr, rids_ptr + layer * TOPK,
                                   rwts_ptr + layer * TOPK, sg_ptr, x_ptr, mscr_ptr + pid * MSCR, D, I_MOE, I_SH,
                                   TOPK, HAS_EBIAS, HAS_SH_GATE, NT // 32, BLOCK_XS, F_EXP, W_EXP, tr, trace_on,
                                   MODE == 3, qs8u_ptr, tl.load(lrow + P.LF_EDOWN_S), tl.load(lrow + P.LF_SDOWN_S),
                                   E4B, RP4)
                else:
                    stream_expert_down(_wbase(FMT_EXP, wa_ptr, qw8_ptr, qw32_ptr),
                                       _sp(FMT_EXP, qf32_ptr, qs8f_ptr, qs8u_ptr, tl.zeros((), tl.int64)), qf32_ptr,
                                       _wu(FMT_EXP, tl.multiple_of(tl.load(lrow + P.LF_EDOWN), 64)),
                                       tl.load(lrow + P.LF_EDOWN_S), tl.load(lrow + P.LF_EDOWN_F),
                                       _wu(FMT_EXP, tl.multiple_of(tl.load(lrow + P.LF_SDOWN), 64)),
                                       tl.load(lrow + P.LF_SDOWN_S), tl.load(lrow + P.LF_SDOWN_F),
                                       wa_ptr + tl.load(lrow + P.LF_EDOWN_B), r0, r_end, h_ptr,
                                       rids_ptr + layer * TOPK, rwts_ptr + layer * TOPK, sg_ptr, x_ptr, ye, D, I_MOE,
                                       I_SH, TOPK, HAS_EBIAS, HAS_SH_GATE, FMT_EXP, BLOCK_TOPK, BN_EDOWN, BLOCK_K, XB,
                                       NS, TP == 0, E_LO, E_LOC)
                if TP > 0:
                    _tp_put(ye, poff_ptr, r0, r_end, xctr, TP, USE_ASM, BLOCK_X)
        elif op == _OP_LM:
            w = wa_ptr + tl.multiple_of(woff, 64)
            prefetch_rows(w, r0, nr, D, 0, USE_ASM)
            w0, s0 = tile(w, qf32_ptr, D, r0, r_end, 0, 1, 0, BN_LM, BLOCK_K)
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if TP > 0:
                if st == 0:
                    st = flag_is_set(stop_ptr, USE_ASM, NT).to(tl.int32)
            pvo = pv_ptr
            pio = pi_ptr
            if TP > 0:   # our row of every rank's pv / pi [TP, n_lm]
                pvo = symf_ptr + sym_pv_off + tp_rank * n_lm
                pio = symi_ptr + sym_pv_off + TP * n_lm + tp_rank * n_lm
            if (st == 0) & (step >= n_forced):   # prompt steps (in-kernel prefill) need no logits
                if SFILTER:   # the logits themselves, for the sample_tile tasks
                    stream_gemv(w, qf32_ptr, qf32_ptr, w0, s0, D, r0, r_end, x_ptr + XF_OFF,
                                wa_ptr + tl.multiple_of(fnorm_off, 64), eps, w, slg_ptr, slg_ptr, aux, pvo, pio,
                                0, 1.0, 0, 0, LM_NORM, False, False, False, 0, BN_LM, BLOCK_K, XB, NS)
                else:
                    stream_gemv(w, qf32_ptr, qf32_ptr, w0, s0, D, r0, r_end, x_ptr + XF_OFF,
                                wa_ptr + tl.multiple_of(fnorm_off, 64), eps, w, pvo, pvo, aux, pvo, pio,
                                do_sample, inv_temp, seed, step - n_forced, LM_NORM, False, False, True, 0, BN_LM,
                                BLOCK_K, XB, NS)
            if TP > 0:   # prompt steps too: the sampler of every rank counts every tile of every step
                if st == 0:
                    tl.debug_barrier()
                    for q in range(0, TP):
                        put_span(pvo, poff_ptr, q, aux, aux + 1, 16)
                        put_span(pio, poff_ptr, q, aux, aux + 1, 16)
                        signal_peer(xctr, poff_ptr, q, USE_ASM)
        elif op == _OP_SAMPLE:
            t_next, row_next = _claim_if(CLAIM != 2, cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, USE_ASM)
            pvs = pv_ptr
            pis = pi_ptr
            if TP > 0:   # every rank's tiles, in rank (= vocab) order
                wctr = symi_ptr + sym_ctr_off + wc
                st = _kccl_wait(wctr, target, stop_ptr, timeout_ns, USE_ASM, NT, MODE)
                pvs = symf_ptr + sym_pv_off
                pis = symi_ptr + sym_pv_off + TP * n_lm
            else:
                st = _wait(wctr, target, stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on)
            if st == 0:
                if step < n_forced:   # in-kernel prefill: the next input is the prompt's next token
                    tok = tl.load(forced_ptr + step + 1)
                else:
                    if SFILTER:   # the sample_tile tasks' partials -> top-k / top-p draw (-1: non-finite logits)
                        tok = tl.sum(sample_final_task(0, sparams_ptr, srng_ptr, spf_ptr, spi_ptr, scand_ptr, sgf_ptr,
                                                       sgi_ptr, sout_ptr, sout_ptr, sstat_ptr, n_stiles, 1, 1,
                                                       step - n_forced, True, K_CAND, False, False, 1, SBLOCK_T,
                                                       SBLOCK_C), axis=0)
                    else:
                        tok = pick_token(pvs, pis, n_lm * (TP + (TP == 0)), BLOCK_P)
                    g = step - n_forced                          # generated token index
                    tl.store(ring_ptr + 1 + g, tok)              # host-visible ring: token first,
                    st_release_sys(ring_ptr, g + 1, USE_ASM)     # then the count (system-scope release)
                    tl.store(ctrl_ptr + 6, g + 1)                # CT_NTOK
                    offs_eos = tl.arange(0, BLOCK_EOS)
                    eos = tl.load(eos_ptr + offs_eos, mask=offs_eos < n_eos, other=-1)
                    hit = (tl.sum((eos == tok).to(tl.int32), axis=0) > 0) & (ignore_eos == 0)
                    host_stop = flag_is_set(hostflag_ptr, USE_ASM, NT)
                    broken = tok < 0    # non-finite logits: the host raises at this token (engine._checked)
                    if hit | host_stop | broken:
                        tl.store(ctrl_ptr + 5, tl.where(hit, 1, tl.where(broken, 3, 2)))  # CT_REASON
                        tl.store(stop_ptr, 1)
                for lane in tl.static_range(NLX):   # every lane's stream starts as the embedding
                    embed_row(wa_ptr + embed_off, tl.maximum(tok, 0), x_ptr + lane * D, D, BLOCK_X)
        elif SFILTER and op == _OP_SAMPLE_TILE:
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
            if (st == 0) & (step >= n_forced):   # noise keyed by (seed, generated index): sampling.py's Philox
                sample_tile_task(aux, 0, slg_ptr, vocab, sparams_ptr, srng_ptr, spf_ptr, spi_ptr, scand_ptr,
                                 sgf_ptr, sgi_ptr, n_stiles, 1, step - n_forced, True, K_CAND, 1, SBLOCK_V)
        elif op == _OP_REDUCE:
            t_next, row_next = _claim_if(CLAIM != 2, cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, USE_ASM)
            wctr = symi_ptr + sym_ctr_off + wc
            st = _kccl_wait(wctr, target, stop_ptr, timeout_ns, USE_ASM, NT, MODE)
            if TP > 0:
                if st == 0:
                    if LANES > 0:   # aux: 0 / 1 = a same-layer lane combination (attn / ffn), 2 = xf
                        if aux == 2:
                            lane_final_reduce(symf_ptr + sym_pv_off - TP * D, x_ptr + XF_OFF, r0, r_end, D, TP,
                                              PRE_AGG == 0, LANES_ALL, BLOCK_X)
                        else:
                            lane_reduce(symf_ptr, x_ptr, x_ptr + HIST_OFF, layer, aux, r0, r_end, D, LANES, DELAY,
                                        RING, TP, BLOCK_L, BLOCK_X)
                    else:           # aux: 0 = recv_o, 1 = recv_d
                        _tp_reduce(symf_ptr + aux * (TP * D), x_ptr, r0, r_end, D, TP, BLOCK_X)
        else:  # MODE 1 (sync only), or an unknown opcode: claim, wait, signal
            t_next, row_next, st = _claim_wait(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, wctr, target,
                                               stop_ptr, timeout_ns, USE_ASM, NT, MODE, tr, trace_on, CLAIM)
        if st == 0:
            signal(cnt_ptr + sig, 1, USE_ASM)
        if MODE == 3:
            _stamp(tr, 2, trace_on)
            if trace_on:
                tl.store(tr + 6, pid)
        if st == _WAIT_YIELD:   # interpreter: resume here once the other ranks ran (shard.py)
            tl.store(ctrl_ptr + _CT_YIELD, t + 1)
            tl.store(stop_ptr, 1)
        if st == 2:
            # watchdog: every program that trips records (task + 1, have, need) in its own slot after the N_CTRL
            # words, then everyone stops. The host names the earliest task in claim order: the root cause (the
            # tasks downstream of a stuck one time out too, and which program trips first is a race on a GPU).
            tl.atomic_xchg(ctrl_ptr + 1, 1)                      # CT_ERR
            rec = ctrl_ptr + _N_CTRL + 3 * pid
            tl.store(rec, t + 1)                                 # global index (step * T + row) + 1
            tl.store(rec + 1, read_counter(wctr, USE_ASM))
            tl.store(rec + 2, target)
            tl.atomic_xchg(stop_ptr, 1)
        if CLAIM == 2:   # "late": the successor, after this task's signal (_claim_wait)
            t_next, row_next = _claim(cursor_ptr, tasks_ptr, n_tasks, n_total, offs_f, USE_ASM)
        stopping = flag_is_set(stop_ptr, USE_ASM, NT)
        t = t_next
        rowv = row_next
        if stopping:
            t = n_total

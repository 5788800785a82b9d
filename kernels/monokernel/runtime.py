"""MonokernelBackend: prefill through torch, then ONE persistent launch decodes up to max_new_tokens, streaming
tokens through a host-visible ring while the kernel runs.

- Prefill, two ways. "torch" (default): kernels/prefill.py's batched prefill (grouped expert GEMMs, SDPA) over
  views of the plan's float arena and quantized buffers (quantized Linears dequantized per layer into scratch, no
  float copy of the model), writing the layout the kernel reads ([L, 2, Hkv, T_max, Dh]; MLA [L, T_max, r_kv +
  rope]); the prompt's last token is not prefilled: decode step 0 runs it, so every sampled token comes from the
  kernel. "kernel": the same launch first runs the prompt as forced decode steps (its tokens fed as the next
  inputs, LM head skipped), then generates (no torch at all; one decode step per prompt token).
- Decode: counters, cursor and control words zeroed, x = embed[last prompt token], one launch of n_steps =
  max_new_tokens steps. The kernel writes token s to ring[1 + s], then ring[0] = s + 1 (system-scope release);
  the host polls ring[0] and yields. EOS (unless ignore_eos), max tokens, or the host stop flag (set when the
  consumer stops iterating) end the launch.
- Watchdog: a wait that times out (GPU) or can never be met (interpreter) records the task; the host raises a
  RuntimeError naming it (op, layer, rows, step, the counter and both counts). Everything is re-zeroed per
  launch, so the next launch works.
"""
from __future__ import annotations

import os
import time
from typing import Iterator

import numpy as np
import torch

from kie_moe.models.errors import InputError
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.models.rope import cos_sin

from ..device_caps import e4m3_native, has_fp8e4nv, offline_target
from ..prefill import Prefill
from ..sampling import DeviceSampler, needs_filter
from . import lanes
from . import plan as P
from .mma8 import scratch_words
from .kernel import CT_ERR, CT_ERR_HAVE, CT_ERR_NEED, CT_STOP, CT_YIELD, N_CTRL, monokernel

_MAX_EOS = 16
_COUNTER_KINDS = ("qkv_proj", "attention", "o_proj", "router", "gate_up", "layer_out", "q_b_proj", "mla_absorb",
                  "mla_v_up", "o_proj_sent", "down_sent")


def _pow2(n: int) -> int:
    return P._pow2(n)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class ArenaStore:
    """WeightStore-like view of the plan's arena (names(), get(), in): the prefill reads the same bytes."""

    def __init__(self, plan: P.Plan):
        self.plan = plan
        self.path = "<monokernel arena>"

    def names(self) -> list[str]:
        return self.plan.names()

    def __contains__(self, name: str) -> bool:
        return name in self.plan.arena.entries or (self.plan.qarena is not None and name in self.plan.qarena.entries)

    def get(self, name: str) -> torch.Tensor:
        return self.plan.view(name)


def gumbel_ref(seed: int, step: int, ids: np.ndarray) -> np.ndarray:
    """numpy mirror of ops.gumbel (for tests of temperature sampling)."""
    def h32(x):
        x = x.astype(np.uint64) & 0xFFFFFFFF
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        x ^= x >> 16
        return x
    key = h32(np.array([(seed + step * 0x9E3779B9) & 0xFFFFFFFF], dtype=np.uint64))
    h = h32(key ^ ids.astype(np.uint64))
    u = ((h >> 8).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / 16777216.0)
    return -np.log(-np.log(u))


class MonokernelBackend:
    """Backend contract of kie_moe.engine: `.name`, `generate(prompt_ids, SamplingParams, eos_ids)`."""
    name = "monokernel"

    def __init__(self, model, device: torch.device | str = "cuda", *, kv_dtype: torch.dtype | None = None,
                 prefill_dtype: torch.dtype | None = None, timeout_ms: float | None = None,
                 num_warps: int | None = None, max_splits: int | None = None, plan: P.Plan | None = None,
                 offline: bool = False, prefill: str | None = None, maxnreg: int | None = None,
                 sample_block_v: int | None = None, k_cand: int = 64, **plan_opts):
        self.device = torch.device(device)
        self.interpret = interpreting() and not offline  # offline: buffers for compile_offline(), no launches
        # under the interpreter a launch runs to its end before the host reads the ring: no token streams early
        self.streams_tokens = not self.interpret
        if self.device.type != "cuda" and not self.interpret and not offline:
            raise InputError("monokernel backend: needs a CUDA GPU (or TRITON_INTERPRET=1 on CPU, for tests)")
        spec = model.spec if plan is None else plan.spec
        self.plan = plan or P.build_plan(spec, model.weights, self.device, **plan_opts)
        self.spec, d = spec, self.plan.dims
        self.dims = d
        self.kv_dtype = kv_dtype or (torch.float32 if self.device.type == "cpu" else self.plan.wdtype)
        self.prefill_dtype = prefill_dtype or self.plan.wdtype
        # "torch": kernels/prefill.py's batched prefill over the plan's buffers (quantized Linears dequantized per
        # layer into scratch); "kernel": the prompt runs through the monokernel as forced decode steps
        if prefill not in (None, "torch", "kernel"):
            raise InputError(f"monokernel: prefill must be 'torch' or 'kernel', got {prefill!r}")
        self.prefill_mode = prefill or "torch"
        self.timeout_ns = int((timeout_ms if timeout_ms is not None
                               else float(os.environ.get("KIE_MONOKERNEL_TIMEOUT_MS", 500))) * 1e6)
        # warps and a register cap (ptxas) such that all of the plan's programs per SM fit at once
        pp = self.plan.programs_per_sm
        self.num_warps = num_warps or P.launch_warps(pp)
        self.maxnreg = maxnreg or P.launch_maxnreg(pp, self.num_warps)
        self.grid = 1 if self.interpret else self.plan.n_sms
        groups = len(self.plan.op_rows["mla_attn"]) if d.MLA else d.HKV   # attention tasks per split
        self.max_splits = max_splits or max(1, self.plan.n_sms // groups)
        # K+V bytes per attention split (pick_splits): 8 KB for GQA tasks, measured; MLA's tasks (mla.py, another
        # loop) keep the 32 KB they were tuned at
        split_kb = os.environ.get("KIE_ATTN_SPLIT_KB", "32" if d.MLA else "8")
        if not split_kb.isdigit() or int(split_kb) < 1:
            raise ValueError(f"KIE_ATTN_SPLIT_KB={split_kb!r}: expected a positive number of KB of K+V per split")
        self.split_kb = int(split_kb)
        self.n_splits_override: int | None = None   # tests: force attention splits
        # Long contexts walk the cache in larger blocks: a launch whose last position reaches KIE_ATTN_LONG_FROM
        # (default 4096) runs attention with BLOCK_T = KIE_ATTN_LONG_BLOCK_T (default 64; 0: never), a second
        # compiled variant. Past ~2K positions the splits are at max_splits and each split's block loop grows with
        # the context (session 34, H100, bf16x2 dots at 8,192 positions: qwen3-30b-a3b fp8 188.6 -> 197.7 tok/s,
        # llama-3.2-1b bf16 572.5 -> 611.4; at 32 positions the larger tiles cost qwen3 2.8%: registers). GQA only:
        # MLA's loop and the Laneformer (-7.9% at 32 positions) keep the plan's block_t.
        lbt = int(P.env_choice("KIE_ATTN_LONG_BLOCK_T", "64", ("0", "16", "32", "64", "128")))
        lfrom = os.environ.get("KIE_ATTN_LONG_FROM", "4096")
        if not lfrom.isdigit():
            raise ValueError(f"KIE_ATTN_LONG_FROM={lfrom!r}: expected a context length in positions")
        # long_block_t 0: launches never switch (MLA, lanes, or blocks no larger than the plan's)
        switch = lbt > self.plan.tiles.block_t and not (d.MLA or d.LANES)
        self.long_block_t, self.long_from = (lbt, int(lfrom)) if switch else (0, 0)
        self._plant: tuple[int, int] | None = None  # tests: (task row, extra count) for the next launch only
        self._tasks: dict[tuple[int, int], torch.Tensor] = {}   # (attention splits, sample tiles) -> table
        self._tasks1_host: dict[int, torch.Tensor] = {}  # one-split tables, host copies: split_tasks' templates
        # top-k / top-p: a kernels/sampling.DeviceSampler's buffers and tile / final tasks inside the kernel, made at
        # the first such request (sample_block_v / k_cand: its vocab tile and candidates per tile). Tiles of 4096:
        # of 2048 / 4096 / 8192 the variant with the least spill offline (qwen3-30b-a3b fp8, sm_90: 272 B of stack
        # vs 424 / 376, all in 64-106 STL); the default kernel is unchanged (250 registers, no stack).
        self._sampler_opts = dict(block_v=sample_block_v or 4096, k_cand=k_cand)
        self._sampler = None
        self._prefill_decoder = None
        self._prefiller = None
        self.kv_tmax = 0
        self._alloc()
        self.last_launch: dict = {}
        self._done = None

    # ---- buffers ------------------------------------------------------------------------------------------------
    def _alloc(self):
        d, dev, f32, i32 = self.dims, self.device, torch.float32, torch.int32
        nq = d.HQ * d.DH
        z = lambda *s, dt=f32: torch.zeros(*s, dtype=dt, device=dev)  # noqa: E731
        # KIE_FUSE_DOWN=1 (plan.fused_down; experiment, off until measured): the routed experts' down inside their
        # gate / up tasks (fused_down.py): x gets a second row, the experts' input copy
        self.fuse_down = P.fused_down(d)
        self.x = z(lanes.state_size(d) * (2 if self.fuse_down else 1))   # [D]; Laneformer: lanes [L, D], xf [D],
        # partial history (lanes.py)
        # MLA: [q_a | kv_a] (or [q | kv_a]), q, q_lat [H, r_kv], q_pe [H, rope] (kernel.monokernel's offsets)
        self.qkv = z(d.NQKV + (d.HQ * d.DH if d.R_Q else 0) + d.HQ * (d.R_KV + d.ROT) if d.MLA else d.NQKV)
        self.ao_width = max(nq, d.HQ * d.R_KV)       # a split's partial outputs: [HQ, DH] or (MLA) [H, r_kv]
        self.ao = z(self.max_splits, self.ao_width)
        self.am, self.al = z(self.max_splits, d.HQ), z(self.max_splits, d.HQ)
        self.acnt = z(d.L * max(d.HKV, 1), dt=i32)   # per (layer, kv head): splits done (ops.attention_task)
        self.h = z(max(d.I_DENSE, d.TOPK * d.I_MOE + d.I_SH, d.HQ * d.VD, 1))
        self.rlog = z(d.L, max(d.E, 1))
        self.rids = z(d.L, max(d.TOPK, 1), dt=i32)
        self.rwts = z(d.L, max(d.TOPK, 1))
        self.sg = z(1)
        # Tensor-core tasks (mma8.py), each program with a scratch of MSCR fp32 words (the task's input as fp16 /
        # hi + lo pairs, the K ranges' partial sums). KIE_MONO_FP8_MMA (default 1; 0: the CUDA-core tasks, its A/B:
        # +13% qwen3-30b-a3b fp8, +18% llama-3.2-1b fp8 on an H200, session 32): the fp8 q|k|v, o_proj, dense MLP
        # and routed-expert tasks; KIE_MONO_W16_MMA=1 (off): those whose weights are the bf16 / fp16 arena's.
        # Not for lanes, MLA, tensor or expert parallelism; every K a multiple of 16 (whole 16-byte row pieces).
        has_exp = d.E > 0 and d.I_MOE > 0
        plain = (not d.LANES and not d.MLA and not d.TP and not d.E_LOC and d.D % 16 == 0
                 and (d.HQ * d.DH) % 16 == 0 and d.I_DENSE % 16 == 0)
        fmts = (d.FMT_ATTN, d.FMT_MLP if d.I_DENSE else -1, d.FMT_EXP if has_exp else -1)
        self.mma8 = (P.env_flag("KIE_MONO_FP8_MMA", True) and plain and 1 in fmts
                     and (self.device.type != "cuda" or has_fp8e4nv(self.device)))   # e4m3 converts: sm_89+
        w16 = {torch.bfloat16: 1, torch.float16: 2}.get(self.plan.wdtype, 0)
        self.mma16 = w16 if (os.environ.get("KIE_MONO_W16_MMA", "0") == "1" and plain and 0 in fmts) else 0
        # KIE_MONO_FP4_MMA (plan.fp4_mma_tasks): the nvfp4 / mxfp4 tasks through fp4_mma's loop (mma8.py's WK 3 / 4)
        self.mma4 = P.fp4_mma_tasks(d)
        qa = self.plan.qarena
        if qa is not None and qa.packed != P.fp4_packed_names(d, qa.entries):
            raise ValueError("monokernel: the plan's fp4 codes were packed for another set of tensor-core tasks "
                             "(KIE_MONO_FP4_MMA / KIE_MONO_FP4_PACK / KIE_MONO_FP8_MMA_DOWN changed after build_plan): "
                             "build the plan and the backend with the same flags")
        # the experts' down task too where its widths are multiples of 16 (fp4: plan.fp4_mma_down;
        # KIE_MONO_FP8_MMA_DOWN=0: its A/B)
        self.mma_down = P.fp4_mma_down(d) if d.FMT_EXP >= 3 else (
            has_exp and d.I_MOE % 16 == 0 and d.I_SH % 16 == 0
            and (self.mma8 if d.FMT_EXP == 1 else (d.FMT_EXP == 0 and self.mma16 > 0))
            and os.environ.get("KIE_MONO_FP8_MMA_DOWN", "1") == "1")
        self.mma_any = self.mma8 or self.mma16 > 0 or self.mma4
        # attention's score and p.V dots (ops.attention_task PREC): "ieee" fp32 FMAs, "tf32x3" tensor cores at
        # ~fp32 accuracy, "tf32" one tf32 product (timing only), "bf16x2" q / p as 16-bit hi + lo against the cache,
        # "bf16" q / p rounded to it (ops._dot). Default bf16x2 (session 34, H100: qwen3-30b-a3b fp8 at 8K context
        # 120.5 -> 188.6 tok/s, llama-3.2-1b bf16 439.9 -> 572.5, at 32 positions +0.4% / +4.1%; the attention task
        # alone 18.9 -> 7.2 us at 36 positions); the Laneformer keeps ieee (laneformer-2b fp16 435.9 -> 425.4 with
        # bf16x2: -2.4%)
        self.attn_prec = P.env_choice("KIE_ATTN_DOT", "ieee" if d.LANES else "bf16x2",
                                      ("ieee", "tf32x3", "tf32", "bf16x2", "bf16"))
        k_max = max(d.D, d.HQ * d.DH, d.I_DENSE, d.TOPK * d.I_MOE + d.I_SH)
        # The tensor-core tasks stage their input (mma8._stage_x / _stage_h) in blocks of BLOCK_XS values: all of it
        # in one block ("once": every load out at once, one round trip, the RMSNorm from registers), or the kernel's
        # BLOCK_X ("loop": a round trip per block and pass, 4-6 per task at qwen3's sizes; KIE_MMA8_STAGE=loop).
        stage = P.env_choice("KIE_MMA8_STAGE", "once", ("once", "loop"))
        self.stage_block = min(_pow2(k_max), 16384) if stage == "once" else 0   # 0: the kernel's BLOCK_X
        # KIE_ROUTE_ONCE (default 1; 0: its A/B): the top-k is picked once per layer and step, by the router task
        # that finishes last (a ticket), instead of by every expert gate / up task (~3.7 us each of qwen3's, H100
        # trace); they read their expert id. With the late claim +3.0% (qwen3-30b-a3b fp8, H100, session 32;
        # neutral with the old claim-ahead). One GPU only (tensor / expert parallel ranks keep the recomputation).
        # KIE_ROUTE_IN_O (plan.route_in_o, default on): no router tasks; the o_proj tasks add the logits into racc,
        # every expert gate / up task picks the top-k from it (ROUTE_ONCE's tickets have no router tasks to count)
        self.route_in_o = P.route_in_o(d)
        self.route_once = (P.env_flag("KIE_ROUTE_ONCE", True) and d.E > 0 and not d.TP
                           and not d.E_LOC and not self.route_in_o)
        self.rticket = z(max(d.L, 1), dt=i32)
        self.racc = z(max(d.L, 1), 2 if self.fuse_down else 1, d.E + 1, dt=torch.int64)   # (FUSE_DN: by step parity)
        # the fused down's tiles (fused_down.expert_down_cols): [KIE_FD_BD, 16] weights per step, KIE_FD_NS stages
        # through shared memory (0: two in registers). Offline sm_90, qwen3-30b-a3b fp8: 1024 x 3 stages and 512 x 0
        # build without spills (48 / 16 KB in flight per program), 1024 x 0 and 2048 x 2 spill (NOTES session 42)
        self.fd_block_d = int(P.env_choice("KIE_FD_BD", "1024", ("256", "512", "1024", "2048")))
        self.fd_stages = int(P.env_choice("KIE_FD_NS", "3", ("0", "2", "3", "4")))
        self.fd_aligned = self.fuse_down and P.fused_down_aligned(d, self.plan.op_rows.get("exp_up", ()))
        # KIE_TOPK_MERGE=1 (experiment, off until measured): the top-k (every gate / up task's, or the router ticket's)
        # 4 slots per block reduction (ops.route_lg MERGE): qwen3's top-8 in 2 reductions instead of 10; the trace put
        # the 10 at 2.63 us of each gate / up task (session 41)
        self.topk_merge = P.env_flag("KIE_TOPK_MERGE", False)
        # KIE_CLAIM: when a task claims its successor (kernel._claim_wait): "late" (default: after its signal, so
        # the next task goes to the first program that is free), "wait" (after its wait), "ahead" (before its wait,
        # the old default). H200, qwen3-30b-a3b fp8: ahead 206.0, wait 227.8, late 252.3 tok/s (session 32).
        self.claim = ("ahead", "wait", "late").index(P.env_choice("KIE_CLAIM", "late", ("ahead", "wait", "late")))
        # KIE_DOWN_L2 (default 1; 0: its A/B): each expert gate / up task, once its stream is done, prefetches its
        # share of its expert's down rows into L2; the down tasks then skip their own prefetch, which they could
        # issue only after their wait (H200, qwen3 fp8: down task 9.4 -> 5.9 us, +4.1% tok/s; session 32)
        self.down_l2 = P.env_flag("KIE_DOWN_L2", True) and d.E > 0 and d.I_MOE > 0
        self.mscr_words = scratch_words(k_max, self.num_warps, self.mma16 > 0) if self.mma_any else 4
        self.mscr = z(self.grid * self.mscr_words)
        self.pv, self.pi = z(self.plan.n_lm_tiles), z(self.plan.n_lm_tiles, dt=i32)
        self.counters = z(P.n_counters(self.spec), dt=i32)
        self.cursor = z(1, dt=i32)
        self.trace = torch.zeros(1, P.TRACE_W, dtype=torch.int64, device=dev)   # launch(trace_tasks=...) grows it
        self.ctrl = z(N_CTRL + 3 * self.grid, dt=i32)
        self.eos = z(_MAX_EOS, dt=i32)
        self.forced = z(1, dt=i32)                     # prompt ids of an in-kernel prefill
        pin = self.device.type == "cuda"
        # host-visible words: the kernel writes tokens here, the host writes the stop flag
        self.hostflag = torch.zeros(1, dtype=i32, pin_memory=pin)
        self.ring = torch.zeros(1, dtype=i32, pin_memory=pin)
        # tensor parallel: the symmetric region (shard.py attaches a mapped one and the peer distances); unsharded
        # plans get stand-ins that are never read
        if self.plan.dims.TP:
            self.attach_symmetric(z(self.plan.sym_layout()["words"], dt=i32), torch.zeros(self.plan.dims.TP,
                                  dtype=torch.int64, device=dev))
        else:
            self.attach_symmetric(z(16, dt=i32), torch.zeros(1, dtype=torch.int64, device=dev))

    def attach_symmetric(self, sym: torch.Tensor, poff: torch.Tensor):
        """sym: this rank's symmetric region (int32 words, plan.sym_layout()); poff[q]: distance in words from it to
        rank q's copy (0 for ourselves)."""
        self.sym, self.poff = sym, poff

    def _ensure_kv(self, n_pos: int):
        if n_pos <= self.kv_tmax:
            return
        d = self.dims
        tmax = max(256, _pow2(n_pos))
        tmax = min(tmax, max(self.spec.max_position, n_pos))
        if d.MLA:   # latent | k_pe per position
            self.kv = torch.zeros(d.L, tmax, d.R_KV + d.ROT, dtype=self.kv_dtype, device=self.device)
        else:
            self.kv = torch.zeros(d.L, 2, d.HKV, tmax, d.DH, dtype=self.kv_dtype, device=self.device)
        cos, sin = cos_sin(self.spec.layers[0].attn.rope, torch.arange(tmax))
        self.cos, self.sin = cos.float().contiguous().to(self.device), sin.float().contiguous().to(self.device)
        self.kv_tmax = tmax

    def _ensure_ring(self, n: int):
        if self.ring.numel() < n + 1:
            self.ring = torch.zeros(n + 1, dtype=torch.int32, pin_memory=self.device.type == "cuda")

    def tasks(self, n_splits: int, sample_tiles: int = 0) -> torch.Tensor:
        """The task table for n_splits attention splits; sample_tiles > 0: with filtered sampling's vocab tiles
        (plan.emit_sample)."""
        key = (n_splits, sample_tiles)
        if key not in self._tasks:
            if self.dims.LANES:
                t = P.build_tasks(self.plan, n_splits, sample_tiles)
            else:   # the one-split table with its attention tasks copied (milliseconds, not the builder's ~0.2 s)
                t = P.split_tasks(self._host_tasks1(sample_tiles), n_splits)
            self._tasks[key] = t.to(self.device)
        return self._tasks[key]

    def _host_tasks1(self, sample_tiles: int = 0) -> torch.Tensor:
        if sample_tiles not in self._tasks1_host:
            self._tasks1_host[sample_tiles] = P.build_tasks(self.plan, 1, sample_tiles, rin_o=self.route_in_o,
                                                            fuse_dn=self.fuse_down)
        return self._tasks1_host[sample_tiles]

    def sampling_fallbacks(self) -> int:
        """The last launch's draws whose top-k / top-p fell back to plain temperature sampling (kernels/sampling);
        0 after a launch without the filter."""
        return self._sampler.fallbacks() if self.last_launch.get("filtered") else 0

    def filter_sampler(self):
        """The DeviceSampler whose buffers a top-k / top-p launch hands the kernel (+ the logits it samples)."""
        if self._sampler is None:
            V = self.spec.vocab_size
            self._sampler = DeviceSampler(V, self.device, filter=True, **self._sampler_opts)
            self.logits = torch.zeros(V, dtype=torch.float32, device=self.device)
        return self._sampler

    def pick_splits(self, n_ctx: int) -> int:
        """Attention splits for a context: ~8 KB of K+V per split task (KIE_ATTN_SPLIT_KB; 32 until session 30
        and still for MLA), at most one wave of programs. A task's K/V blocks run one after another (~5 us per
        block of 16 positions on an H100 with fp32 dots: benchmarks/attention_task_micro.py), and the other
        programs idle during attention, so more, shorter tasks shorten the phase: qwen3-30b-a3b fp8
        (KIE_MONO_FP8_MMA=1) at 160 positions, 10 splits instead of 2, 179.8 -> 194.0 tok/s. Past ~2,100 positions
        (qwen3) both sizes hit max_splits."""
        if self.n_splits_override is not None:
            return self.n_splits_override
        d = self.dims
        row = (d.R_KV + d.ROT) if d.MLA else 2 * d.DH
        kv_bytes = n_ctx * row * self.kv.element_size()
        return int(max(1, min(self.max_splits, kv_bytes // (self.split_kb << 10))))

    # ---- prefill --------------------------------------------------------------------------------------------------
    def prefill(self, ids: list[int]):
        """KV cache positions [0, len(ids)) through the batched prefill (kernels/prefill.py) over the plan's own
        buffers; KIE_PREFILL=reference, or a decoder placed in `_prefill_decoder` (tests: an fp32 oracle prefill),
        runs the reference decoder's math instead (slow)."""
        if not ids:
            return
        self._ensure_kv(len(ids) + 1)
        if self.dims.LANES:
            return self._prefill_lanes(ids)
        if os.environ.get("KIE_PREFILL") != "reference" and self._prefill_decoder is None:
            if self._prefiller is None:
                self._prefiller = Prefill.for_plan(self.plan, self.prefill_dtype)
            L = self.spec.num_layers
            caches = ([self.kv[i] for i in range(L)] if self.dims.MLA else     # [T, Hkv, Dh] views of [Hkv, T, Dh]
                      [(self.kv[i, 0].transpose(0, 1), self.kv[i, 1].transpose(0, 1)) for i in range(L)])
            self._prefiller(ids, caches)
            return
        if self._prefill_decoder is None:
            self._prefill_decoder = ReferenceDecoder(self.spec, ArenaStore(self.plan), self.device,
                                                     self.prefill_dtype)
        dec = self._prefill_decoder
        dec.reset()
        dec.forward(torch.tensor(ids, dtype=torch.long))
        n = len(ids)
        for i, (k, v) in enumerate(dec.cache):
            if self.dims.MLA:   # (latent [T, r_kv], k_pe [T, rope])
                self.kv[i, :n] = torch.cat([k, v], dim=-1).to(self.kv_dtype)
            else:
                self.kv[i, 0, :, :n] = k.transpose(0, 1).to(self.kv_dtype)   # [T, Hkv, Dh] -> [Hkv, T, Dh]
                self.kv[i, 1, :, :n] = v.transpose(0, 1).to(self.kv_dtype)
        dec.reset()

    def _prefill_lanes(self, ids: list[int], chunk: int = 512):
        """Laneformer: dense/reference.py's decoder over the plan's arena (lane tensors einsum'd on the device), in
        chunks of `chunk` positions (its scores are [lanes, heads, chunk, T]); its per-lane caches [L, T, hk, Dh]
        are the kernel's lane-major kv heads."""
        from kie_moe.dense.reference import LaneformerDecoder
        if self._prefill_decoder is None:
            self._prefill_decoder = LaneformerDecoder(self.spec, ArenaStore(self.plan), self.device,
                                                      self.prefill_dtype)
        dec, n, d = self._prefill_decoder, len(ids), self.dims
        dec.reset()
        with torch.no_grad():
            for c0 in range(0, n, chunk):
                dec.forward(torch.tensor(ids[c0:c0 + chunk], dtype=torch.long))
        for i, (k, v) in enumerate(dec.cache):
            self.kv[i, 0, :, :n] = k.permute(0, 2, 1, 3).reshape(d.HKV, n, d.DH).to(self.kv_dtype)
            self.kv[i, 1, :, :n] = v.permute(0, 2, 1, 3).reshape(d.HKV, n, d.DH).to(self.kv_dtype)
        dec.reset()

    # ---- test hooks -------------------------------------------------------------------------------------------------
    def plant_stuck_task(self, row: int, extra: int = 1 << 20):
        """Make task `row` of step 0 wait for a count no one will ever reach, in the next launch only."""
        self._plant = (row, extra)

    # ---- decode --------------------------------------------------------------------------------------------------
    def launch(self, last_token: int, start_pos: int, n_steps: int, eos_ids, *, ignore_eos: bool = False,
               temperature: float = 0.0, seed: int = 0, mode: int = 0, forced: list[int] | None = None,
               trace_tasks: int = 0, top_k: int = 0, top_p: float = 1.0):
        """Start one launch decoding `n_steps` tokens after `last_token` (at position start_pos). Async on the GPU.
        forced: a whole prompt to run through the kernel first (in-kernel prefill: start_pos 0, its tokens fed as
        inputs, no logits, nothing in the ring), then n_steps generated tokens.
        mode 1 / 2: benchmark-only kernel variants (kernel.monokernel's MODE: sync only / no waits).
        trace_tasks > 0 (GPU): decode as usual and time stamp the first trace_tasks tasks in claim order into
        self.trace (int64 [trace_tasks, P.TRACE_W]; kernels/monokernel/trace.summarize reads it).
        top_k / top_p (with temperature > 0): the LM head stores logits and sampling.py's tile + final tasks draw
        from them (Philox noise keyed by seed and generated index); else the LM tiles' own Gumbel-max / argmax."""
        d, pl = self.dims, self.plan
        if trace_tasks:
            if self.interpret:
                raise InputError("monokernel: tracing reads GPU clocks (not under TRITON_INTERPRET)")
            mode = 3
            if self.trace.shape[0] < trace_tasks:
                self.trace = torch.zeros(trace_tasks, P.TRACE_W, dtype=torch.int64, device=self.device)
            self.trace.zero_()
        if self._done is not None:      # the previous launch may still write the ring we are about to reuse
            self._done.synchronize()
        n_forced = 0
        if forced:
            last_token, start_pos, n_forced = int(forced[0]), 0, len(forced) - 1
            self.forced = torch.tensor(list(forced), dtype=torch.int32, device=self.device)
        n_gen, n_steps = n_steps, n_steps + n_forced
        self._ensure_kv(start_pos + n_steps + 1)
        self._ensure_ring(n_gen)
        eos = sorted(set(int(e) for e in eos_ids))
        if len(eos) > _MAX_EOS:
            raise InputError(f"monokernel: at most {_MAX_EOS} EOS ids, got {len(eos)}")
        n_splits = self.pick_splits(start_pos + n_steps)
        if n_splits > self.ao.shape[0]:             # partials for every split
            self.ao = torch.zeros(n_splits, self.ao_width, device=self.device)
            self.am = torch.zeros(n_splits, d.HQ, device=self.device)
            self.al = torch.zeros(n_splits, d.HQ, device=self.device)
        sampler = None
        if needs_filter(temperature, top_k, top_p):
            sampler = self.filter_sampler().configure(temperature, top_k, top_p, seed)
        tasks = self.tasks(n_splits, sampler.n_tiles if sampler is not None else 0)
        if self._plant is not None:
            row, extra = self._plant
            tasks = tasks.clone()
            tasks[row, P.F_WBASE] += extra
            self._plant = None
        self._launch_tasks = tasks
        self.eos.fill_(-1)
        if eos:
            self.eos[:len(eos)] = torch.tensor(eos, dtype=torch.int32)
        self.counters.zero_()
        self.rticket.zero_()
        self.racc.zero_()   # a launch that stopped mid-layer leaves its partial sums
        self.acnt.zero_()
        self.cursor.zero_()
        self.ctrl.zero_()
        self.ring.zero_()
        self.hostflag.zero_()
        self.x[:max(1, d.LANES) * d.D].view(-1, d.D).copy_(pl.view("embed")[last_token].float())   # every lane
        self.last_launch = dict(n_steps=n_steps, n_splits=n_splits, n_tasks=int(tasks.shape[0]), start_pos=start_pos,
                                n_forced=n_forced, filtered=sampler is not None)
        args, meta = self.kernel_args(tasks, n_steps, start_pos, n_splits, len(eos), ignore_eos, temperature, seed,
                                      n_forced, trace_tasks, sampler=sampler)
        meta["MODE"] = mode
        self.last_launch["block_t"] = meta["BLOCK_T"]   # attention's positions per block (the long switch's pick)
        self._launch_args = (args, meta)
        self._run()

    def _run(self):
        args, meta = self._launch_args
        extra = {} if self.maxnreg is None or self.interpret else dict(maxnreg=self.maxnreg)
        monokernel[(self.grid,)](*args, **meta, num_warps=self.num_warps, launch_cooperative_grid=True, **extra)
        if self.device.type == "cuda":
            self._done = torch.cuda.Event()
            self._done.record()

    # ---- tensor parallel under the interpreter: a rank leaves at a KCCL wait its peers have not satisfied yet --------
    def yielded_at(self) -> int | None:
        """The global task index the last (interpreted) launch stopped at to wait for other ranks, or None."""
        y = int(self.ctrl[CT_YIELD])
        return y - 1 if y else None

    def resume(self):
        """Run the yielded launch on from its KCCL wait (same arguments; the interpreter's one program claims the
        task again). Counters, KV cache and activations are where the launch left them."""
        t = self.yielded_at()
        assert t is not None and self.interpret, "resume(): only an interpreted launch that yielded"
        self.cursor.fill_(t)
        self.ctrl[CT_YIELD] = 0
        self.ctrl[CT_STOP] = 0
        self._run()

    def kernel_args(self, tasks, n_steps, start_pos, n_splits, n_eos, ignore_eos=False, temperature=0.0, seed=0,
                    n_forced=0, trace_tasks=0, arch: int | None = None, sampler=None):
        """(positional args, constexpr kwargs) of one launch -- shared by launch() and compile_offline() (arch:
        the target's sm number there; else this backend's GPU). sampler: filter_sampler() for a top-k / top-p
        launch (the kernel's SFILTER variant), else None."""
        d, pl, t = self.dims, self.plan, self.plan.tiles
        nq = d.HQ * d.DH
        bx = min(_pow2(max(d.D, nq)), 1024 if not self.interpret else 256)
        qb = pl.qbufs or self._no_qbufs()
        # The e4m3 views of the quantized buffers: Triton compiles no fp8e4nv pointer before sm_89, so there they
        # go in as their u8 bytes and qtile decodes the bits (tiles._as_f32; KIE_E4M3_BITS=1 forces it anywhere).
        native = has_fp8e4nv(self.device, arch) if arch is not None else e4m3_native(self.device)
        e4m3 = torch.float8_e4m3fn if native else torch.uint8
        # the fp8 tensor-core tasks convert e4m3 pairs in hardware (sm_89+): an offline build for an older target
        # gets the CUDA-core tasks, as a backend built on that GPU would (mma8's own check)
        mma8 = self.mma8 and native
        mma_dn = self.mma_down and (mma8 or d.FMT_EXP != 1)
        args = [
            tasks, pl.layers, pl.weights, qb["qw"].view(e4m3), qb["qw"].view(torch.uint32),
            qb["qf32"], qb["qs8"].view(e4m3), qb["qs8"], self.kv, self.cos, self.sin,
            self.x, self.qkv, self.ao, self.am, self.al, self.acnt, self.h, self.rlog, self.rids, self.rwts,
            self.sg, self.pv, self.pi, *self._sampler_args(sampler),
            self.counters, self.cursor, self.ctrl, self.ring, self.hostflag, self.eos, self.forced,
            self.trace, trace_tasks,
            self.sym.view(torch.float32), self.sym, self.poff, pl.tp_rank, *self._sym_offs(),
            int(tasks.shape[0]), n_steps, start_pos, self.kv_tmax, n_splits, pl.n_lm_tiles, n_eos,
            int(ignore_eos), n_forced, int(temperature > 0), 1.0 / temperature if temperature > 0 else 1.0,
            seed & 0x7FFFFFFF, self.timeout_ns, pl.embed_off, pl.lm_off, pl.final_norm_off,
            d.eps, d.sm_scale, d.clip, d.route_scale, d.glu_limit, d.glu_alpha, self.mscr, self.rticket,
            self.racc]
        block_t = self.long_block_t if self.long_block_t and start_pos + n_steps >= self.long_from else t.block_t
        meta = dict(
            D=d.D, HQ=d.HQ, HKV=d.HKV, DH=d.DH, ROT=d.ROT, ROPE_PAIR=d.ROPE_PAIR, QK_NORM=d.QK_NORM,
            HAS_QKV_BIAS=d.HAS_QKV_BIAS, HAS_O_BIAS=d.HAS_O_BIAS, HAS_SINKS=d.HAS_SINKS, HAS_CLIP=d.HAS_CLIP,
            I_DENSE=d.I_DENSE, E=d.E, TOPK=d.TOPK, I_MOE=d.I_MOE, I_SH=d.I_SH, SCORING=d.SCORING,
            NORM_TOPK=d.NORM_TOPK, HAS_RBIAS=d.HAS_RBIAS, HAS_SBIAS=d.HAS_SBIAS, EXP_ACT=d.EXP_ACT,
            HAS_EBIAS=d.HAS_EBIAS, HAS_SH_GATE=d.HAS_SH_GATE, FMT_ATTN=d.FMT_ATTN, FMT_MLP=d.FMT_MLP,
            FMT_EXP=d.FMT_EXP, MLA=d.MLA, R_Q=d.R_Q, R_KV=d.R_KV, NOPE=d.NOPE, VD=d.VD, NG=d.NG, TG=d.TG,
            GSCORE=d.GSCORE, **lanes.kernel_meta(pl),
            BN_QKV=t.bn["qkv"], BN_O=t.bn["o"], BN_GU=t.bn.get("gateup", 1), BN_DOWN=t.bn.get("down", 1),
            BN_ROUTER=t.bn.get("router", 1), BN_EUP=t.bn.get("exp_up", 1), BN_EDOWN=t.bn.get("exp_down", 1),
            BN_SUP=t.bn.get("sh_up", 1), BN_LM=t.bn["lm"], BN_QB=t.bn.get("qb", 1), BN_KVB=t.bn.get("kvb", 1),
            BLOCK_RKV=max(16, _pow2(d.R_KV)), BLOCK_RD=max(16, _pow2(d.ROT)), BLOCK_HG=P.MLA_HEADS,
            BLOCK_G=_pow2(d.NG),
            BLOCK_K=t.block_k, BLOCK_T=block_t, BLOCK_P=t.block_p,
            # attention's tl.dot dimensions are >= 16 (ops.attention_task masks the padding)
            BLOCK_R=max(16, _pow2(d.HQ // d.HKV)), BLOCK_H=max(16, _pow2(d.ROT // 2)),
            BLOCK_C=max(16, _pow2(max(d.DH - d.ROT, 1))), BLOCK_D=max(16, _pow2(d.DH)),
            BLOCK_E=_pow2(max(d.E, 1)), BLOCK_TOPK=_pow2(max(d.TOPK, 1)), BLOCK_EOS=_MAX_EOS, BLOCK_X=bx,
            BLOCK_QG=_pow2(max(d.HQ // max(d.HKV, 1) * d.DH, 1)),
            XB=t.xb, NS=t.ns, USE_ASM=not self.interpret, NT=32 * self.num_warps, TP=d.TP, E_LO=d.E_LO,
            E_LOC=d.E_LOC, MMA8=mma8, MMA16=self.mma16, MMA_DN=mma_dn, MMA4=self.mma4, E4B=not native,
            RP4=bool(pl.qarena is not None and pl.qarena.packed),
            MSCR=self.mscr_words, ATTN_PREC=self.attn_prec, BLOCK_XS=self.stage_block or bx,
            ROUTE_ONCE=self.route_once, N_ROUTER=max(1, len(pl.op_rows.get("router", ()))), DOWN_L2=self.down_l2,
            CLAIM=self.claim, RIN_O=self.route_in_o, TOPK_MERGE=self.topk_merge, FUSE_DN=self.fuse_down,
            FD_AL=self.fd_aligned,
            FD_BD=min(self.fd_block_d, _pow2(d.D)), FD_NS=self.fd_stages,
            BLOCK_RO=_pow2(max([n for _, n in pl.op_rows.get("o", ())] + [1])))
        if sampler is not None:
            meta.update(SFILTER=True, K_CAND=sampler.k_cand, SBLOCK_V=sampler.block_v, SBLOCK_T=sampler.block_t,
                        SBLOCK_C=sampler.block_c)
        return args, meta

    def _sampler_args(self, sampler) -> list:
        """The kernel's filtered-sampling arguments (logits, the sampler's buffers, n_tiles, vocab); stand-ins that
        are never read when sampler is None."""
        if sampler is None:
            f, i = self.pv, self.pi
            return [f, f, self.cursor, f, i, self.cursor, f, i, i, i, 1, 1]
        s = sampler
        return [self.logits, s.params, s.rng, s.part_f, s.part_i, s.cand, s.gum_f, s.gum_i, s.status, s.out,
                s.n_tiles, self.spec.vocab_size]

    def _sym_offs(self) -> tuple[int, int]:
        if not self.plan.dims.TP:
            return 0, 0
        lay = self.plan.sym_layout()
        return lay["pv"], lay["ctr"]

    def _no_qbufs(self) -> dict:
        """Stand-ins for the quantized buffers of an all-float plan (never read)."""
        if not hasattr(self, "_qdummy"):
            self._qdummy = dict(qw=torch.zeros(16, dtype=torch.uint8, device=self.device),
                                qs8=torch.zeros(16, dtype=torch.uint8, device=self.device),
                                qf32=torch.zeros(4, dtype=torch.float32, device=self.device))
        return self._qdummy

    def check_error(self):
        """Raise RuntimeError naming the stuck task if the last launch tripped the watchdog."""
        ctrl = self.ctrl.tolist()
        if ctrl[CT_ERR] == 0:
            return
        tasks = self._launch_tasks.cpu()
        T = tasks.shape[0]
        recs = [ctrl[i:i + 3] for i in range(N_CTRL, len(ctrl), 3) if ctrl[i] > 0]
        t, have, need = min(recs)       # the earliest stuck task in claim order: every later one waits behind it
        t -= 1
        ctrl[CT_ERR_HAVE], ctrl[CT_ERR_NEED] = have, need
        step, row = divmod(t, T)
        wctr = int(tasks[row, P.F_WAIT])
        op = int(tasks[row, P.F_OP])
        kccl = self.dims.TP and (op == P.OP_REDUCE or op == P.OP_SAMPLE)
        if self.dims.TP and op in (P.OP_LANE_O, P.OP_LANE_DOWN) and int(tasks[row, P.F_XWAIT]) >= 0 \
                and ctrl[CT_ERR_NEED] == self.dims.TP * (step + 1):   # its second wait: layer i - d's KCCL counter
            kccl, wctr = True, int(tasks[row, P.F_XWAIT])
        name = self.xctr_name(wctr) if kccl else f"counter {self.counter_name(wctr)}"
        raise RuntimeError(
            f"monokernel watchdog: task {row} ({P.describe_task(tasks, row)}) of decode step {step} waited for "
            f"{name} to reach {ctrl[CT_ERR_NEED]}, it is {ctrl[CT_ERR_HAVE]}"
            + (" (never satisfiable: the interpreter runs programs in order)" if self.interpret
               else f" (timeout {self.timeout_ns / 1e6:.0f} ms)"))

    def xctr_name(self, c: int) -> str:
        """A KCCL counter (tensor parallel): signalled by every rank's put tasks of one output tile."""
        T, pre = self.plan.tp_tiles, f"rank {self.plan.tp_rank}'s KCCL counter"
        if c == 2 * self.spec.num_layers * T:
            return f"{pre} lm_head (every rank's LM-head tiles)"
        if c > 2 * self.spec.num_layers * T:
            return f"{pre} lane_agg tile {c - 2 * self.spec.num_layers * T - 1} (one signal per rank)"
        layer, rest = divmod(c, 2 * T)
        return f"{pre} {('o_proj', 'mlp_down')[rest // T]}[layer {layer}] tile {rest % T} (one signal per rank)"

    def counter_name(self, c: int) -> str:
        L = self.spec.num_layers
        if c == P.NC * L:
            return "lm_head"
        if c == P.NC * L + 1:
            return "sample"
        if c == P.NC * L + 2:
            return "lane_agg"
        if c == P.NC * L + 3:
            return "sample_tile"
        return f"{_COUNTER_KINDS[c % P.NC]}[layer {c // P.NC}]"

    def generate(self, prompt_ids: list[int], p, eos_ids) -> Iterator[int]:
        filtered = needs_filter(p.temperature, p.top_k, p.top_p)
        if filtered and self.dims.TP:
            raise InputError("monokernel backend: top-k / top-p sampling runs on one GPU only (greedy or "
                             "temperature with --devices N)")
        if not prompt_ids:
            raise InputError("the prompt is empty")
        n = p.max_new_tokens
        start = len(prompt_ids) - 1
        if start + n > self.spec.max_position:
            raise InputError(f"prompt + max_new_tokens exceed the model's context of {self.spec.max_position}")
        if filtered:   # refuses a top-k the sampler cannot do exactly, before any work
            self.filter_sampler().configure(p.temperature, p.top_k, p.top_p)
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2 ** 31 - 1, (1,)))
        eos = set() if p.ignore_eos else set(eos_ids)
        opts = dict(ignore_eos=p.ignore_eos, temperature=p.temperature, seed=seed, top_k=p.top_k, top_p=p.top_p)
        if self.prefill_mode == "kernel":   # the prompt runs through the kernel too: no torch, no extra memory
            self.launch(0, 0, n, eos, forced=list(prompt_ids), **opts)
        else:
            self._ensure_kv(start + n + 1)
            self.prefill(list(prompt_ids[:-1]))
            self.launch(int(prompt_ids[-1]), start, n, eos, **opts)
        yield from self._stream(n, eos)

    def _stream(self, n: int, eos: set[int]) -> Iterator[int]:
        """Yield tokens from the ring as the kernel writes them; stop the kernel if the consumer stops early."""
        ring = self.ring.numpy()
        done = self._done
        seen, finished = 0, False
        try:
            while True:
                complete = done is None or done.query()
                cnt = int(ring[0])
                while seen < cnt:
                    tok = int(ring[1 + seen])
                    seen += 1
                    if seen == n or tok in eos:
                        finished = True
                    yield tok
                    if finished:
                        break
                if finished or complete:
                    break
                time.sleep(20e-6)
            if done is not None:
                done.synchronize()
            finished = True
            self.check_error()
        finally:
            if not finished:                 # the consumer stopped early: ask the kernel to stop, wait for it
                self.hostflag[0] = 1
                if done is not None:
                    done.synchronize()


def compile_offline(backend: MonokernelBackend, arch: int = 90, n_splits: int = 1, mode: int = 0,
                    filtered: bool = False):
    """Compile the monokernel for `arch` (sm_90: H100/H200) without a GPU: the arguments of a real launch of
    `backend` turned into a signature (filtered: a top-k / top-p launch's variant). Returns the CompiledKernel
    (metadata: registers, spills, shared memory). Needs the JIT (not interpreted) kernel: call in a process
    without TRITON_INTERPRET=1."""
    import triton
    from triton.compiler import ASTSource

    backend._ensure_kv(64)
    sampler = backend.filter_sampler() if filtered else None
    tasks = backend.tasks(n_splits, sampler.n_tiles if sampler is not None else 0)
    args, meta = backend.kernel_args(tasks, 8, 16, n_splits, 2, arch=arch, sampler=sampler)
    names = monokernel.arg_names
    tys = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32",
           torch.int64: "i64", torch.uint8: "u8", torch.uint32: "u32", torch.float8_e4m3fn: "fp8e4nv"}
    sig, attrs = {}, {}
    for i, (name, a) in enumerate(zip(names, args)):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + tys[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]   # what the JIT sees for 16-byte aligned tensors
        elif isinstance(a, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if abs(int(a)) >= 2 ** 31 else "i32"
    for k, v in meta.items():
        sig[k] = "constexpr"
    meta = {**meta, "USE_ASM": True, "MODE": mode}
    src = ASTSource(monokernel, sig, constexprs=meta, attrs=attrs)
    with offline_target(arch) as target:    # the kernel's target_info guards ask the target, not this machine
        return triton.compile(src, target=target,
                              options=dict(num_warps=backend.num_warps, launch_cooperative_grid=True,
                                           **({} if backend.maxnreg is None else dict(maxnreg=backend.maxnreg))))

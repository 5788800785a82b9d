"""A routed expert's down projection inside its gate / up task (plan.fused_down, KIE_FUSE_DOWN; experiment, off).

Why: a MoE layer's expert phases are gate / up (each task: rows [c0, c0 + nc) of one slot's h) and then down (each
task: rows of x, all slots), and the down phase is one more dependency per layer on the critical path (H100 trace,
qwen3-30b-a3b fp8, session 41: 408 us of the 3.18 ms step, 8.5 us per layer, its weights already in L2). Down is
linear in h, so the task that computed h[c0:c0 + nc] can add that slice's share itself:

    x[d] += w_j * (f[d] * sum_{c < nc} Wdown[e_j][d, c0 + c] * h[c0 + c] + (c0 == 0) * b[d])     for every d < D

with fp32 atomics into x (the sum over the layer's tasks is then in no fixed order: the low bits of x may differ
between runs, as the graph backend's atomic expert down). The gate / up tasks read their input from a copy of x
(kernel XM_OFF, written by the o_proj tasks) so that no task's staging reads an x another task already added to.

PyTorch reference: kernels/moe.moe_experts_ref's `y += w * (W_down[e] @ h)`, restricted to h's columns [c0, c0 + nc);
tests/monokernel/test_fused_down.py checks the slice sums against it and the whole decode against the reference.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kie_moe.kernels.tiles import _as_f32


@triton.jit
def expert_down_cols(w_ptr, f_ptr, b_ptr, h_ptr, wt, c0, nc, y_ptr, add_bias,
                     D: tl.constexpr, I_MOE: tl.constexpr, HAS_F: tl.constexpr, HAS_B: tl.constexpr,
                     AL: tl.constexpr, BLOCK_D: tl.constexpr, NS: tl.constexpr = 0):
    """y[d] += wt * (f[d] * W[d, c0:c0 + nc] . h[c0:c0 + nc] + add_bias * b[d]) for d < D, by relaxed atomics.

    w_ptr: one expert's down weights [D, I_MOE] row-major (arena floats or e4m3 codes, tiles._as_f32); f_ptr: its
    per-row factors [D] (fp8's row scales; HAS_F); b_ptr: its bias [D] (HAS_B); h_ptr: the slot's h [I_MOE] (fp32,
    this task's stores, read back after the caller's barrier). AL: c0 and nc are multiples of 16 and I_MOE too
    (plan-checked), so each [BLOCK_D, 16] chunk loads as one 16-byte vector per row and needs no column mask.
    One flat walk over (row block, 16-column chunk) tiles, row block major; NS > 0: Triton's software pipeline
    (NS stages in flight through shared memory), else tile i + 1's loads are issued before tile i's FMAs. A row
    block's sums go out as atomics once its last chunk is in."""
    CC: tl.constexpr = 16
    offs_c = tl.arange(0, CC)
    offs_d = tl.arange(0, BLOCK_D)
    if AL:   # the same c0, as a product Triton's alignment analysis reads (tl.multiple_of is dropped on an
        # argument, and the row tiles loaded one byte at a time: 64 LDG.U8 per [512, 16] tile, sm_90 SASS)
        c0 = c0 // 16 * 16
    ncc = (nc + CC - 1) // CC
    n = (D + BLOCK_D - 1) // BLOCK_D * ncc
    acc = tl.zeros((BLOCK_D, CC), dtype=tl.float32)
    if NS == 0:
        w_cur, h_cur = _cols_tile(w_ptr, h_ptr, c0, nc, 0, ncc, offs_d, offs_c, D, I_MOE, AL, BLOCK_D)
    for q in tl.range(0, n, num_stages=max(NS, 1)):
        if NS > 0:
            w_cur, h_cur = _cols_tile(w_ptr, h_ptr, c0, nc, q, ncc, offs_d, offs_c, D, I_MOE, AL, BLOCK_D)
        else:
            w_nxt, h_nxt = _cols_tile(w_ptr, h_ptr, c0, nc, tl.minimum(q + 1, n - 1), ncc, offs_d, offs_c, D,
                                      I_MOE, AL, BLOCK_D)
        acc += _as_f32(w_cur) * h_cur[None, :]
        if q % ncc == ncc - 1:   # this row block's last chunk: its sums into y
            rows = (q // ncc) * BLOCK_D + offs_d
            rm = rows < D
            y = tl.sum(acc, axis=1)
            if HAS_F:
                y = y * tl.load(f_ptr + rows, mask=rm, other=0.0)
            if HAS_B:
                y += tl.where(add_bias != 0, 1.0, 0.0) * tl.load(b_ptr + rows, mask=rm, other=0.0).to(tl.float32)
            tl.atomic_add(y_ptr + rows, y * wt, mask=rm, sem="relaxed")
            acc = tl.zeros((BLOCK_D, CC), dtype=tl.float32)
        if NS == 0:
            w_cur = w_nxt
            h_cur = h_nxt


@triton.jit
def _cols_tile(w_ptr, h_ptr, c0, nc, q, ncc, offs_d, offs_c, D: tl.constexpr, I_MOE: tl.constexpr,
               AL: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile q of expert_down_cols' walk: W[rows, c0 + cc:+16] [BLOCK_D, 16] and h[c0 + cc:+16] [16]."""
    cc = (q % ncc) * 16
    rows = (q // ncc) * BLOCK_D + offs_d
    rm = rows < D
    cm = cc + offs_c < nc
    p = w_ptr + rows.to(tl.int64)[:, None] * I_MOE + (c0 + cc) + offs_c[None, :]
    if AL:
        w = tl.load(p, mask=rm[:, None], other=0.0)
    else:
        w = tl.load(p, mask=rm[:, None] & cm[None, :], other=0.0)
    h = tl.load(h_ptr + c0 + cc + offs_c, mask=cm, other=0.0, cache_modifier=".cg")
    return w, h

"""Programmatic dependent launch (PDL) for the kernel-per-op decode step (graph backend), sm_90+.

Why: a decode step of the graph backend is ~8 small launches per layer (qwen3-30b-a3b: ~390 per token), each a few
microseconds of work, and a CUDA graph still pays a gap between two dependent kernels. A kernel launched with PDL
may start as soon as its predecessor's blocks have all exited (the implicit trigger), without waiting for the
grid's completion to be signalled through the stream; its blocks then wait in `griddepcontrol.wait` until the
previous grid has completed and its writes are visible.

Contract: a kernel launched with `**launch_kw(device)` takes a `PDL: tl.constexpr` and must call `pdl_begin(PDL)`
before it reads or writes anything an earlier kernel touches (every kernel here calls it first). The wait is a
no-op for a kernel launched without PDL.
No kernel signals `launch_dependents` at its start: measured on the H200 (benchmarks/NOTES.md, session 6) that
let the next kernel's blocks take SM slots while they only wait, and the step got 3-4% slower, while the wait
alone gained 1.4-2.4%. KIE_PDL=0 turns PDL off (A/B); the interpreter and GPUs before sm_90 never use it.

KIE_PDL_PREFETCH=1 (experiment, session 9; PDL constexpr 2): kernels signal `launch_dependents` after their main
loop (pdl_trigger: every block of the grid is resident by then, so the next kernel's blocks take only free slots),
and a GEMV-type kernel's blocks, once resident, ask L2 for their weight tile (pdl_begin_tile: weights are never
written during decode, so reading them before the wait is race-free) while the previous kernel's tail runs.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL = os.environ.get("KIE_PDL", "1") != "0"
PREFETCH = os.environ.get("KIE_PDL_PREFETCH", "0") == "1"
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_CAPABLE: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """PDL for launches on this device: a CUDA device of compute capability >= 9.0 (griddepcontrol is sm_90 PTX:
    an A100 or L40S must not even compile it), not the interpreter, not KIE_PDL=0."""
    if not PDL or _INTERPRET or device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABLE:
        _CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return _CAPABLE[idx]


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """Wait for the previous grid: complete, its writes visible (PDL: the kernel's constexpr from launch_kw)."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """Let the next kernel launch (PDL 2 only: KIE_PDL_PREFETCH); call after a kernel's main loop."""
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def pdl_begin_tile(PDL: tl.constexpr, w_ptr, stride_wn, N, K, k_per_split, BLOCK_N: tl.constexpr,
                   EPU: tl.constexpr, LINES: tl.constexpr = 128):
    """pdl_begin for a kernel on grid (row tiles of BLOCK_N, K splits of k_per_split elements) over a row-major
    weight [N, K] (stride_wn in w_ptr's units of EPU elements: 8 for u32 words of e2m1 codes, else 1). PDL 2 first
    asks L2 for this program's rows x K range, one `prefetch.global.L2` per 128-byte line."""
    if PDL == 2:
        UB: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
        n_start = tl.program_id(0) * BLOCK_N
        k_lo = tl.program_id(1) * k_per_split
        nb = (tl.minimum(k_lo + k_per_split, K) - k_lo) * UB // EPU        # bytes per row of the tile
        lpr = tl.cdiv(nb, 128)
        n_lines = tl.minimum(BLOCK_N, N - n_start) * lpr
        base = w_ptr.to(tl.pointer_type(tl.int8))
        row0 = n_start.to(tl.int64) * stride_wn * UB + k_lo * UB // EPU
        for l0 in range(0, n_lines, LINES):
            i = l0 + tl.arange(0, LINES)
            r = i // lpr
            off = row0 + r.to(tl.int64) * stride_wn * UB + (i - r * lpr) * 128
            off = tl.where(i < n_lines, off, row0)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [base + off],
                                      dtype=tl.int32, is_pure=False, pack=1)
    pdl_begin(PDL)


def launch_kw(device: torch.device) -> dict:
    """Launch options + the PDL constexpr of a kernel that calls pdl_begin(PDL) first (2: KIE_PDL_PREFETCH)."""
    on = enabled(device)
    return {"launch_pdl": on, "PDL": 2 if on and PREFETCH else on}

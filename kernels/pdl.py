"""Programmatic dependent launch (PDL) for the kernel-per-op decode step (graph backend), sm_90+.

Why: a decode step of the graph backend is ~8 small launches per layer (qwen3-30b-a3b: ~390 per token), each a few
microseconds of work, and a CUDA graph still pays a gap between two dependent kernels. A kernel launched with PDL
may start as soon as its predecessor's blocks have all exited (the implicit trigger), without waiting for the
grid's completion to be signalled through the stream; its blocks then wait in `griddepcontrol.wait` until the
previous grid has completed and its writes are visible.

Contract: a kernel launched with `**launch_kw(device)` takes a `PDL: tl.constexpr` and must call `pdl_begin(PDL)`
before it reads or writes anything an earlier kernel touches (every kernel here calls it first). The wait is a
no-op for a kernel launched without PDL.
No kernel signals `launch_dependents` early: measured on the H200 (benchmarks/NOTES.md, session 6) an early
signal let the next kernel's blocks take SM slots while they only wait, and the step got 3-4% slower, while the
wait alone gained 1.4-2.4%. KIE_PDL=0 turns PDL off (A/B); the interpreter and GPUs before sm_90 never use it.

One exception, KIE_EARLY_OPROJ=1 (the graph backend; session 26): the decode attention launch runs on a few
programs (qwen3-30b-a3b at ctx 128: 4, one per kv head) while the other SMs idle, so it signals launch_dependents
as soon as it has waited (pdl_trigger), and the o_proj launch behind it asks L2 for its weight rows before its own
wait (l2_prefetch_rows; weights are never written during decode, so reading them early is race-free). The
contract then reads: a kernel's first statement is pdl_begin(PDL), or an `if PREFETCH:` block that only calls a
*_prefetch / l2_prefetch_* helper, directly followed by pdl_begin(PDL) (tests/kernels/test_pdl.py).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL = os.environ.get("KIE_PDL", "1") != "0"
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
def pdl_trigger(TRIGGER: tl.constexpr):
    """Let the next grid launch now (griddepcontrol.launch_dependents) instead of when this grid's blocks exit; its
    blocks still wait (pdl_begin) for this grid's completion. Only for a grid of a few programs, all resident:
    session 6 measured a trigger in every kernel at -3-4% (waiting blocks took slots from the same grid's later
    waves)."""
    if TRIGGER:
        gdc_launch_dependents()


@triton.jit
def l2_prefetch_rows(w_ptr, stride_wn, n_start, n_rows, k_lo, k_hi, LINES: tl.constexpr = 128):
    """Ask L2 for rows [n_start, n_start + n_rows) x elements [k_lo, k_hi) of a row-major weight (w_ptr's element
    type: 1-4 bytes), one `prefetch.global.L2` per 128-byte line, nothing returned. Read-only data only (weights):
    it runs before a PDL wait."""
    UB: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    nb = (k_hi - k_lo) * UB                          # bytes per row of the range
    lpr = tl.cdiv(nb, 128)
    n_lines = n_rows * lpr
    base = w_ptr.to(tl.pointer_type(tl.int8))
    row0 = n_start.to(tl.int64) * stride_wn * UB + k_lo * UB
    for l0 in range(0, n_lines, LINES):
        i = l0 + tl.arange(0, LINES)
        r = i // lpr
        off = row0 + r.to(tl.int64) * stride_wn * UB + (i - r * lpr) * 128
        off = tl.where(i < n_lines, off, row0)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [base + off],
                                  dtype=tl.int32, is_pure=False, pack=1)


def launch_kw(device: torch.device) -> dict:
    """Launch options + the PDL constexpr of a kernel that calls pdl_begin(PDL) first."""
    on = enabled(device)
    return {"launch_pdl": on, "PDL": on}


def reg_cap(device: torch.device, maxnreg: int | None) -> dict:
    """The register-cap launch option (maxnreg) on CUDA; nothing elsewhere or for None (ptxas's choice)."""
    return {"maxnreg": maxnreg} if device.type == "cuda" and maxnreg else {}

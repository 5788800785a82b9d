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

KIE_PDL_OVERLAP (experiment, session 11; 0 = off): overlap a launch's weight reads with its predecessor where the
predecessor's grid is resident at once, so releasing the next launch early takes no slot from its own blocks
(launch_dependents only fires once every block of the grid has issued it or exited).
  1: the routed-expert gate/up launch releases the down launch at its start; each down program asks L2 for its
     experts' weight rows (ids from the router, two launches back) and then waits.
  2: 1, and the down launch releases the next layer's q/k/v launch, whose programs prefetch their rows likewise.
  3: (diagnostic) the gate/up launch releases the down launch, nothing is prefetched: the release's own cost.
The PDL constexpr is then a bit set: 1 wait, 2 release at start (pdl_release), 4 prefetch before the wait
(pdl_begin_rows / pdl_begin_experts). Weights are never written during decode, so reading them before the wait is
race-free; a stale expert id only prefetches the wrong rows.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL = os.environ.get("KIE_PDL", "1") != "0"
OVERLAP = int(os.environ.get("KIE_PDL_OVERLAP", "0"))
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
def pdl_release(PDL: tl.constexpr):
    """Let the next launch's blocks be placed now (PDL bit 2); call right after pdl_begin."""
    if (PDL // 2) % 2 == 1:
        gdc_launch_dependents()


@triton.jit
def _prefetch_rows_l2(ptr, stride_bytes, n_rows, nbytes, LINES: tl.constexpr):
    """One `prefetch.global.L2` per 128-byte line of n_rows rows of nbytes each, stride_bytes apart, from the int8
    pointer ptr. (Session 11's first try used ::evict_last; see NOTES.md.)"""
    lpr = tl.cdiv(nbytes, 128)
    n_lines = n_rows * lpr
    for l0 in range(0, n_lines, LINES):
        i = l0 + tl.arange(0, LINES)
        r = i // lpr
        off = r.to(tl.int64) * stride_bytes + (i - r * lpr) * 128
        off = tl.where(i < n_lines, off, 0)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptr + off],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_begin_rows(PDL: tl.constexpr, w_ptr, byte_off, stride_bytes, n_rows, nbytes, LINES: tl.constexpr = 128):
    """pdl_begin, and with PDL bit 4 first ask L2 for this program's weight tile: n_rows rows of nbytes starting
    byte_off bytes into w_ptr, stride_bytes apart."""
    if (PDL // 4) % 2 == 1:
        _prefetch_rows_l2(w_ptr.to(tl.pointer_type(tl.int8)) + byte_off, stride_bytes, n_rows, nbytes, LINES)
    pdl_begin(PDL)


@triton.jit
def pdl_begin_experts(PDL: tl.constexpr, ids_ptr, slot_lo, slot_hi, E, w_ptr, stride_e_bytes, byte_off,
                      stride_bytes, n_rows, nbytes, LINES: tl.constexpr = 128):
    """pdl_begin_rows for the same tile of each expert ids[slot_lo:slot_hi] of a stack [E, rows, K]. The ids are
    read before the wait (L2, not L1): they only choose addresses to prefetch, so a stale id costs a wasted
    prefetch, never a wrong result; clamped to [0, E) so a prefetch never leaves the stack."""
    if (PDL // 4) % 2 == 1:
        base = w_ptr.to(tl.pointer_type(tl.int8)) + byte_off
        for slot in range(slot_lo, slot_hi):
            e = tl.load(ids_ptr + slot, cache_modifier=".cg")
            e = tl.minimum(tl.maximum(e, 0), E - 1).to(tl.int64)
            _prefetch_rows_l2(base + e * stride_e_bytes, stride_bytes, n_rows, nbytes, LINES)
    pdl_begin(PDL)


def launch_kw(device: torch.device, *, release: bool = False, prefetch: bool = False) -> dict:
    """Launch options + the PDL constexpr of a kernel that calls pdl_begin(PDL) (or a pdl_begin_* prefetch) first:
    0 without PDL, else 1 | 2 (release, see pdl_release) | 4 (prefetch before the wait)."""
    on = enabled(device)
    return {"launch_pdl": on, "PDL": (1 | (2 if release else 0) | (4 if prefetch else 0)) if on else 0}

"""Programmatic dependent launch (PDL) for the kernel-per-op decode step (graph backend), sm_90+.

Why: a decode step of the graph backend is ~8 small launches per layer (qwen3-30b-a3b: ~390 per token), each a few
microseconds of work, and a CUDA graph still pays a gap between two dependent kernels. A kernel launched with PDL
may start as soon as its predecessor's blocks have all exited (the implicit trigger), without waiting for the
grid's completion to be signalled through the stream; its blocks then wait in `griddepcontrol.wait` until the
previous grid has completed and its writes are visible.

Contract: a kernel launched with `**launch_kw()` must call `pdl_begin()` before it reads or writes anything an
earlier kernel touches (every kernel here calls it first). The wait is a no-op for a kernel launched without PDL.
No kernel signals `launch_dependents` early: measured on the H200 (benchmarks/NOTES.md, session 6) an early
signal let the next kernel's blocks take SM slots while they only wait, and the step got 3-4% slower, while the
wait alone gained 1.4-2.4%. KIE_PDL=0 turns PDL off (A/B); the interpreter never uses it.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

PDL = os.environ.get("KIE_PDL", "1") != "0"
_PDL = tl.constexpr(PDL and os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def pdl_begin():
    """Wait for the previous grid: complete, its writes visible."""
    if _PDL:
        gdc_wait()


def launch_kw() -> dict:
    """Launch options of a kernel that calls pdl_begin() first (the interpreter ignores them)."""
    return {"launch_pdl": PDL}

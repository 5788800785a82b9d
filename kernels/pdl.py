"""Programmatic dependent launch (PDL) for the kernel-per-op decode step (graph backend), sm_90+.

Why: a decode step of the graph backend is ~8 small launches per layer (qwen3-30b-a3b: ~390 per token), each a few
microseconds of work; between two kernels of a CUDA graph the GPU drains the first grid, then launches and ramps
up the next. With PDL the next kernel is launched while the previous one still runs (its blocks wait in
`griddepcontrol.wait` until the previous grid has completed and its writes are visible), so launch and ramp-up
overlap the previous kernel's tail.

Contract: a kernel launched with `**launch_kw()` must call `pdl_begin()` before it reads or writes anything an
earlier kernel touches (every kernel here calls it first). `pdl_begin` also signals `launch_dependents` at once:
the next kernel may then launch as soon as every block of this one has started (blocks waiting for resources are
not skipped, so no deadlock). Both instructions are no-ops for a kernel launched without PDL. KIE_PDL=0 turns
PDL off (A/B measurements); the interpreter never uses it.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL = os.environ.get("KIE_PDL", "1") != "0"
_PDL = tl.constexpr(PDL and os.environ.get("TRITON_INTERPRET") != "1")
_EARLY = tl.constexpr(os.environ.get("KIE_PDL_EARLY", "1") != "0")   # A/B: trigger at the start, or at exit


@triton.jit
def pdl_begin():
    """Wait for the previous grid (complete, writes visible), then let the next one launch."""
    if _PDL:
        gdc_wait()
        if _EARLY:
            gdc_launch_dependents()


def launch_kw() -> dict:
    """Launch options of a kernel that calls pdl_begin() first (the interpreter ignores them)."""
    return {"launch_pdl": PDL}

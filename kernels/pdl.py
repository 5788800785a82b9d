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
wait alone gained 1.4-2.4%. Nor do blocks read weights before their wait: L2 prefetches there lost every time they
were timed, last (session 26) even at the one boundary whose predecessor leaves most SMs idle (the attention launch
releasing o_proj, whose programs prefetched their rows: qwen3-30b-a3b fp8 -2.9%, llama-3.2-1b -1.8% on an H100;
benchmarks/NOTES.md). KIE_PDL=0 turns PDL off (A/B); the interpreter and GPUs before sm_90 never use it.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

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


def launch_kw(device: torch.device) -> dict:
    """Launch options + the PDL constexpr of a kernel that calls pdl_begin(PDL) first."""
    on = enabled(device)
    return {"launch_pdl": on, "PDL": on}


def reg_cap(device: torch.device, maxnreg: int | None) -> dict:
    """The register-cap launch option (maxnreg) on CUDA; nothing elsewhere or for None (ptxas's choice)."""
    return {"maxnreg": maxnreg} if device.type == "cuda" and maxnreg else {}

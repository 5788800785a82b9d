"""L2 prefetch of a task's whole weight range before it waits on its input (sm_90 bulk prefetch).

Why: a persistent program streams its task's weights through registers / shared memory, so only a few tiles
(~32-96 KB per SM) are ever in flight, and none while the program spins on a dependency. At every phase boundary
HBM then idles for a wait plus a load latency. A task's rows of a row-major matrix are one contiguous byte range,
so `cp.async.bulk.prefetch.L2.global` (one instruction per chunk, no registers, no completion to wait for) can ask
for all of them before the wait: HBM streams the next phase while the previous one finishes, and the task's own
loads then hit L2 (50 MB on an H200; a phase is 8-40 MB).

Each thread of the program issues one chunk of CH bytes (a [NCH] block: one element per thread at 8 warps), so a
task of up to NCH * CH bytes is covered by one call; larger tasks get their first NCH * CH bytes. Interpreter and
non-NVIDIA builds (USE_ASM False) and GPUs before sm_90 (no bulk prefetch): nothing (a prefetch never changes a
result).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.target_info import cuda_capability_geq


@triton.jit
def l2_prefetch(ptr, n_units, unit_bytes, USE_ASM: tl.constexpr, CH: tl.constexpr = 4096,
                NCH: tl.constexpr = 256):
    """Prefetch [ptr, ptr + n_units) into L2; a unit is one element of ptr's type (unit_bytes bytes each: 2 for
    bf16, 1 for e4m3 codes, 4 for u32 words of e2m1 pairs). ptr must be 16-byte aligned (arena offsets are)."""
    if USE_ASM and cuda_capability_geq(9, 0):      # the bulk prefetch is sm_90 PTX; before it: no prefetch
        nbytes = n_units.to(tl.int64) * unit_bytes
        offs = tl.arange(0, NCH).to(tl.int64) * CH                     # [NCH] byte offsets, one per thread
        size = tl.minimum(tl.maximum(nbytes - offs, 0), CH).to(tl.int32) // 16 * 16
        p = ptr + offs // unit_bytes
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [p, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(w_ptr, r0, nr, K: tl.constexpr, FMT: tl.constexpr, USE_ASM: tl.constexpr):
    """Prefetch rows [r0, r0 + nr) of a row-major [*, K] Linear in weight format FMT (kernels/tiles.py FMT_ID:
    0 float elements, 1-2 e4m3 bytes, 3-4 u32 words of 8 e2m1 codes) whose row 0 is at w_ptr (_wp's pointer)."""
    RU: tl.constexpr = K // 8 if FMT >= 3 else K                        # row length in w_ptr's units
    UB: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    # 1 KB chunks: the expert gate / up task's in 4 / 16 KB (fewer instructions) were -0.9 / -1.5% (NOTES session 37)
    l2_prefetch(w_ptr + r0.to(tl.int64) * RU, nr * RU, UB, USE_ASM, 1024, 256)


@triton.jit
def prefetch_cols(w_ptr, c0, nc, K: tl.constexpr, N_ROWS: tl.constexpr, USE_ASM: tl.constexpr, BLOCK: tl.constexpr):
    """Prefetch columns [c0, c0 + nc) of every row of a row-major [N_ROWS, K] float matrix whose row 0 is 16-byte
    aligned: one bulk prefetch per row (BLOCK >= N_ROWS lanes), widened to whole 16-byte pieces (the router's
    [E, nc] slice an o_proj task reads: plan.route_in_o). Rows whose length is not a multiple of 16 bytes: nothing."""
    UB: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
    if USE_ASM and cuda_capability_geq(9, 0) and (K * UB) % 16 == 0:
        offs = tl.arange(0, BLOCK)
        b0 = c0 * UB // 16 * 16                                         # bytes, 16-aligned
        size = tl.where(offs < N_ROWS, ((c0 + nc) * UB + 15) // 16 * 16 - b0, 0).to(tl.int32)
        p = w_ptr.to(tl.pointer_type(tl.int8)) + offs.to(tl.int64) * (K * UB) + b0
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [p, size], dtype=tl.int32, is_pure=False, pack=1)

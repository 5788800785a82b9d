"""Device-side signal / wait: the one synchronisation primitive of the monokernel and of KCCL.

A *counter* is an int32 word in global memory that only grows. A producer finishes its stores, then `signal`s
(bar.sync so every thread's stores come first, then one release-add by thread 0); a consumer `wait`s until the
counter reaches a target (acquire loads, so its later loads see the producer's stores). Between GPUs the same pair
works on peer / symmetric memory with SYS=True (system scope).

Two implementations, chosen by the USE_ASM constexpr:
- GPU (USE_ASM=True): inline PTX, `ld.global.acquire.{gpu,sys}.u32` polls (one load per poll, no barrier per
  iteration: Triton's scalar atomics broadcast through shared memory and cost a bar.sync each) and
  `red.release.{gpu,sys}.global.add.u32` predicated on thread 0. The deadline is read from `%globaltimer`.
- Interpreter (TRITON_INTERPRET=1, USE_ASM=False): inline asm does not run there, so plain `tl.atomic_add(ptr, 0,
  sem="acquire")` reads and `tl.atomic_add(ptr, inc, sem="release")` writes. Programs run one after another, so a
  wait is either already satisfied or never will be: it checks once and reports "unsatisfiable" at once.

Every wait is bounded: it returns a status instead of hanging, and also gives up when an abort word (the
monokernel's stop flag) becomes non-zero, so one stuck program can stop the whole grid.
"""
from __future__ import annotations

import triton
import triton.language as tl

# wait() status codes (also the monokernel's error codes)
WAIT_OK = 0
WAIT_ABORTED = 1      # the abort word was set by someone else: leave quietly
WAIT_TIMEOUT = 2      # GPU: the deadline passed; interpreter: the target can never be reached


@triton.jit
def globaltimer():
    """Nanoseconds of the GPU's global timer (int64)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def clock64():
    """This SM's cycle counter (int64): exact durations on one SM, not comparable across SMs."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def ld_acquire(ptr, SYS: tl.constexpr = False):
    """Acquire load of an int32 word (every thread loads; all see a value at least as new as the release)."""
    if SYS:
        v = tl.inline_asm_elementwise("ld.global.acquire.sys.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                      is_pure=False, pack=1)
    else:
        v = tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                      is_pure=False, pack=1)
    return v


@triton.jit
def ld_volatile(ptr, USE_ASM: tl.constexpr):
    """Uncached int32 read of a flag another agent (program, GPU, host) may change while we run."""
    if USE_ASM:
        v = tl.inline_asm_elementwise("ld.volatile.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                      is_pure=False, pack=1)
    else:
        v = tl.load(ptr)
    return v


@triton.jit
def red_release(ptr, inc, SYS: tl.constexpr = False):
    """Thread 0 adds `inc` with release semantics. Call after a bar.sync (signal() does) so the other threads'
    stores are ordered before thread 0's release (the CUTLASS semaphore pattern)."""
    if SYS:
        tl.inline_asm_elementwise(
            """{ .reg .pred %p; .reg .u32 %t; mov.u32 %t, %tid.x; setp.eq.u32 %p, %t, 0;
            @%p red.release.sys.global.add.u32 [$1], $2; mov.u32 $0, 0; }""",
            "=r,l,r", [ptr, inc], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            """{ .reg .pred %p; .reg .u32 %t; mov.u32 %t, %tid.x; setp.eq.u32 %p, %t, 0;
            @%p red.release.gpu.global.add.u32 [$1], $2; mov.u32 $0, 0; }""",
            "=r,l,r", [ptr, inc], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def st_release_sys(ptr, val, USE_ASM: tl.constexpr):
    """Store an int32 with system-scope release: a host polling `ptr` then sees every earlier store of this
    thread (the token ring: tokens first, then the write index). Every thread stores the same value."""
    if USE_ASM:
        tl.inline_asm_elementwise("st.release.sys.global.b32 [$1], $2; mov.u32 $0, 0;", "=r,l,r", [ptr, val],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr, val)


@triton.jit
def signal(counter_ptr, inc, USE_ASM: tl.constexpr, SYS: tl.constexpr = False):
    """Publish this program's finished stores: counter += inc with release semantics."""
    tl.debug_barrier()  # every thread's output stores before the one signalling atomic
    if USE_ASM:
        red_release(counter_ptr, inc, SYS)
    else:
        if SYS:
            tl.atomic_add(counter_ptr, inc, sem="release", scope="sys")
        else:
            tl.atomic_add(counter_ptr, inc, sem="release", scope="gpu")


@triton.jit
def cta_max(x, NT: tl.constexpr):
    """Make a per-thread int32 uniform across the program (CTA): the max over every thread's value.

    Values read by inline asm differ between threads when a flag changes mid-poll, but Triton assumes scalars
    are uniform: a branch taken by some threads only would split barriers. An opaque per-element copy (so the
    compiler cannot fold reduce(splat(x)) back to x) over >= one element per thread, then a max-reduction
    (shuffles + shared memory + barrier), gives every thread the same answer. NT = 32 * num_warps."""
    v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x + tl.zeros((NT,), dtype=tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    return tl.max(v, axis=0)


@triton.jit
def flag_is_set(ptr, USE_ASM: tl.constexpr, NT: tl.constexpr = 256):
    """A stop / abort word read by every thread, agreed across the program (uniform bool)."""
    return flag_agreed(ld_volatile(ptr, USE_ASM), USE_ASM, NT)


@triton.jit
def flag_agreed(v, USE_ASM: tl.constexpr, NT: tl.constexpr = 256):
    """flag_is_set's second half: a flag word each thread read (ld_volatile) -> one uniform bool. Split so the
    read can go out early and its round trip overlap other work (the monokernel's claim)."""
    if USE_ASM:
        a = cta_max((v != 0).to(tl.int32), NT)
    else:
        a = (v != 0).to(tl.int32)
    return a != 0


@triton.jit
def wait(counter_ptr, target, abort_ptr, timeout_ns, USE_ASM: tl.constexpr, SYS: tl.constexpr = False,
         NT: tl.constexpr = 256):
    """Spin until *counter_ptr >= target. Returns WAIT_OK (0), WAIT_ABORTED (1: *abort_ptr != 0) or
    WAIT_TIMEOUT (2: `timeout_ns` passed on the GPU; under the interpreter, not satisfied on the first look).

    GPU: every thread polls on its own (no barrier per poll; a thread may leave the loop early), then one
    cta_max makes the status uniform (the most pessimistic thread wins: abort/timeout over success)."""
    if USE_ASM:
        v = ld_acquire(counter_ptr, SYS)
        stop = ld_volatile(abort_ptr, USE_ASM)
        t0 = globaltimer()
        elapsed = t0 - t0
        while (v < target) & (stop == 0) & (elapsed < timeout_ns):
            v = ld_acquire(counter_ptr, SYS)
            stop = ld_volatile(abort_ptr, USE_ASM)
            elapsed = globaltimer() - t0
        status = cta_max(tl.where(v >= target, 0, tl.where(stop != 0, 1, 2)), NT)
    else:
        v = tl.atomic_add(counter_ptr, 0, sem="acquire")
        stop = tl.load(abort_ptr)
        status = tl.where(v >= target, 0, tl.where(stop != 0, 1, 2))
    return status


@triton.jit
def read_counter(counter_ptr, USE_ASM: tl.constexpr):
    """Current value of a counter (for error reports)."""
    if USE_ASM:
        v = ld_acquire(counter_ptr)
    else:
        v = tl.atomic_add(counter_ptr, 0, sem="acquire")
    return v


# ---- puts into a peer's symmetric region (the monokernel's cross-GPU tasks) ----------------------------------
# Every rank allocates the same symmetric layout; rank q's copy of an address `p` of ours is p + poff[q] (a table of
# int64 distances in elements, built by the host from the mapped addresses: torch symmetric memory on GPUs, plain
# CPU tensors of one process under the interpreter). poff[own rank] = 0: putting to ourselves is the same code.

@triton.jit
def peer(ptr, poff_ptr, q):
    """Rank q's copy of `ptr` (an address inside this rank's symmetric region)."""
    return ptr + tl.load(poff_ptr + q)


@triton.jit
def put_span(ptr, poff_ptr, q, n0, n1, BLOCK: tl.constexpr):
    """(rank q's copy of ptr)[n0:n1] = ptr[n0:n1]. Plain stores (over NVLink for a peer); order them before the
    signal that publishes them with signal_peer (its bar.sync + release at system scope)."""
    dst = peer(ptr, poff_ptr, q)
    for k0 in range(n0, n1, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        m = offs < n1
        tl.store(dst + offs, tl.load(ptr + offs, mask=m, other=0), mask=m)


@triton.jit
def signal_peer(ctr_ptr, poff_ptr, q, USE_ASM: tl.constexpr):
    """Rank q's copy of the counter `ctr_ptr` += 1 (release, system scope), after every thread's stores."""
    signal(peer(ctr_ptr, poff_ptr, q), 1, USE_ASM, SYS=True)

"""What the Triton decode kernels need from a GPU.

Triton has the e4m3 type (fp8e4nv) from sm_89 (Ada, Hopper) on; on sm_80 / sm_86 (A100, A10, ...) it refuses to
compile a kernel that so much as takes an fp8e4nv pointer ("type fp8e4nv not supported in this architecture"). The
formats whose codes or scales are e4m3 (fp8, fp8-block codes, nvfp4 group scales) therefore reach the kernels of
such GPUs as their raw bytes (uint8 views where `e4m3_native` is False), and every kernel that converts e4m3
decodes those bits instead (tiles._as_f32, exact): the graph backend's tiles, the tensor-core fp4 GEMV's nvfp4
scales, the monokernel's qtile. mxfp4 (E8M0 scales) and float formats need neither.
"""
from __future__ import annotations

import contextlib
import os

import torch

E4M3_FORMATS = ("fp8", "fp8_block", "nvfp4")
E4M3_MIN_CAPABILITY = (8, 9)
# KIE_E4M3_BITS=1: e4m3 tensors go to the kernels as their bytes on every device (tests of the pre-sm_89 path on
# the interpreter and on an H200); read at import.
FORCE_BITS = os.environ.get("KIE_E4M3_BITS", "0") == "1"
_NATIVE: dict = {}


def has_fp8e4nv(device: torch.device, arch: int | None = None) -> bool:
    """Whether Triton compiles fp8e4nv for `device` (or for sm_`arch` when given: offline compiles). CPU (the
    interpreter): yes."""
    if arch is not None:
        return arch >= 10 * E4M3_MIN_CAPABILITY[0] + E4M3_MIN_CAPABILITY[1]
    if device.type != "cuda":
        return True
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NATIVE:
        _NATIVE[idx] = torch.cuda.get_device_capability(idx) >= E4M3_MIN_CAPABILITY
    return _NATIVE[idx]


def e4m3_native(device: torch.device) -> bool:
    """Whether the kernels get e4m3 tensors as fp8e4nv (else as their bytes): has_fp8e4nv, unless KIE_E4M3_BITS=1."""
    return has_fp8e4nv(device) and not FORCE_BITS


def e4m3_arg(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` as a kernel takes it: an e4m3 tensor as its uint8 bytes where e4m3_native is False (decoded in the
    kernel by tiles._as_f32), anything else (and None) unchanged."""
    if t is not None and t.dtype == torch.float8_e4m3fn and not e4m3_native(t.device):
        return t.view(torch.uint8)
    return t


@contextlib.contextmanager
def offline_target(arch: int):
    """Compile for sm_`arch` on a machine without that GPU (offline tests, SASS counts, compile_offline): inside, a
    stand-in driver reports that target to Triton's JIT warmup and compile, and to the kernels'
    target_info.cuda_capability_geq guards (which are not in Triton's cache key: compile under the target you mean).
    Nothing can be launched through it."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    target = GPUTarget("cuda", arch, 32)

    class _Target:
        def get_current_target(self):
            return target

        def get_current_device(self):
            # a device key of this target's own: Triton's JIT keeps a compiled kernel per device key (and the
            # target it was first compiled for with it), so a shared key 0 would hand sm_90's kernel to a later
            # sm_80 compile in the same process, or to a real launch on device 0 the other way round
            return f"offline-sm{arch}"

        def get_current_stream(self, device=None):
            return 0

    prev = driver._active
    driver.set_active(_Target())
    try:
        yield target
    finally:
        driver._active = prev

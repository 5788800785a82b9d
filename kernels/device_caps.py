"""What the Triton decode kernels need from a GPU.

Triton has the e4m3 type (fp8e4nv) from sm_89 (Ada, Hopper) on; on sm_80 / sm_86 (A100, A10, ...) it refuses to
compile a kernel that so much as takes an fp8e4nv pointer ("type fp8e4nv not supported in this architecture"). The
formats whose codes or scales are e4m3 (fp8, fp8-block codes, nvfp4 group scales) therefore reach the kernels of
such GPUs as their raw bytes (uint8 views where `e4m3_native` is False): the graph backend's tiles decode those bits
(tiles._as_f32, exact), the tensor-core fp4 GEMV likewise. The monokernel's own tiles do not, so it refuses e4m3
formats there (`check_formats`, when it is built: a one-line error naming the format, the GPU and what to use
instead, and `--backend auto` moves on to the graph backend). mxfp4 (E8M0 scales) and float formats need neither.
"""
from __future__ import annotations

import os
from typing import Iterable

import torch

from kie_moe.models.errors import UnsupportedOnDevice

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
    """Whether the graph backend's kernels get e4m3 tensors as fp8e4nv (else as their bytes): has_fp8e4nv, unless
    KIE_E4M3_BITS=1."""
    return has_fp8e4nv(device) and not FORCE_BITS


def check_formats(fmts: Iterable[str], device: torch.device, backend: str) -> None:
    """Raise UnsupportedOnDevice when `backend` (one that needs fp8e4nv for e4m3 formats: the monokernel) is built
    for a CUDA GPU without it and `fmts` hold an e4m3 format."""
    bad = sorted({f.replace('-', '_') for f in fmts} & set(E4M3_FORMATS))
    if bad and not has_fp8e4nv(device):
        cap = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        raise UnsupportedOnDevice(
            f"{backend} backend: {', '.join(f.replace('_', '-') for f in bad)} weights need a GPU of compute "
            f"capability {E4M3_MIN_CAPABILITY[0]}.{E4M3_MIN_CAPABILITY[1]} or newer here (Triton has no e4m3 type "
            f"before Ada / Hopper); {name} is {cap[0]}.{cap[1]}. Use --backend graph (decodes e4m3 from its "
            f"bytes), or convert to mxfp4 or keep bf16")

"""What the Triton decode kernels need from a GPU, checked when a backend is built (not at the first launch, where
Triton's compile error names neither the weight format nor what to do instead)."""
from __future__ import annotations

from typing import Iterable

import torch

from kie_moe.models.errors import UnsupportedOnDevice

# Formats whose codes or scales the kernels convert as e4m3 (Triton's fp8e4nv): fp8 codes, fp8-block codes,
# nvfp4's group scales. Triton has that type from sm_89 (Ada, Hopper) on; on sm_80 / sm_86 it refuses to compile
# it ("type fp8e4nv not supported in this architecture"). mxfp4 (E8M0 scales) and float formats compile there.
E4M3_FORMATS = ("fp8", "fp8_block", "nvfp4")
E4M3_MIN_CAPABILITY = (8, 9)


def e4m3_capable(device: torch.device, arch: int | None = None) -> bool:
    """Whether kernels for `device` (or for sm_`arch` when given: offline compiles) may take e4m3 (fp8e4nv)
    pointers. CPU (the interpreter): yes."""
    if arch is not None:
        return arch >= 10 * E4M3_MIN_CAPABILITY[0] + E4M3_MIN_CAPABILITY[1]
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= E4M3_MIN_CAPABILITY


def check_formats(fmts: Iterable[str], device: torch.device, backend: str) -> None:
    """Raise UnsupportedOnDevice when `device` is a CUDA GPU the kernels cannot compile `fmts` for."""
    bad = sorted({f.replace('-', '_') for f in fmts} & set(E4M3_FORMATS))
    if bad and not e4m3_capable(device):
        cap = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        raise UnsupportedOnDevice(
            f"{backend} backend: {', '.join(f.replace('_', '-') for f in bad)} weights need a GPU of compute "
            f"capability {E4M3_MIN_CAPABILITY[0]}.{E4M3_MIN_CAPABILITY[1]} or newer (Triton has no e4m3 type "
            f"before Ada / Hopper); {name} is {cap[0]}.{cap[1]}. Use --backend reference (dequantizes in PyTorch), "
            f"or convert to mxfp4 or keep bf16")

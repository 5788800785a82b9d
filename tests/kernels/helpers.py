"""Shared bits of the kernel tests: the device they run on and a closeness check with a useful message."""

import os

import pytest
import torch

# Under TRITON_INTERPRET=1 (CI, the default from tests/conftest.py) kernels run on CPU tensors; with
# KIE_GPU_TESTS=1 on the device machine the same small-shape tests run on the GPU.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else ("cuda" if torch.cuda.is_available() else None)
needs_device = pytest.mark.skipif(DEV is None, reason="no CUDA GPU and TRITON_INTERPRET is not 1")

FORMATS = ["bf16", "fp8", "fp8_block", "nvfp4", "mxfp4"]


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5, what: str = ""):
    """|got - want| <= rel * max|want| elementwise (fp32 sums in another order differ by ~1e-7 relative)."""
    got, want = got.float().reshape(-1).cpu(), want.float().reshape(-1).cpu()
    scale = want.abs().max().clamp_min(1e-30)
    err = (got - want).abs().max() / scale
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    assert err <= rel, f"{what}: max error {err.item():.3g} x max|ref| > {rel}"

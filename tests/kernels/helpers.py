"""Shared bits of the kernel tests: the device they run on and a closeness check with a useful message."""

import json
import os
import subprocess
import sys

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


def compiled_json(argv: list[str], **env):
    """Run `python *argv` without TRITON_INTERPRET (offline compiles need the JIT) with `env` added; it must exit 0
    and print a JSON line last, which is returned."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update(env)
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=full, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

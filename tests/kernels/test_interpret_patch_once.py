"""kernels/interpret_patch_once.py (the speed-up of Triton's interpreter on the CPU path): a launch whose kernel
calls device functions still computes what torch does, device-function calls inside it skip triton's re-patching,
and after the launch triton.language's builtins are triton's own again."""
import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")


@triton.jit
def _clamp_scale(v, lo, s):
    return tl.where(v < lo, lo, v) * s


@triton.jit
def _twice(v, lo, s):
    return _clamp_scale(v, lo, s) + _clamp_scale(v, lo, s)


@triton.jit
def _kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(y_ptr + offs, _twice(v, -0.5, 3.0), mask=m)


@triton.jit
def _plain(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def test_launch_with_device_functions_patches_once_and_restores(monkeypatch):
    from triton.runtime import interpreter as I
    import kie_moe.kernels  # noqa: F401
    assert getattr(I._patch_lang, "_kie_patch_once", False), "importing kie_moe.kernels did not install the shim"
    calls, patched = [], []
    inner, patch_builtin = I._patch_lang, I._patch_builtin
    monkeypatch.setattr(I, "_patch_lang", lambda fn: calls.append(fn.__name__) or inner(fn))
    monkeypatch.setattr(I, "_patch_builtin", lambda *a: patched.append(1) or patch_builtin(*a))
    x = torch.randn(37)
    y = torch.empty_like(x)
    _plain[(3,)](x, y, x.numel(), BLOCK=16)
    one_launch = len(patched)
    assert one_launch > 0 and torch.equal(y, x)
    calls.clear(), patched.clear()
    _kernel[(3,)](x, y, x.numel(), BLOCK=16)
    torch.testing.assert_close(y, 2 * 3.0 * x.clamp_min(-0.5), rtol=1e-6, atol=1e-6)
    # 3 programs x 3 device calls asked, all inside the launch that patched tl first
    assert calls[0] == "_kernel" and len(calls) == 1 + 3 * 3
    assert len(patched) == one_launch, "device-function calls re-patched triton.language"
    assert tl.core.is_builtin(tl.where) and tl.core.is_builtin(tl.load), "the launch's patches were not restored"
    from kie_moe.kernels.interpret_patch_once import _patched
    assert _patched is None

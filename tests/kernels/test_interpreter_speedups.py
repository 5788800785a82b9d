"""kernels/interpreter_speedups.py (Triton's interpreter on the CPU path): a launch whose kernel calls device
functions still computes what torch does, device-function calls inside it skip triton's re-patching, and after the
launch triton.language's builtins are triton's own again; the int32 overflow asserts are off unless asked for."""
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
    from kie_moe.kernels.interpreter_speedups import _patched
    assert _patched is None


def test_overflow_checks_off_change_nothing(monkeypatch):
    """sanitize_overflow is off (debug is): an int32 product that wraps gives the same value with triton's default
    (sanitize on, debug off: the check is built, then dropped by device_assert) and without it."""
    import dataclasses

    from triton.runtime import interpreter as I

    @triton.jit
    def _mul(x_ptr, y_ptr):
        tl.store(y_ptr, tl.load(x_ptr) * 65536)

    b = I.interpreter_builder
    assert not b.options.debug and not b.options.sanitize_overflow
    x = torch.tensor([65537], dtype=torch.int32)
    got = []
    for on in (False, True):
        monkeypatch.setattr(b, "options", dataclasses.replace(b.options, sanitize_overflow=on))
        y = torch.zeros(1, dtype=torch.int32)
        _mul[(1,)](x, y)
        got.append(int(y[0]))
    assert got == [65536, 65536]                 # 65537 * 65536 = 2^32 + 65536 wraps to 65536 in int32

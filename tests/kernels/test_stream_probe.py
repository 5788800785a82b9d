"""benchmarks/stream_probe.py on CPU: its probe kernels (the monokernel's own stream functions, one task after
another per program) compute the torch reference on tiny odd shapes through the interpreter, for bf16, fp8 and
nvfp4 weights, so the GPU timing run measures the real loop and is never lost to a typo."""

import pytest
import torch
import torch.nn.functional as F

from ..scripts import load_script

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _weights(fmt, rows, k, g):
    """(codes as the kernel reads them, scales, float reference [rows, k] in the kernel's output units)."""
    if fmt == 0:
        w = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        return w, torch.zeros(16), w.float()
    if fmt == 1:
        w = torch.randn(rows, k, generator=g).to(torch.float8_e4m3fn)
        return w, torch.zeros(16), w.float()
    words = torch.randint(0, 2 ** 31, (rows, k // 8), generator=g, dtype=torch.int64)
    s = (torch.rand(rows * k // 16, generator=g) + 0.5).to(torch.float8_e4m3fn)
    nib = torch.stack([(words >> (4 * e)) & 0xF for e in range(8)], dim=-1).reshape(rows, k)   # x[8j + e]
    ref = E2M1[nib] * s.float().view(rows, k // 16).repeat_interleave(16, dim=1) * 2.0 ** -14
    return words.to(torch.int32).view(torch.uint32), s, ref


@pytest.mark.parametrize("fmt", [0, 1, 3])
def test_probe_kernels_match_torch(fmt):
    sp = load_script("benchmarks/stream_probe.py")
    g = torch.Generator().manual_seed(fmt)
    progs, iters, rows, k = 2, 2, 12, 384       # 12 rows: not a multiple of BN 8; K: 3 steps of 128
    n = progs * iters * rows
    wg, s, g_ref = _weights(fmt, n, k, g)
    wu, s_u, u_ref = _weights(fmt, n, k, g)
    if fmt == 3:   # the probe passes one scale buffer for both matrices
        wu, u_ref = wg, g_ref
    x = torch.randn(k, generator=g)
    nw = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16)
    xn = x / (x.pow(2).mean() + 1e-6).sqrt() * nw.float()
    f = torch.ones(n)
    h = torch.zeros(n)
    sp._glu_probe[(progs,)](wg, wu, s, f, x, nw, h, iters, rows, k, fmt, 8, 128, 0, 0)
    want = F.silu(g_ref @ xn) * (u_ref @ xn)
    torch.testing.assert_close(h, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    # phased (one task per program per phase, chained by a counter): one program runs every phase in order
    h1 = torch.zeros(n)
    ctr = torch.zeros(2, dtype=torch.int32)
    sp._glu_probe[(1,)](wg, wu, s, f, x, nw, h1, progs * iters, rows, k, fmt, 8, 128, 0, 0, ctr, True, False)
    torch.testing.assert_close(h1, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    assert int(ctr[0]) == progs * iters
    y = torch.zeros(n)
    sp._gemv_probe[(progs,)](wg, s, f, x, nw, y, iters, rows, k, fmt, 8, 128, 0, 0)
    want = g_ref @ xn
    torch.testing.assert_close(y, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


@pytest.mark.parametrize("fmt", [0, 1])
def test_tile_glu_probe_matches_torch(fmt):
    """The graph backend's tile loop in the probe's persistent form: same tasks, same answer (odd rows per task:
    the last BN chunk of each task is partial)."""
    sp = load_script("benchmarks/stream_probe.py")
    g = torch.Generator().manual_seed(10 + fmt)
    progs, iters, rows, k = 2, 2, 12, 384
    n = progs * iters * rows
    wg, _, g_ref = _weights(fmt, n, k, g)
    wu, _, u_ref = _weights(fmt, n, k, g)
    f = torch.rand(n, generator=g) + 0.5                        # fp8: per-row scales (one buffer for both)
    if fmt == 1:
        g_ref, u_ref = g_ref * f[:, None], u_ref * f[:, None]
    x = torch.randn(k, generator=g)
    nw = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16)
    xn = x / (x.pow(2).mean() + 1e-6).sqrt() * nw.float()
    h = torch.zeros(n)
    sp._tile_glu_probe[(progs,)](wg, wu, torch.zeros(16), f, x, nw, h, iters, rows, k, fmt, 8, 128, True)
    want = F.silu(g_ref @ xn) * (u_ref @ xn)
    torch.testing.assert_close(h, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())


def test_copy_probe_reads_every_task_word():
    sp = load_script("benchmarks/stream_probe.py")
    progs, iters, task, block = 3, 2, 96, 32
    w = torch.arange(progs * iters * task, dtype=torch.int32)
    out = torch.zeros(progs * block, dtype=torch.int32)
    sp._copy_probe[(progs,)](w, out, iters, task, block, 2)
    assert int(out.sum()) == int(w.sum())


def test_tma_glu_probe_matches_torch():
    """The TMA-tiled gate / up probe (fp8 tiles through tensor descriptors, one flat pipelined loop over row chunks
    and K steps): silu(f g) * (f u) of every task's rows, free-running and phased (one program runs the phases in
    order, so the counter must reach every phase)."""
    import triton
    sp = load_script("benchmarks/stream_probe.py")
    g = torch.Generator().manual_seed(20)
    progs, iters, rows, k = 2, 2, 48, 384       # 3 row chunks of 16 per task, 3 K steps of 128
    n = progs * iters * rows
    wg, _, g_ref = _weights(1, n, k, g)
    wu, _, u_ref = _weights(1, n, k, g)
    f = torch.rand(n, generator=g) + 0.5
    x = torch.randn(k, generator=g)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))   # descriptors' scratch
    want = F.silu((g_ref @ x) * f) * ((u_ref @ x) * f)
    h = torch.full((n,), float("nan"))
    ctr = torch.zeros(2, dtype=torch.int32)
    sp._tma_glu_probe[(progs,)](wg, wu, f, x, h, iters, n, ctr, rows, k, 16, 128, 2, False, False, 32)
    torch.testing.assert_close(h, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    h1 = torch.full((n,), float("nan"))
    sp._tma_glu_probe[(1,)](wg, wu, f, x, h1, progs * iters, n, ctr, rows, k, 16, 128, 2, True, False, 32)
    torch.testing.assert_close(h1, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    assert int(ctr[0]) == progs * iters
    # the tensor-core consumer: x rounded to fp16 (the tile's codes are exact in fp16)
    xh = x.half().float()
    want_h = F.silu((g_ref @ xh) * f) * ((u_ref @ xh) * f)
    h2 = torch.full((n,), float("nan"))
    sp._tma_glu_probe[(progs,)](wg, wu, f, x, h2, iters, n, ctr, rows, k, 16, 128, 2, False, False, 32, False, 2)
    torch.testing.assert_close(h2, want_h, rtol=2e-3, atol=2e-3 * want_h.abs().max().item())
    # the codes-only consumer: each row's gate + up byte sum
    h3 = torch.full((n,), float("nan"))
    gb, ub = wg.view(torch.uint8), wu.view(torch.uint8)
    sp._tma_glu_probe[(progs,)](gb, ub, f, x, h3, iters, n, ctr, rows, k, 16, 128, 2, False, False, 32, False, 1)
    assert torch.equal(h3, (gb.long().sum(1) + ub.long().sum(1)).float())


def test_mma_glu_probe_matches_torch():
    """The monokernel's gate / up task (mma8_glu_task) in the probe's loop: silu(f g) * (f u) against x RMS-normed and
    rounded to fp16, free-running on 2 programs and phased on one (the counter reaches every phase)."""
    from kie_moe.kernels.monokernel.mma8 import scratch_words
    sp = load_script("benchmarks/stream_probe.py")
    g = torch.Generator().manual_seed(30)
    progs, iters, rows, k, nw = 2, 2, 48, 256, 4
    n = progs * iters * rows
    wg, _, g_ref = _weights(1, n, k, g)
    wu, _, u_ref = _weights(1, n, k, g)
    f = torch.rand(n, generator=g) + 0.5
    x = torch.randn(k, generator=g)
    nw_ = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16)
    xn = (x * torch.rsqrt(x.square().mean() + 1e-6) * nw_.float()).half().float()
    want = F.silu((g_ref @ xn) * f) * ((u_ref @ xn) * f)
    sw = scratch_words(k, nw)
    for grid, n_iter, phased in ((progs, iters, False), (1, progs * iters, True)):
        h = torch.full((n,), float("nan"))
        ctr = torch.zeros(2, dtype=torch.int32)
        scr = torch.full((grid * sw,), float("nan"))
        sp._mma_glu_probe[(grid,)](wg, wu, f, x, nw_, h, scr, n_iter, ctr, rows, k, sw, nw, 256, phased, True, False,
                                   32 * nw, num_warps=nw)
        torch.testing.assert_close(h, want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
        assert int(ctr[0]) == (progs * iters if phased else 0)

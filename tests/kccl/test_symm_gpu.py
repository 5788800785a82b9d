"""GpuHeap: the Triton put / signal / wait (kccl/sync.py) under the same one-shot algorithm. On CPU the kernels
run through Triton's interpreter over plain tensors (N=1 loopback, two ranks interleaved in one thread, the
watchdog); the `gpu` tests run the same code on CUDA: a single-GPU loopback (N=1 puts into its own row, signals
its own word and waits for it), two ranks on one device, the watchdog (device timer, then the host deadline), and
torch symmetric memory over a one-rank process group."""
from __future__ import annotations

import time

import pytest
import torch

from kie_moe.kccl import collectives as C
from kie_moe.kccl.symm import KcclTimeout
from kie_moe.kccl.symm_gpu import PROGRAMS, GpuHeap


def _two_ranks_interleaved(device):
    h = GpuHeap.from_tensors(2, 4096, device=device, timeout_s=2.0)
    g = torch.Generator().manual_seed(0)
    for ep in range(3):                                   # epochs 1..3: words grow, never reset
        xs = [torch.randn(37, 5, generator=g).to(device) for _ in range(2)]
        ys = [torch.randn(3, generator=g).to(device, torch.bfloat16) for _ in range(2)]   # 6 B: byte copy
        p = [C.start(h[r], xs[r]) for r in range(2)]
        q = [C.start(h[r], ys[r]) for r in range(2)]
        for r in range(2):
            assert torch.equal(C.finish_all_reduce(h[r], p[r]), xs[0] + xs[1])
            assert torch.equal(C.finish_all_gather(h[r], q[r]), torch.stack(ys))
    assert h[0].own_sig.tolist() == [6 * PROGRAMS, 6 * PROGRAMS]   # its own word too: it puts into its own row


def _loopback(device):
    """N = 1: every primitive runs (put into the own row, signal the own word, bounded wait), epochs grow."""
    (h,) = GpuHeap.from_tensors(1, 4096, device=device, timeout_s=2.0)
    for ep in range(1, 4):
        x = torch.arange(10.0, device=device) * ep
        assert torch.equal(C.all_reduce_sum(h, x), x) and torch.equal(C.all_gather(h, x), x[None])
        assert h.own_sig.tolist() == [2 * ep * PROGRAMS]
        assert torch.equal(h.slot(0, 0, 40).view(torch.float32), x)     # the gather's epoch (even) landed there


def _watchdog(device, timeout_s):
    a, _ = GpuHeap.from_tensors(2, 256, device=device, timeout_s=timeout_s)
    p = C.start(a, torch.ones(4, device=device))          # rank 1 never puts
    t0 = time.monotonic()
    with pytest.raises(KcclTimeout, match=r"rank 0: no signal for epoch 1 from rank 1"):
        C.finish_all_reduce(a, p)
    return time.monotonic() - t0


def test_interpreted_kernels_two_ranks():
    _two_ranks_interleaved("cpu")


def test_interpreted_loopback_and_watchdog():
    _loopback("cpu")
    _watchdog("cpu", 0.1)


@pytest.mark.gpu
def test_gpu_loopback_one_device():
    _loopback("cuda")


@pytest.mark.gpu
def test_gpu_two_ranks_on_one_device():
    _two_ranks_interleaved("cuda")


@pytest.mark.gpu
def test_gpu_watchdog_times_out():
    assert _watchdog("cuda", 0.05) < 1.0                   # the device timer fired, not the host deadline


@pytest.mark.gpu
def test_gpu_symmetric_memory_loopback():
    """N=1 through symm_mem.rendezvous and the same algorithm (the rendezvous needs a process group even for one
    rank: a one-rank NCCL group on 127.0.0.1, as the workers of kie_moe/launch.py use)."""
    import torch.distributed as dist
    from kie_moe.launch import free_port
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        h = GpuHeap.rendezvous(capacity_bytes=1 << 16, timeout_s=5.0)
        for ep in range(1, 4):
            x = torch.randn(1000, device="cuda")
            assert torch.equal(C.all_reduce_sum(h, x), x)
            assert torch.equal(C.all_gather(h, x), x[None])
            assert h.own_sig.tolist() == [2 * ep * PROGRAMS]
    finally:
        dist.destroy_process_group()

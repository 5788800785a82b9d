"""GpuHeap: the Triton put / signal / wait (kccl/sync.py) under the same one-shot algorithm. On CPU the kernels
run through Triton's interpreter over plain tensors (N=1 loopback, two ranks interleaved in one thread, the
watchdog); the `gpu` tests run the same code on CUDA (a single-GPU loopback, and symmetric memory when a process
group can be formed)."""
from __future__ import annotations

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
    assert h[0].own_sig.tolist() == [0, 6 * PROGRAMS]


def test_interpreted_kernels_two_ranks():
    _two_ranks_interleaved("cpu")


def test_interpreted_loopback_and_watchdog():
    (h,) = GpuHeap.from_tensors(1, 256)
    x = torch.arange(10.0)
    assert torch.equal(C.all_reduce_sum(h, x), x) and torch.equal(C.all_gather(h, x), x[None])
    a, b = GpuHeap.from_tensors(2, 256, timeout_s=0.1)
    p = C.start(a, torch.ones(4))                         # rank 1 never puts
    with pytest.raises(KcclTimeout, match=r"rank 0: no signal for epoch 1 from rank 1"):
        C.finish_all_reduce(a, p)


@pytest.mark.gpu
def test_gpu_two_ranks_on_one_device():
    _two_ranks_interleaved("cuda")


@pytest.mark.gpu
def test_gpu_watchdog_times_out():
    a, _ = GpuHeap.from_tensors(2, 256, device="cuda", timeout_s=0.05)
    p = C.start(a, torch.ones(4, device="cuda"))
    with pytest.raises(KcclTimeout, match="from rank 1"):
        C.finish_all_reduce(a, p)


@pytest.mark.gpu
def test_gpu_symmetric_memory_loopback(tmp_path):
    """N=1 through symm_mem.rendezvous and the same algorithm (a one-rank NCCL group on 127.0.0.1)."""
    import torch.distributed as dist
    from kie_moe.launch import free_port
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        h = GpuHeap.rendezvous(capacity_bytes=1 << 16)
        for _ in range(3):
            x = torch.randn(1000, device="cuda")
            assert torch.equal(C.all_reduce_sum(h, x), x)
            assert torch.equal(C.all_reduce_sum(h, x), C.reference_all_reduce_sum(x))
            assert torch.equal(C.all_gather(h, x), C.reference_all_gather(x))
    finally:
        dist.destroy_process_group()

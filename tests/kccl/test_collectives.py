"""KCCL's one-shot algorithms on the CPU heap: N ranks (threads, or processes over /dev/shm) give the fixed-order
sums / stacks bit for bit, across many epochs without any reset of the signal words; the watchdog names the
silent rank; and the result matches torch.distributed (gloo)."""
from __future__ import annotations

import functools
import os
import threading

import pytest
import torch
import torch.multiprocessing as mp

from kie_moe.kccl import collectives as C
from kie_moe.kccl.symm import HostPool, KcclAborted, KcclError, KcclTimeout


def run_ranks(world, fn, timeout=20.0, capacity=1 << 12):
    """fn(rank, heap) in one thread per rank -> list of results; the first real error is raised."""
    pool = HostPool(world, capacity)
    out, errs = [None] * world, []

    def go(r):
        try:
            out[r] = fn(r, pool.handle(r, timeout))
        except BaseException as e:
            errs.append(e)
            pool.abort()

    ts = [threading.Thread(target=go, args=(r,)) for r in range(world)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    if errs:
        raise ([e for e in errs if not isinstance(e, KcclAborted)] or errs)[0]
    return out, pool


def inputs(world, epoch, shape, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * epoch + 7)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_reduce_and_gather_bit_exact_over_epochs(world):
    shapes = [(5, 32), (1,), (3, 7, 5), (700,)]   # 700 fp32 = 2800 B: below the 4096 B slot; (3,7,5) odd sizes

    def rank(r, heap):
        res = []
        for ep, shape in enumerate(shapes * 3):        # 12 rounds x 2 collectives: epochs 1..24, no reset
            xs = inputs(world, ep, shape)
            res.append((C.all_reduce_sum(heap, xs[r]), C.all_gather(heap, xs[r])))
        return res

    out, pool = run_ranks(world, rank)
    for ep, shape in enumerate(shapes * 3):
        xs = inputs(world, ep, shape)
        want_sum = functools.reduce(lambda a, b: a + b, xs[1:], xs[0].clone())    # rank order
        for r in range(world):
            s, g = out[r][ep]
            assert torch.equal(s, want_sum) and s.shape == shape
            assert torch.equal(g, torch.stack(xs))
    # signal words only grew: every source signalled every rank (itself too) once per epoch
    expect = torch.full((world, world), 2 * len(shapes) * 3, dtype=torch.int64)
    assert torch.equal(pool.signals, expect)


def test_large_message_chunks_and_bf16():
    # 3000 fp32 = 12000 B through 4096 B slots: 3 chunks, 3 epochs each call
    def rank(r, heap):
        x = inputs(3, 0, (3000,))[r]
        y = inputs(3, 1, (40, 33), torch.bfloat16)[r]
        return C.all_reduce_sum(heap, x), C.all_gather(heap, x), C.all_reduce_sum(heap, y), heap.epoch

    out, _ = run_ranks(3, rank)
    xs, ys = inputs(3, 0, (3000,)), inputs(3, 1, (40, 33), torch.bfloat16)
    for s, g, sb, ep in out:
        assert torch.equal(s, xs[0] + xs[1] + xs[2]) and torch.equal(g, torch.stack(xs))
        assert sb.dtype == torch.bfloat16 and torch.equal(sb, (ys[0] + ys[1]) + ys[2])
        assert ep == 3 + 3 + 1


def test_interleaved_ranks_and_async_gather():
    """start/finish split: all ranks start, then all finish -- one thread; a second epoch is started before the
    first is finished (a lane plan's all-gather waited on d layers later) and both halves stay intact."""
    pool = HostPool(2, 256)
    h = [pool.handle(r, timeout=1) for r in range(2)]
    a = [torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])]
    b = [torch.tensor([3.0]), torch.tensor([30.0])]
    p1 = [C.start(h[r], a[r]) for r in range(2)]
    p2 = [C.start(h[r], b[r]) for r in range(2)]           # parity 0 while parity 1 still holds epoch 1
    assert [p.parity for p in p1 + p2] == [1, 1, 0, 0]
    for r in range(2):
        assert torch.equal(C.finish_all_gather(h[r], p1[r]), torch.stack(a))
        assert torch.equal(C.finish_all_reduce(h[r], p2[r]), torch.tensor([33.0]))


def test_watchdog_names_silent_rank_and_abort():
    pool = HostPool(3, 64)
    h = pool.handle(0, timeout=0.2)
    C.start(pool.handle(1), torch.ones(2))                   # rank 1 signals rank 0; rank 2 never does
    p = C.start(h, torch.ones(2))
    with pytest.raises(KcclTimeout, match=r"rank 0: no signal for epoch 1 from ranks \[2\]"):
        C.finish_all_reduce(h, p)
    pool.abort()
    with pytest.raises(KcclAborted, match="aborted"):
        C.finish_all_reduce(h, p)
    with pytest.raises(KcclError, match="exceeds"):
        C.start(h, torch.ones(100))                           # 400 B > 64 B, start() alone does not chunk


def _proc_rank(rank, world, path, port, q):
    """A process rank: KCCL over the shared file, and gloo's all_reduce / all_gather as the reference."""
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        heap = HostPool(world, 1 << 12, path=path, create=False).handle(rank, timeout=30)
        res = []
        for ep in range(4):
            x = inputs(world, ep, (9, 17))[rank]
            ints = torch.randint(-50, 50, (64,), generator=torch.Generator().manual_seed(ep * 10 + rank)).float()
            # plain lists through the queue: tensors would travel as file descriptors that the parent must fetch
            # from this process before it exits ("connection reset by peer" when it already has)
            res.append((C.all_reduce_sum(heap, x).tolist(), C.all_gather(heap, x).tolist(),
                        torch.equal(C.all_reduce_sum(heap, ints), C.reference_all_reduce_sum(ints)),
                        torch.equal(C.all_gather(heap, x), C.reference_all_gather(x))))
        q.put((rank, res))
    finally:
        dist.destroy_process_group()


def test_processes_shared_memory_vs_gloo():
    from kie_moe.launch import free_port
    world = 2
    path = HostPool.shm_path() if os.path.isdir("/dev/shm") else None
    if path is None:
        pytest.skip("no /dev/shm")
    HostPool(world, 1 << 12, path=path)                     # create the zeroed file before any rank maps it
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        port = free_port()
        ps = [ctx.Process(target=_proc_rank, args=(r, world, path, port, q)) for r in range(world)]
        [p.start() for p in ps]
        got = dict(q.get(timeout=120) for _ in range(world))
        [p.join(30) for p in ps]
    finally:
        os.unlink(path)
    for ep in range(4):
        xs = inputs(world, ep, (9, 17))
        for r in range(world):
            s, g, ints_equal, gather_equal = got[r][ep]
            assert torch.equal(torch.tensor(s), xs[0] + xs[1]) and torch.equal(torch.tensor(g), torch.stack(xs))
            assert ints_equal and gather_equal       # integers: any summation order is exact, so == gloo

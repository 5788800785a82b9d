"""One-shot all-reduce and all-gather, written once against the symmetric-buffer abstraction (kccl/symm.py).

One epoch of either collective, on rank r of N, message t of n bytes (<= the heap's capacity; larger messages go
through in capacity-sized chunks, one epoch each):
  1. e = ++epoch, parity = e % 2;
  2. for every rank q, this one included (starting at r+1, so ranks do not all hit rank 0 first; ourselves last):
     put t into row r of q's half `parity`, then signal q (q's word r becomes e);
  3. wait until every word in our signals is >= e (bounded: the watchdog raises, naming the silent ranks);
  4. read the N rows out of our half and reduce / stack them in rank order 0..N-1.
No special case for ourselves or for N = 1: a single rank puts into its own row, signals its own word and waits for
it, so one device runs every primitive (put, signal, wait, watchdog) through the same code as N devices.
Step 4 applies the same float operations to the same bytes on every rank, so the result is deterministic and
bit-identical across ranks (the in-process reference of dense/simulate.py sums in the same order).

`start` (steps 1-2) and `finish` (steps 3-4) are separate so that a transfer issued after layer i can be waited on
only d layers later (lane plans), and so a test can interleave ranks in one thread.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .symm import KcclError


@dataclass
class Pending:
    """A started one-shot epoch: what `finish` needs."""
    epoch: int
    parity: int
    payload: torch.Tensor          # this rank's contiguous slice (also put into its own row)


def start(heap, t: torch.Tensor) -> Pending:
    """Steps 1-2: put this rank's payload into every peer and signal them."""
    payload = t.contiguous()
    nbytes = payload.numel() * payload.element_size()
    if nbytes > heap.capacity:
        raise KcclError(f"message of {nbytes} bytes exceeds the symmetric buffer's {heap.capacity} bytes per slot")
    heap.epoch += 1
    e = heap.epoch
    for k in range(1, heap.world + 1):
        q = (heap.rank + k) % heap.world            # k = world: ourselves, last
        heap.put(q, e % 2, payload)
        heap.signal(q)
    return Pending(e, e % 2, payload)


def rows(heap, p: Pending) -> list[torch.Tensor]:
    """Step 3 and the N rows of epoch p, in rank order, each shaped like the payload."""
    heap.wait(p.epoch)
    nbytes = p.payload.numel() * p.payload.element_size()
    return [heap.slot(p.parity, q, nbytes).view(p.payload.dtype).view(p.payload.shape) for q in range(heap.world)]


def finish_all_reduce(heap, p: Pending) -> torch.Tensor:
    """Steps 3-4 of an all-reduce: sum of the rows in rank order (a new tensor, same shape / dtype)."""
    parts = rows(heap, p)
    out = parts[0].clone()
    for x in parts[1:]:
        out += x
    return out


def finish_all_gather(heap, p: Pending) -> torch.Tensor:
    """Steps 3-4 of an all-gather: [N, ...] the rows stacked in rank order (copied out of the buffer)."""
    return torch.stack(rows(heap, p))


def _chunks(heap, t: torch.Tensor) -> list[torch.Tensor]:
    """t -> contiguous flat pieces of at most heap.capacity bytes (one epoch each)."""
    flat = t.contiguous().reshape(-1)
    per = max(1, heap.capacity // flat.element_size())
    return [flat[i:i + per] for i in range(0, flat.numel(), per)] or [flat]


def all_reduce_sum(heap, t: torch.Tensor) -> torch.Tensor:
    """t [...] on every rank -> the elementwise sum over ranks, in rank order, on every rank."""
    out = [finish_all_reduce(heap, start(heap, c)) for c in _chunks(heap, t)]
    return torch.cat(out).view(t.shape)


def all_gather(heap, t: torch.Tensor) -> torch.Tensor:
    """t [...] on every rank -> [N, ...] stacked in rank order on every rank."""
    out = [finish_all_gather(heap, start(heap, c)) for c in _chunks(heap, t)]   # each [N, chunk]
    return torch.cat(out, dim=1).view(heap.world, *t.shape)


class KcclCollective:
    """dense/simulate.py's `Collective` (rank, world, all_reduce_sum, all_gather) on a symmetric heap."""

    def __init__(self, heap):
        self.heap, self.rank, self.world = heap, heap.rank, heap.world

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(self.heap, t)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return all_gather(self.heap, t)

    def abort(self):
        self.heap.abort()


class KcclThreadGroup:
    """N ranks as threads of one process over one HostPool: the drop-in for dense/simulate.py's InProcessGroup
    (handle(rank) -> Collective, abort())."""

    def __init__(self, world: int, timeout: float = 60.0, capacity_bytes: int = 1 << 16):
        from .symm import HostPool
        self.world = world
        self.pool = HostPool(world, capacity_bytes)
        self.timeout = timeout

    def handle(self, rank: int) -> KcclCollective:
        return KcclCollective(self.pool.handle(rank, self.timeout))

    def abort(self):
        self.pool.abort()


# ---- the reference: torch.distributed (NCCL on GPUs, gloo on CPU) ------------------------------------------------

def reference_all_reduce_sum(t: torch.Tensor, group=None) -> torch.Tensor:
    """torch.distributed.all_reduce on a copy (the library's own order of summation)."""
    import torch.distributed as dist
    out = t.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def reference_all_gather(t: torch.Tensor, group=None) -> torch.Tensor:
    """torch.distributed.all_gather_into_tensor -> [N, ...] in rank order."""
    import torch.distributed as dist
    n = dist.get_world_size(group)
    out = torch.empty((n, *t.shape), dtype=t.dtype, device=t.device)
    if t.device.type == "cuda":
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    else:                                    # gloo has no all_gather_into_tensor
        dist.all_gather(list(out.unbind(0)), t.contiguous(), group=group)
    return out

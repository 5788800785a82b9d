"""Symmetric buffers: the one abstraction KCCL's algorithms are written against (kccl/collectives.py).

Every rank owns the same layout; a peer may write into it ("put") and bump one of its signal words:
- data:    [2, world, capacity_bytes] uint8. Half `parity` (epoch % 2), row `src`: where rank `src` puts its
           slice. Two halves because a fast peer may already put epoch e+1 while we still read epoch e; it cannot
           reach e+2 (which reuses our half) before we signal e+1, which we do only after reading e.
- signals: [world] int64. Word `src` is written only by rank `src` (+1 per epoch; a rank signals itself too), so
           no atomics are needed and the word only grows: a wait for epoch e is `signals[src] >= e`, never a reset.
- abort:   one shared word; any rank may set it to make every wait raise at once (a dead rank never hangs the
           others).

Backends of this abstraction:
- HostHeap (here): CPU memory, for ranks as threads (plain tensors) or as processes (one file in /dev/shm mapped by
  every rank with torch.from_file(shared=True)). x86 keeps stores in program order (TSO), and a put is a completed
  torch copy before the signal's store, so data always lands before the signal a reader polls.
- GpuHeap (kccl/symm_gpu.py): torch symmetric memory + the Triton put / signal / wait of kccl/sync.py.
"""
from __future__ import annotations

import os
import time
import uuid

import torch


class KcclError(RuntimeError):
    """A collective failed: a peer never signalled (watchdog), or someone aborted."""


class KcclTimeout(KcclError):
    pass


class KcclAborted(KcclError):
    pass


def _layout(world: int, capacity: int) -> tuple[int, int, int]:
    """-> (data bytes, signal bytes, total bytes) of one HostPool (every rank's region in one block)."""
    if capacity % 8:
        raise ValueError(f"capacity_bytes must be a multiple of 8, got {capacity}")
    data = world * 2 * world * capacity
    sig = world * world * 8 + 8                      # [world owners, world sources] + the abort word
    return data, sig, data + sig


class HostPool:
    """Every rank's symmetric region in one block of CPU memory. `path`: a file (e.g. /dev/shm/kccl-*) mapped
    shared, so processes on one host see one another's stores; None: private memory for ranks as threads."""

    def __init__(self, world: int, capacity_bytes: int = 1 << 16, path: str | None = None, create: bool = True):
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.world, self.capacity, self.path = world, capacity_bytes, path
        nd, ns, total = _layout(world, capacity_bytes)
        if path is None:
            mem = torch.zeros(total, dtype=torch.uint8)
        else:
            if create:
                with open(path, "wb") as f:           # zero-filled: every signal word starts at epoch 0
                    f.truncate(total)
            elif os.path.getsize(path) != total:
                raise KcclError(f"{path}: {os.path.getsize(path)} bytes, expected {total} for world={world}, "
                                f"capacity_bytes={capacity_bytes} (ranks disagree on the pool layout)")
            mem = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self.data = mem[:nd].view(world, 2, world, capacity_bytes)           # [owner, parity, src, bytes]
        words = mem[nd:].view(torch.int64)
        self.signals = words[:world * world].view(world, world)             # [owner, src]
        self.abort_word = words[world * world:]                              # [1]

    @staticmethod
    def shm_path() -> str:
        return f"/dev/shm/kccl-{uuid.uuid4().hex}"

    def handle(self, rank: int, timeout: float = 60.0) -> "HostHeap":
        return HostHeap(self, rank, timeout)

    def abort(self):
        self.abort_word.fill_(1)


class HostHeap:
    """Rank `rank`'s view of a HostPool: put / signal into peers, wait on its own signal words."""

    def __init__(self, pool: HostPool, rank: int, timeout: float = 60.0):
        if not 0 <= rank < pool.world:
            raise ValueError(f"rank {rank} outside world {pool.world}")
        self.pool, self.rank, self.world = pool, rank, pool.world
        self.capacity, self.timeout = pool.capacity, timeout
        self.epoch = 0                                # last epoch this rank started; grows forever

    def slot(self, parity: int, src: int, nbytes: int, owner: int | None = None) -> torch.Tensor:
        """[nbytes] uint8 view of row `src` in `owner`'s (default: own) half `parity`."""
        return self.pool.data[self.rank if owner is None else owner, parity, src, :nbytes]

    def put(self, peer: int, parity: int, src: torch.Tensor):
        """Copy this rank's contiguous payload into row self.rank of peer's half `parity`."""
        b = src.reshape(-1).view(torch.uint8)
        self.slot(parity, self.rank, b.numel(), owner=peer).copy_(b)

    def signal(self, peer: int):
        """peer.signals[self.rank] += 1 (single writer: a plain read-modify-write is enough)."""
        self.pool.signals[peer, self.rank] += 1

    def wait(self, target: int):
        """Until every word in our signals (ours included: we put into our own row too) reached `target` (the
        epoch). Bounded by self.timeout."""
        sig = self.pool.signals[self.rank]
        peers = list(range(self.world))
        deadline, spins = time.monotonic() + self.timeout, 0
        while True:
            missing = [q for q in peers if int(sig[q]) < target]
            if not missing:
                return
            if int(self.pool.abort_word[0]):
                raise KcclAborted(f"rank {self.rank}: aborted while waiting for epoch {target} from ranks {missing}")
            if time.monotonic() > deadline:
                raise KcclTimeout(f"rank {self.rank}: no signal for epoch {target} from ranks {missing} after "
                                  f"{self.timeout:g} s (their words: {[int(sig[q]) for q in missing]})")
            spins += 1
            time.sleep(0 if spins < 50 else 5e-5)    # yield first (threads share the GIL), then back off

    def abort(self):
        self.pool.abort()

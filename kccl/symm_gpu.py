"""GpuHeap: the symmetric-buffer abstraction of kccl/symm.py on GPUs, so kccl/collectives.py's algorithm runs
unchanged across devices.

Memory: one `torch.distributed._symmetric_memory` allocation per rank, [2, world, capacity_bytes] uint8 (the same
halves / rows as HostHeap), rendezvoused over the process group; `get_buffer(q, ...)` is a tensor on this GPU that
aliases rank q's allocation (NVLink peer mapping), and `get_signal_pad(q, ...)` rank q's signal pad, of which we use
words [0, world) as int32 counters. NVLink multicast stays off: no multimem / multicast API is ever called, and
none of symm_mem's own collectives (they also use the signal pad) -- the words here only grow.

Kernels (Triton, on kccl/sync.py, so the waits are bounded by the same watchdog as the monokernel):
- `_put_signal`: P programs grid-stride copy the payload into the peer's row, then each program signals the
  peer's word (release, system scope). A peer's word therefore grows by P per epoch: the wait target is epoch * P.
- `_wait_all`: one program polls each peer's word (acquire, system scope) until epoch * P, or the deadline or abort
  word; it writes (worst status, first silent peer) to an error pair that the host checks before reading rows.
The fixed-order reduce of the rows is plain torch on the same stream, after the wait kernel.

`GpuHeap.from_tensors` builds the same object over caller-provided tensors: on CPU under TRITON_INTERPRET=1 the
kernels run through the interpreter (tests/kccl: loopback N=1 and two ranks interleaved in one thread).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .symm import KcclAborted, KcclTimeout
from .sync import WAIT_ABORTED, WAIT_OK, signal, wait

PROGRAMS = 8          # programs per put: each signals once, so every peer word grows by PROGRAMS per epoch
BLOCK = 1024


@triton.jit
def _put_signal(src_ptr, dst_ptr, n, sig_ptr, BLOCK: tl.constexpr, USE_ASM: tl.constexpr):
    """dst[:n] = src[:n] (dst: a peer's row), then the peer's signal word += 1 per program (release, sys)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m), mask=m)
    signal(sig_ptr, 1, USE_ASM, SYS=True)


@triton.jit
def _wait_all(sig_ptr, world, me, target, abort_ptr, err_ptr, timeout_ns, USE_ASM: tl.constexpr,
              NT: tl.constexpr):
    """Wait until sig[q] >= target for every q != me; err[0] = worst status, err[1] = first failing peer (-1)."""
    worst = me * 0
    bad = me * 0 - 1
    for q in range(0, world):
        if q != me:
            st = wait(sig_ptr + q, target, abort_ptr, timeout_ns, USE_ASM, True, NT)
            bad = tl.where((st != 0) & (bad < 0), q, bad)
            worst = tl.maximum(worst, st)
    tl.store(err_ptr, worst)
    tl.store(err_ptr + 1, bad)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class GpuHeap:
    """Rank `rank`'s handle: same contract as HostHeap (capacity, epoch, put, signal, wait, slot, abort)."""

    def __init__(self, rank: int, world: int, local: torch.Tensor, peer_data: list, peer_sig: list,
                 own_sig: torch.Tensor, timeout_s: float = 10.0, programs: int = PROGRAMS, keepalive=None):
        """local [2, world, cap] uint8 (own region), peer_data[q] / peer_sig[q] views of rank q's region and
        signal words ([world] int32), own_sig = peer_sig[rank]."""
        self.rank, self.world, self.capacity = rank, world, local.shape[-1]
        self.local, self.peer_data, self.peer_sig, self.own_sig = local, peer_data, peer_sig, own_sig
        self.timeout_s, self.programs, self.epoch = timeout_s, programs, 0
        dev = local.device
        self.use_asm = dev.type == "cuda" and not _interpreting()
        self.abort_word = torch.zeros(1, dtype=torch.int32, device=dev)
        self.err = torch.zeros(2, dtype=torch.int32, device=dev)
        self._keepalive = keepalive                      # the symmetric allocation the views alias

    @classmethod
    def rendezvous(cls, group=None, capacity_bytes: int = 1 << 20, timeout_s: float = 10.0) -> "GpuHeap":
        """Collective over `group` (default: the world): allocate and map every rank's region. GPU only."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        group = group or dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        dev = torch.device("cuda", torch.cuda.current_device())
        buf = symm_mem.empty(2 * world * capacity_bytes, dtype=torch.uint8, device=dev)
        hdl = symm_mem.rendezvous(buf, group)
        shape = (2, world, capacity_bytes)
        data = [hdl.get_buffer(q, shape, torch.uint8) for q in range(world)]
        sig = [hdl.get_signal_pad(q, (world,), dtype=torch.int32) for q in range(world)]
        sig[rank].zero_()                                # our words start at epoch 0 ...
        dist.barrier(group)                              # ... before any peer may bump them
        return cls(rank, world, data[rank], data, sig, sig[rank], timeout_s, keepalive=(buf, hdl))

    @classmethod
    def from_tensors(cls, world: int, capacity_bytes: int, device="cpu", **kw) -> list["GpuHeap"]:
        """All `world` ranks' handles over plain tensors of one device (tests; N=1 loopback on one GPU)."""
        data = [torch.zeros(2, world, capacity_bytes, dtype=torch.uint8, device=device) for _ in range(world)]
        sig = [torch.zeros(world, dtype=torch.int32, device=device) for _ in range(world)]
        return [cls(r, world, data[r], data, sig, sig[r], **kw) for r in range(world)]

    # ---- the abstraction ----------------------------------------------------------------------------------
    def slot(self, parity: int, src: int, nbytes: int, owner: int | None = None) -> torch.Tensor:
        d = self.local if owner is None or owner == self.rank else self.peer_data[owner]
        return d[parity, src, :nbytes]

    def put(self, peer: int, parity: int, src: torch.Tensor):
        """Copy into row self.rank of peer's half `parity`; the signal is fused into the same kernel, so put()
        only records the peer and signal() launches (the pair is always called together by the algorithm)."""
        self._pending = (peer, parity, src)

    def signal(self, peer: int):
        p, parity, src = self._pending
        assert p == peer, "signal() must follow put() to the same peer"
        b = src.reshape(-1).view(torch.uint8)
        word = b.numel() % 4 == 0                        # copy 32-bit words when the size allows
        s = b.view(torch.int32) if word else b
        d = self.slot(parity, self.rank, b.numel(), owner=peer)
        d = d.view(torch.int32) if word else d
        _put_signal[(self.programs,)](s, d, s.numel(), self.peer_sig[peer][self.rank:], BLOCK=BLOCK,
                                      USE_ASM=self.use_asm)

    def wait(self, target: int):
        """Block until every peer finished its put of epoch `target` (their word == target * programs)."""
        if self.world == 1:
            return
        _wait_all[(1,)](self.own_sig, self.world, self.rank, target * self.programs, self.abort_word, self.err,
                        int(self.timeout_s * 1e9), USE_ASM=self.use_asm, NT=32, num_warps=1)
        status, peer = (int(v) for v in self.err.tolist())   # a host sync: the watchdog's verdict
        if status == WAIT_OK:
            return
        words = [int(v) for v in self.own_sig.tolist()]
        if status == WAIT_ABORTED:
            raise KcclAborted(f"rank {self.rank}: aborted while waiting for epoch {target} (peer {peer})")
        raise KcclTimeout(f"rank {self.rank}: no signal for epoch {target} from rank {peer} "
                          f"(needs {target * self.programs}, signal words {words}; watchdog {self.timeout_s:g} s)")

    def abort(self):
        self.abort_word.fill_(1)

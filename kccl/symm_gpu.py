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
- `_wait_all`: one program polls every rank's word (its own too: collectives.py puts into the own row as well, so
  N = 1 runs put / signal / wait like N ranks) with acquire loads at system scope until epoch * P, or the deadline
  or abort word; it writes (worst status, first silent rank) to an error pair in pinned host memory. The host polls
  the launch's event with its own deadline (watchdog + HOST_GRACE_S) and then sets the (pinned, mapped) abort
  word, so even a device-side timer that never fires cannot hang the host.
The fixed-order reduce of the rows is plain torch on the same stream, after the wait kernel.

`GpuHeap.from_tensors` builds the same object over caller-provided tensors: on CPU under TRITON_INTERPRET=1 the
kernels run through the interpreter (tests/kccl: loopback N=1 and two ranks interleaved in one thread).
"""
from __future__ import annotations

import os
import time

import torch
import triton
import triton.language as tl

from .symm import KcclAborted, KcclError, KcclTimeout
from .sync import WAIT_ABORTED, WAIT_OK, signal, wait

PROGRAMS = 8          # programs per put: each signals once, so every peer word grows by PROGRAMS per epoch
BLOCK = 1024
HOST_GRACE_S = 2.0   # host deadline = device watchdog + this (then the host sets the abort word)


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


@triton.jit(do_not_specialize=["world", "target", "timeout_ns"])
def _wait_all(sig_ptr, world, target, abort_ptr, err_ptr, timeout_ns, USE_ASM: tl.constexpr, NT: tl.constexpr):
    """Wait until sig[q] >= target for every q in [0, world) (our own word too: a rank puts into its own row);
    err[0] = worst status, err[1] = first failing rank (-1). `world` and `target` are never specialised (the
    launch passes do_not_specialize), so one compiled variant serves every rank and epoch."""
    worst = target * 0
    bad = target * 0 - 1
    for q in range(0, world):
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
        # abort word and verdict in pinned host memory on the GPU (mapped: the kernel reads / writes them through
        # UVA), so the host can stop a wait kernel that is still spinning and read the verdict without a copy
        pin = dev.type == "cuda"
        self.abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self.err = torch.zeros(2, dtype=torch.int32, pin_memory=pin)
        self._keepalive = keepalive                      # the symmetric allocation the views alias

    @classmethod
    def rendezvous(cls, group=None, capacity_bytes: int = 1 << 20, timeout_s: float = 10.0) -> "GpuHeap":
        """Collective over `group` (default: the world): allocate and map every rank's region. GPU only."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        if not dist.is_initialized():
            raise KcclError("GpuHeap.rendezvous needs an initialised torch.distributed process group, even for one "
                            "rank (kie_moe.launch.init_process_group, or init_process_group(world_size=1))")
        group = group or dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        # older torch needs this call; newer torch registers every group itself and deprecates it (its cache
        # would hand a group re-created under the same name the destroyed group's store)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not hasattr(enable, "__deprecated__"):
            enable(group.group_name)
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
        """Block until every rank (ourselves included) finished its put of epoch `target` (their word ==
        target * programs). Bounded twice: the kernel's own watchdog (timeout_s, %globaltimer), and a host deadline
        a little later that sets the abort word (which the spinning kernel polls) if the kernel has not returned,
        so a broken device-side timer can never hang the host either."""
        self.err.fill_(-7)                                   # "kernel never wrote its verdict"
        _wait_all[(1,)](self.own_sig, self.world, target * self.programs, self.abort_word, self.err,
                        int(self.timeout_s * 1e9), USE_ASM=self.use_asm, NT=32, num_warps=1)
        host_abort = False
        if self.local.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            deadline = time.monotonic() + self.timeout_s + HOST_GRACE_S
            while not ev.query():
                if not host_abort and time.monotonic() > deadline:
                    self.abort_word.fill_(1)                 # pinned: visible to the spinning kernel
                    host_abort, deadline = True, time.monotonic() + HOST_GRACE_S
                elif host_abort and time.monotonic() > deadline:
                    raise KcclTimeout(
                        f"rank {self.rank}: the wait kernel for epoch {target} ignored both its {self.timeout_s:g} s "
                        f"watchdog and the host abort word for {HOST_GRACE_S:g} s more: the GPU is stuck in it; "
                        f"restart the process")
                time.sleep(20e-6)
        status, peer = (int(v) for v in self.err.tolist())
        if status == WAIT_OK and not host_abort:
            return
        words = [int(v) for v in self.own_sig.tolist()]
        need = target * self.programs
        if host_abort:
            self.abort_word.fill_(0)
            raise KcclTimeout(f"rank {self.rank}: the device watchdog did not fire within {self.timeout_s:g} s "
                              f"(+{HOST_GRACE_S:g} s grace) waiting for epoch {target} (needs {need}, signal words "
                              f"{words}); the host aborted the wait kernel (verdict {status}, rank {peer})")
        if status == -7:
            raise KcclTimeout(f"rank {self.rank}: the wait kernel for epoch {target} returned without a verdict")
        if status == WAIT_ABORTED:
            raise KcclAborted(f"rank {self.rank}: aborted while waiting for epoch {target} (rank {peer})")
        raise KcclTimeout(f"rank {self.rank}: no signal for epoch {target} from rank {peer} "
                          f"(needs {need}, signal words {words}; watchdog {self.timeout_s:g} s)")

    def abort(self):
        self.abort_word.fill_(1)

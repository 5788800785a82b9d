"""What a `kie ... --devices N` worker runs once kie_moe/launch.py has started it: N ranks, one voice.

Every rank joins the group (`Group.open`: torch.distributed on 127.0.0.1 -- NCCL between GPUs, gloo between CPU
processes -- plus a gloo control group), loads the model and builds its rank-local backend (`rank_backend`, a
collective: every rank makes the same calls in the same order). Then
- rank 0 runs the command's single-device code unchanged (prints the table, serves HTTP) with `Leader(backend)` as
  its backend: each generate call is first broadcast to the other ranks, with a concrete seed;
- ranks 1..N-1 `follow`: they take rank 0's calls and make the same call on their shard, until rank 0 says stop.
So all ranks decode in lockstep and only rank 0 talks to the user (launch.py drops the others' stdout).

Rank-local backends (the engine's backend contract: `name`, `generate(prompt_ids, params, eos_ids)`; plus `world`,
`device`, `path`, a sentence saying what runs, and `working_dtypes()`):
- monokernel-tp (GPUs only): kernels/monokernel/shard.TpRank, the tensor-parallel monokernel; its partial sums
  move inside the kernel (KCCL puts and waits over torch symmetric memory). Every rank runs whole launches.
- tp-reference+kccl: kccl/tp_sim.TpRankDecoder, the torch reference decoder split tensor + expert parallel; its
  all-reduces / all-gathers are KCCL's one-shot algorithms over GpuHeap (GPUs) or over a HostHeap in one shared
  /dev/shm file (CPU processes).
- dtp-reference+kccl: the Laneformer's DTP lane ranks (dense/simulate.RankDecoder), partials through KCCL the same
  way.
The reference ranks are step-synchronous: rank 0 samples each token from the (all-gathered, identical) logits and
broadcasts it with a flag that says whether its consumer asked for the next one, so a request that rank 0 stops
early (a stop string, a client that left) ends on every rank at the same step.

What cannot run, and says so before any worker starts (`check_backend`): the tensor-parallel monokernel needs CUDA
GPUs (torch symmetric memory, peers mapped over NVLink); the graph backend has no multi-device path. A model the
monokernel's planner refuses (NotImplementedError) is an error with --backend monokernel and runs on the reference
ranks with --backend auto (the `path` says why). A failure on one rank fails the launch (launch.py stops the others).
"""
from __future__ import annotations

import dataclasses
import os
import signal
import tempfile
import threading
import uuid
from datetime import timedelta
from typing import Callable, Iterator

import torch

from kie_moe.models.errors import InputError, KieError

# control waits (a follower waiting for rank 0's next call) are not bounded by the usual 30 minutes: an idle
# server's followers wait for the next request that long. A rank that dies closes its sockets, which ends them.
CONTROL_TIMEOUT = timedelta(days=365)
HEAP_BYTES = 1 << 20           # per-slot capacity of the KCCL heap of the reference ranks (larger messages: chunks)
HOST_HEAP_BYTES = 1 << 18      # the same between CPU processes: 2 x N^2 slots in /dev/shm (docker's default is 64 MB)
HEAP_TIMEOUT_S = 60.0          # KCCL watchdog of the reference ranks


# ---- the group --------------------------------------------------------------------------------------------------

class Group:
    """This process's place in the launch: rank, world, its device, and the gloo control group rank 0 speaks on."""

    def __init__(self, env, device: torch.device, ctl):
        self.env, self.device, self.ctl = env, device, ctl
        self.rank, self.world = env.rank, env.world

    @classmethod
    def open(cls, env, device: str | None) -> "Group":
        import torch.distributed as dist

        from kie_moe.engine import resolve_device
        from kie_moe.launch import cpu_cores, init_process_group
        dev = resolve_device(device)
        if dev.type == "cuda":
            init_process_group(env, "nccl")               # binds GPU local_rank
            dev = torch.device("cuda", env.local_rank)
        else:
            init_process_group(env, "gloo")
            # N processes on one CPU: split the cores (OpenMP spin-waits of oversubscribed threads cost 10-60x)
            torch.set_num_threads(max(1, cpu_cores() // env.world))
        ctl = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        return cls(env, dev, ctl)

    @property
    def unit(self) -> str:
        one, many = ("GPU", "GPUs") if self.device.type == "cuda" else ("CPU process", "CPU processes")
        return f"{self.world} {one if self.world == 1 else many}"

    def bcast_obj(self, obj=None):
        """rank 0's `obj` on every rank (pickled, over the control group)."""
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.ctl)
        return box[0]

    post = bcast_obj            # rank 0: send a call
    take = bcast_obj            # the others: receive it (blocks until rank 0 sends one)

    def bcast_ints(self, vals: list[int]) -> list[int]:
        import torch.distributed as dist
        t = torch.tensor(vals, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.ctl)
        return [int(v) for v in t]

    def barrier(self):
        import torch.distributed as dist
        dist.barrier(group=self.ctl)

    def close(self):
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- rank-local backends ----------------------------------------------------------------------------------------

def check_backend(kind: str, backend: str) -> str:
    """-> "monokernel" or "reference": the multi-device path of --backend `backend` on `kind` ("cpu" | "cuda")
    devices; a one-line InputError where there is none."""
    if backend == "auto":
        return "monokernel" if kind == "cuda" else "reference"
    if backend == "monokernel":
        if kind != "cuda":
            raise InputError("--backend monokernel on CPU: the tensor-parallel monokernel needs CUDA GPUs (its ranks "
                             "share torch symmetric memory, peers mapped over NVLink); on CPU, --devices N --backend "
                             "reference runs N processes")
        return "monokernel"
    if backend == "reference":
        return "reference"
    raise InputError(f"--devices N: the {backend} backend has no multi-device path (monokernel on GPUs, reference "
                     f"on GPUs or CPU)")


def rank_backend(model, group: Group, backend: str = "auto", dtype: torch.dtype | None = None,
                 expert_split: str | None = None):
    """This rank's backend for `model` (collective: call on every rank with the same arguments). `dtype`: the
    weights' working dtype (default: the backend's own -- bf16 on GPUs, fp32 for the reference on CPU). --backend
    auto on GPUs: the monokernel, or the reference ranks where its planner refuses the model (NotImplementedError,
    raised alike on every rank before any collective); the backend's `path` says which and why. expert_split:
    tp / ep / auto|None for the monokernel's MoE layers (shard.expert_split)."""
    path = check_backend(group.device.type, backend)
    why = ""
    if path == "monokernel":
        try:
            return MonokernelRank(model, group, dtype, expert_split)
        except NotImplementedError as e:
            if backend != "auto":
                raise
            why = f" (--backend auto: the tensor-parallel monokernel refused this model: {e})"
    heap = _heap(group)
    from kie_moe.kccl.collectives import KcclCollective
    coll = KcclCollective(heap)
    where = ("KCCL GpuHeap (torch symmetric memory)" if group.device.type == "cuda"
             else "KCCL HostHeap (one shared /dev/shm file)")
    if model.spec.family == "laneformer":
        from kie_moe.dense.lanes import lane_plan
        from kie_moe.dense.simulate import RankDecoder
        plan = lane_plan(model.spec, group.world).devices[group.rank]
        dt = dtype or (torch.float32 if group.device.type == "cpu" else torch.bfloat16)
        dec = RankDecoder(model.spec, model.weights, plan, coll, dtype=dt, device=group.device)
        return StepRank(dec, group, "dtp-reference+kccl", dt,
                        f"Laneformer DTP lane ranks (torch reference) on {group.unit}, {len(plan.lanes)} of "
                        f"{model.spec.num_lanes} lanes each, partials through {where}; rank 0 samples" + why)
    from kie_moe.kccl.tp_sim import TpRankDecoder
    dec = TpRankDecoder(model.spec, model.weights, group.rank, group.world, coll, device=group.device, dtype=dtype)
    return StepRank(dec, group, "tp-reference+kccl", dec.dtype,
                    f"torch reference decoder, tensor + expert parallel on {group.unit}, partial sums through "
                    f"{where}; rank 0 samples" + why)


def _heap(group: Group):
    """This rank's KCCL heap: GpuHeap over torch symmetric memory, or a HostHeap in one file every CPU process maps
    (rank 0 creates it zeroed, the others map it, then it is unlinked: the mappings outlive the name)."""
    if group.device.type == "cuda":
        from kie_moe.kccl.symm_gpu import GpuHeap
        return GpuHeap.rendezvous(capacity_bytes=HEAP_BYTES, timeout_s=HEAP_TIMEOUT_S)
    from kie_moe.kccl.symm import HostPool, _layout
    path = pool = None
    if group.rank == 0:
        need = _layout(group.world, HOST_HEAP_BYTES)[2]
        d = next((d for d in ("/dev/shm", tempfile.gettempdir()) if _free_bytes(d) > 2 * need), None)
        if d is None:
            raise InputError(f"--devices {group.world} --device cpu: no room for the {need >> 20} MB KCCL heap in "
                             f"/dev/shm or {tempfile.gettempdir()}")
        path = os.path.join(d, f"kccl-{uuid.uuid4().hex}")
        pool = HostPool(group.world, HOST_HEAP_BYTES, path, create=True)
    path = group.bcast_obj(path)
    try:
        if group.rank != 0:
            pool = HostPool(group.world, HOST_HEAP_BYTES, path, create=False)
        group.barrier()                                   # every rank has mapped it
    finally:
        if group.rank == 0:
            try:
                os.unlink(path)
            except OSError:
                pass
    return pool.handle(group.rank, HEAP_TIMEOUT_S)


def _free_bytes(d: str) -> int:
    try:
        st = os.statvfs(d)
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


class MonokernelRank:
    """kernels/monokernel/shard.TpRank behind the rank-backend contract (GPUs only)."""
    name = "monokernel-tp"

    def __init__(self, model, group: Group, dtype: torch.dtype | None = None, expert_split: str | None = None):
        from kie_moe.kernels.monokernel.shard import TpRank
        self.tp = TpRank(model, expert_split=expert_split, **({"wdtype": dtype} if dtype is not None else {}))
        self.world, self.device = group.world, group.device
        self.path = (f"tensor-parallel monokernel on {group.unit}: partial sums through in-kernel KCCL puts / waits "
                     f"over torch symmetric memory")

    def working_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        be = self.tp.be
        return be.plan.wdtype, getattr(be, "kv_dtype", be.plan.wdtype)

    def generate(self, prompt_ids: list[int], p, eos_ids) -> Iterator[int]:
        return self.tp.generate(prompt_ids, p, eos_ids)


class StepRank:
    """A reference decoder's rank: forward() on this rank's shard (its collectives inside), rank 0 samples, every
    rank takes rank 0's token and its "go on" flag over the control group -- one broadcast per token."""

    def __init__(self, decoder, group: Group, name: str, dtype: torch.dtype, path: str):
        self.decoder, self.group, self.name, self.dtype, self.path = decoder, group, name, dtype, path
        self.world, self.device = group.world, group.device

    def working_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return self.dtype, self.dtype

    def generate(self, prompt_ids: list[int], p, eos_ids) -> Iterator[int]:
        from kie_moe.sampling import sample
        lead = self.group.rank == 0
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        self.decoder.reset()
        logits = self.decoder.forward(torch.tensor(prompt_ids, dtype=torch.long))[-1]
        for n in range(p.max_new_tokens):
            if lead:
                tid = sample(logits, p, gen)
                try:
                    yield tid
                except GeneratorExit:                    # the consumer stopped: every rank stops here too
                    self.group.bcast_ints([tid, 0])
                    raise
                tid, go = self.group.bcast_ints([tid, 1])
            else:
                tid, go = self.group.bcast_ints([0, 0])
                yield tid
            if not go or (tid in eos_ids and not p.ignore_eos) or n + 1 == p.max_new_tokens:
                return
            logits = self.decoder.forward(torch.tensor([tid], dtype=torch.long))[-1]


# ---- lockstep ---------------------------------------------------------------------------------------------------

class Leader:
    """Rank 0's backend: each generate call goes to every other rank first (with a concrete seed, so sampling
    kernels draw the same numbers on every rank), then runs on rank 0's shard. Other attributes are the local
    backend's."""

    def __init__(self, local, group: Group):
        self.local, self.group, self.name = local, group, local.name
        self.busy = self.stopped = False

    def __getattr__(self, k):
        return getattr(self.local, k)

    def stop(self):
        """Tell the other ranks to finish (once). Not mid-generation: they wait on a token then, not on a call
        (they fail instead when rank 0 exits, and launch.py stops them)."""
        if not self.stopped and not self.busy:
            self.stopped = True
            self.group.post(("stop",))

    def generate(self, prompt_ids: list[int], p, eos_ids) -> Iterator[int]:
        if p.seed is None:
            p = dataclasses.replace(p, seed=int(torch.randint(0, 2 ** 31 - 1, (1,))))
        ids, eos = [int(t) for t in prompt_ids], sorted(int(t) for t in eos_ids)
        self.group.post(("generate", ids, p, eos))
        self.busy = True
        try:
            yield from self.local.generate(ids, p, set(eos))
        finally:
            self.busy = False


def follow(local, group: Group):
    """Ranks 1..N-1: make rank 0's calls on this rank's shard until it says stop. A user error (KieError) is raised
    by every rank alike before any collective, so it ends only that call; anything else ends the process."""
    while True:
        cmd = group.take()
        if cmd[0] == "stop":
            return
        if cmd[0] != "generate":
            raise RuntimeError(f"rank {group.rank}: unknown call {cmd[0]!r} from rank 0")
        _, ids, p, eos = cmd
        try:
            for _ in local.generate(ids, p, set(eos)):
                pass
        except KieError:
            continue


def run_ranks(env, device: str | None, prepare: Callable, lead: Callable) -> int:
    """A worker's whole life: join the group; prepare(group) -> (context, rank-local backend) on every rank; then
    rank 0 returns lead(context, Leader(backend)) while the others follow it."""
    group = Group.open(env, device)
    try:
        ctx, local = prepare(group)
        if group.rank != 0:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C reaches rank 0 / the launcher
            follow(local, group)
            return 0
        leader = Leader(local, group)
        try:
            return lead(ctx, leader)
        finally:
            leader.stop()
    finally:
        group.close()


def launch_ranks(a, single: Callable[[], int], prepare: Callable, lead: Callable, *, check: bool = True) -> int:
    """`kie CMD --devices N` for a subcommand: one device -> single(); N (or KIE_LAUNCH_WORKERS=1) -> N workers
    that run_ranks(prepare, lead). With `check`, --backend is checked against the devices before any worker
    starts."""
    from kie_moe.launch import check_devices, device_kind, launch, workers_forced
    n = getattr(a, "devices", 1)
    device = getattr(a, "device", None)
    if n > 1 or workers_forced():
        check_devices(n, device=device)
        if check:
            check_backend(device_kind(device), getattr(a, "backend", "auto"))
    return launch(n, getattr(a, "argv", []),
                  lambda env: run_ranks(env, device, prepare, lead) if env.is_worker else single(), device=device)

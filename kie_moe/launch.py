"""`--devices N`: run a `kie` subcommand on N GPUs as N worker processes, torchrun-style.

The parent checks that N GPUs are visible (else one-line InputError -> exit 2, nothing started), picks a free TCP
port on 127.0.0.1 (the rendezvous never leaves this host), and starts `python -m kie_moe.cli <same argv>` N times
with RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT set and KIE_WORKER=1 (so a
worker does not launch again). Only rank 0 writes to stdout; the others' stdout is dropped, stderr is kept. If a
worker fails, the others are terminated and the first failing exit code is returned.

N = 1 runs in-process through the same `run(...)` entry with a world of one (no subprocess, no port), so the
single-device path is the N-device path with WORLD_SIZE=1.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

from kie_moe.models.errors import InputError

MASTER_ADDR = "127.0.0.1"        # never any other address: workers rendezvous on this host only


@dataclass(frozen=True)
class WorkerEnv:
    """What a process knows about its place in the launch (N = 1 in-process: rank 0 of 1)."""
    rank: int = 0
    local_rank: int = 0
    world: int = 1
    master_addr: str = MASTER_ADDR
    master_port: int = 0

    @property
    def is_worker(self) -> bool:
        return self.world > 1


def worker_env() -> WorkerEnv:
    """The launch environment of this process (a plain process: rank 0 of 1)."""
    if os.environ.get("KIE_WORKER") != "1":
        return WorkerEnv()
    try:
        return WorkerEnv(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]),
                         os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    except (KeyError, ValueError) as e:
        raise InputError(f"KIE_WORKER=1 but the launch environment is incomplete ({e!r}): start workers with "
                         f"kie ... --devices N, not by hand") from None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((MASTER_ADDR, 0))
        return s.getsockname()[1]


def visible_gpus() -> int:
    try:
        import torch
        return torch.cuda.device_count()
    except Exception:                                   # a broken driver counts as no GPU, not a traceback
        return 0


def check_devices(n: int, have: int | None = None) -> None:
    """Raise InputError (one line) unless `n` >= 1 and n GPUs are visible (n = 1 needs none: CPU runs too)."""
    if not isinstance(n, int) or n < 1:
        raise InputError(f"--devices must be at least 1, got {n}")
    if n == 1:
        return
    have = visible_gpus() if have is None else have
    if have < n:
        raise InputError(f"--devices {n}: only {have} GPU{'s' if have != 1 else ''} visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); nothing was run")


def worker_environ(rank: int, world: int, port: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR=MASTER_ADDR, MASTER_PORT=str(port), KIE_WORKER="1")
    return env


def launch(n: int, argv: list[str], run_local: Callable[[WorkerEnv], int], *, have: int | None = None,
           python: str = sys.executable, module: str = "kie_moe.cli", poll_s: float = 0.05,
           timeout_s: float | None = None) -> int:
    """Run `kie argv` on n devices. n = 1 (or already inside a worker): run_local(worker_env()) in this process.
    Else n workers `python -m module argv`; returns 0 when all exit 0, else the first non-zero exit code."""
    if os.environ.get("KIE_WORKER") == "1":
        return run_local(worker_env())
    check_devices(n, have)
    if n == 1:
        return run_local(WorkerEnv())
    port = free_port()
    procs = []
    for r in range(n):
        out = None if r == 0 else subprocess.DEVNULL      # rank 0 speaks for the group
        procs.append(subprocess.Popen([python, "-m", module, *argv], env=worker_environ(r, n, port), stdout=out))
    t0, failed = time.monotonic(), None
    try:
        while any(p.poll() is None for p in procs):
            bad = [p for p in procs if p.poll() not in (None, 0)]
            if bad:
                failed = bad[0].returncode
                break
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                print(f"kie: --devices {n}: workers still running after {timeout_s:g} s; stopping them",
                      file=sys.stderr)
                failed = 124
                break
            time.sleep(poll_s)
    finally:
        for p in procs:                                  # only the workers this call started, by handle
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if failed is None:
        failed = next((p.returncode for p in procs if p.returncode != 0), 0)
    return failed


def init_process_group(env: WorkerEnv, backend: str = "nccl"):
    """In a worker: join the group of the launch (127.0.0.1:MASTER_PORT) and bind this rank's GPU."""
    import torch
    import torch.distributed as dist
    if env.master_addr != MASTER_ADDR:
        raise InputError(f"MASTER_ADDR={env.master_addr}: workers rendezvous on {MASTER_ADDR} only")
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(backend, init_method=f"tcp://{MASTER_ADDR}:{env.master_port}", rank=env.rank,
                            world_size=env.world)


def generate_worker(a, env: WorkerEnv) -> int:
    """One rank of `kie generate --devices N` on GPU `local_rank`. Default (--backend auto | monokernel): the
    tensor-parallel monokernel (kernels/monokernel/shard.TpRank: in-kernel KCCL puts / waits over torch symmetric
    memory). --backend reference: the torch tensor + expert parallel reference (kccl/tp_sim.TpRankDecoder,
    all-reduces through KCCL's GpuHeap; greedy only). Rank 0 prints the result like the single-device path."""
    import json

    import torch

    from kie_moe.kccl.collectives import KcclCollective
    from kie_moe.kccl.symm_gpu import GpuHeap
    from kie_moe.kccl.tp_sim import TpRankDecoder
    from kie_moe.models.registry import load_model

    init_process_group(env, "nccl")
    import torch.distributed as dist
    try:
        m = load_model(a.model)
        if a.prompt_ids is not None:
            ids = [int(x) for x in a.prompt_ids.replace(" ", "").split(",") if x]
        else:
            from kie_moe.tokenizer import Tokenizer, has_tokenizer
            if not has_tokenizer(a.model):
                raise InputError(f"{a.model}: --prompt needs the model's tokenizer files (or use --prompt-ids)")
            ids = Tokenizer(a.model).encode(a.prompt)
        dev = torch.device("cuda", env.local_rank)
        if a.backend in ("auto", "monokernel"):
            from kie_moe.kernels.monokernel.shard import TpRank
            from kie_moe.sampling import SamplingParams
            rank = TpRank(m)
            p = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p,
                               top_k=a.top_k, seed=a.seed if a.seed is not None else 0, ignore_eos=a.ignore_eos)
            out = list(rank.generate(ids, p, set(m.spec.eos_token_ids)))
            if env.rank == 0:
                print(json.dumps({"token_ids": out, "devices": env.world, "backend": "monokernel-tp"}) if a.json
                      else ",".join(map(str, out)))
            return 0
        if a.backend != "reference":
            raise InputError(f"--devices {env.world}: backend {a.backend!r} has no multi-GPU path "
                             "(monokernel or reference)")
        if a.temperature != 0.0:
            raise InputError("--devices > 1 --backend reference decodes greedily only (use --temperature 0)")
        coll = KcclCollective(GpuHeap.rendezvous(capacity_bytes=1 << 20))
        dec = TpRankDecoder(m.spec, m.weights, env.rank, env.world, coll, device=dev)
        eos = set(m.spec.eos_token_ids)
        logits, out = dec.forward(torch.tensor(ids)), []
        for _ in range(a.max_new_tokens):
            out.append(int(logits[-1].argmax()))
            if out[-1] in eos and not a.ignore_eos:
                break
            logits = dec.forward(torch.tensor([out[-1]]))
        if env.rank == 0:
            print(json.dumps({"token_ids": out, "devices": env.world, "backend": "tp-reference+kccl"}) if a.json
                  else ",".join(map(str, out)))
        return 0
    finally:
        dist.destroy_process_group()

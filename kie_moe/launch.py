"""`--devices N`: run a `kie` subcommand on N devices as N worker processes, torchrun-style.

The parent checks that N devices are there (N GPUs visible, or --device cpu: N CPU processes; else a one-line
InputError -> exit 2, nothing started), picks a free TCP port on 127.0.0.1 (the rendezvous never
leaves this host), and starts `python -m kie_moe.cli <same argv>` N times with RANK / LOCAL_RANK / WORLD_SIZE /
LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT set and KIE_WORKER=1 (so a worker does not launch again). What a
worker runs is kie_moe/ranks.py (every rank decodes, rank 0 alone talks to the user). Only rank 0 writes to stdout;
the others' stdout is dropped, stderr is kept. If a worker fails, the others are terminated and the first failing
exit code is returned; once rank 0 has exited, the others get GRACE_S to follow it before they are stopped. SIGTERM
to the parent goes to rank 0 first (a server shuts down gracefully and releases the others), then to the rest.

N = 1 runs in-process through the same `run_local(...)` entry with a world of one (no subprocess, no port): the
single-device path. KIE_LAUNCH_WORKERS=1 in the environment starts worker processes even for N = 1, so one GPU (or
the CPU) runs the N-device path with WORLD_SIZE=1 (how the multi-device code is checked on a single device).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from kie_moe.models.errors import InputError

MASTER_ADDR = "127.0.0.1"        # never any other address: workers rendezvous on this host only
GRACE_S = 30.0                   # after rank 0 exits, how long the other ranks may take to follow it


@dataclass(frozen=True)
class WorkerEnv:
    """What a process knows about its place in the launch (N = 1 in-process: rank 0 of 1, not launched)."""
    rank: int = 0
    local_rank: int = 0
    world: int = 1
    master_addr: str = MASTER_ADDR
    master_port: int = 0
    launched: bool = False       # a worker process started by launch() (KIE_WORKER=1), even in a world of one

    @property
    def is_worker(self) -> bool:
        return self.launched


def worker_env() -> WorkerEnv:
    """The launch environment of this process (a plain process: rank 0 of 1)."""
    if os.environ.get("KIE_WORKER") != "1":
        return WorkerEnv()
    try:
        return WorkerEnv(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]),
                         os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), launched=True)
    except (KeyError, ValueError) as e:
        raise InputError(f"KIE_WORKER=1 but the launch environment is incomplete ({e!r}): start workers with "
                         f"kie ... --devices N, not by hand") from None


def workers_forced() -> bool:
    """KIE_LAUNCH_WORKERS=1: worker processes even for --devices 1 (the N-device path on one device)."""
    return os.environ.get("KIE_LAUNCH_WORKERS") == "1"


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


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def device_kind(device: str | None) -> str:
    """"cpu" or "cuda": what the ranks of `--device DEVICE` run on (no --device: the GPUs if any, else the CPU)."""
    if device is not None:
        return "cpu" if device.split(":")[0] == "cpu" else "cuda"
    return "cuda" if visible_gpus() > 0 else "cpu"


def check_devices(n: int, have: int | None = None, device: str | None = None) -> None:
    """Raise InputError (one line) unless `n` >= 1 and n devices are there: n GPUs visible (`have`: how many, for
    tests), or `device` "cpu" (n CPU processes, any n). n = 1 needs no GPU: CPU runs too."""
    if not isinstance(n, int) or n < 1:
        raise InputError(f"--devices must be at least 1, got {n}")
    if n == 1:
        return
    if device is not None and device.split(":")[0] == "cpu":
        return                  # N CPU processes: they share the cores (ranks.py splits torch's threads)
    have = visible_gpus() if have is None else have
    if have < n:
        hint = "; --device cpu runs N CPU processes instead" if device is None else ""
        raise InputError(f"--devices {n}: only {have} GPU{'s' if have != 1 else ''} visible "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); nothing was run"
                         + hint)


def worker_environ(rank: int, world: int, port: int, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR=MASTER_ADDR, MASTER_PORT=str(port), KIE_WORKER="1")
    return env


class _Terminated(Exception):
    pass


def launch(n: int, argv: list[str], run_local: Callable[[WorkerEnv], int], *, have: int | None = None,
           device: str | None = None, python: str = sys.executable, module: str = "kie_moe.cli",
           poll_s: float = 0.05, timeout_s: float | None = None, grace_s: float = GRACE_S) -> int:
    """Run `kie argv` on n devices. n = 1 (or already inside a worker): run_local(worker_env()) in this process.
    Else (or with KIE_LAUNCH_WORKERS=1) n workers `python -m module argv`; returns 0 when all exit 0, else the
    first non-zero exit code (rank 0's when it is the one that failed)."""
    if os.environ.get("KIE_WORKER") == "1":
        return run_local(worker_env())
    check_devices(n, have, device)
    if n == 1 and not workers_forced():
        return run_local(WorkerEnv())
    port = free_port()
    procs: list[subprocess.Popen] = []
    old_term = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise _Terminated()
        old_term = signal.signal(signal.SIGTERM, on_term)
    t0, failed, rank0_done, rank0_decides = time.monotonic(), None, None, False
    try:
        for r in range(n):
            out = None if r == 0 else subprocess.DEVNULL      # rank 0 speaks for the group
            procs.append(subprocess.Popen([python, "-m", module, *argv], env=worker_environ(r, n, port),
                                          stdout=out))
        while any(p.poll() is None for p in procs):
            bad = [p for p in procs if p.poll() not in (None, 0)]
            if bad:
                failed = bad[0].returncode
                break
            if procs[0].poll() is not None:                   # rank 0 is done: the others follow it, or stop
                rank0_done = rank0_done or time.monotonic()
                if time.monotonic() - rank0_done > grace_s:
                    print(f"kie: --devices {n}: rank 0 finished but ranks "
                          f"{[r for r, p in enumerate(procs) if p.poll() is None]} still run after {grace_s:g} s; "
                          f"stopping them", file=sys.stderr)
                    rank0_decides = True
                    break
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                print(f"kie: --devices {n}: workers still running after {timeout_s:g} s; stopping them",
                      file=sys.stderr)
                failed = 124
                break
            time.sleep(poll_s)
    except _Terminated:                                 # forwarded to rank 0 below: a server exits cleanly
        rank0_decides = True
    finally:
        # only the workers this call started, by handle: rank 0 first (a server shuts down gracefully and tells the
        # others to stop), then whoever is left
        for group in (procs[:1], procs[1:]):
            for p in group:
                if p.poll() is None:
                    p.terminate()
            for p in group:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    if failed is None:
        codes = [p.returncode for p in procs]
        failed = codes[0] if codes[0] != 0 or rank0_decides else next((c for c in codes if c != 0), 0)
    return 128 - failed if failed < 0 else failed      # killed by signal s: 128 + s, as a shell reports it


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

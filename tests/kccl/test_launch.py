"""kie_moe/launch.py: refusals are one line (exit 2), N=1 runs in-process, N workers get a torchrun-style env on
127.0.0.1 with one shared port, and a failing worker's exit code comes back."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kie_moe import cli
from kie_moe.launch import WorkerEnv, check_devices, launch
from kie_moe.ranks import check_backend
from kie_moe.models.errors import InputError


def test_refuses_without_gpus(capsys):
    with pytest.raises(InputError, match=r"--devices 4: only 0 GPUs visible"):
        check_devices(4, have=0)
    with pytest.raises(InputError, match="at least 1"):
        check_devices(0)
    rc = cli.main(["generate", "/nonexistent", "--prompt-ids", "1,2", "--devices", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--devices 2: only" in err and "GPU" in err


def test_cpu_ranks_and_backends(capsys):
    check_devices(3, have=0, device="cpu")                 # N CPU processes need no GPU
    with pytest.raises(InputError, match="--device cpu runs N CPU processes instead"):
        check_devices(2, have=0)
    assert check_backend("cuda", "auto") == "monokernel" and check_backend("cpu", "auto") == "reference"
    with pytest.raises(InputError, match="needs CUDA GPUs"):
        check_backend("cpu", "monokernel")
    with pytest.raises(InputError, match="graph backend has no multi-device path"):
        check_backend("cuda", "graph")
    # refused before any worker starts: one line, exit 2
    for cmd in (["bench", "qwen3-30b-a3b", "--tiny"], ["generate", "m", "--prompt-ids", "1"], ["serve", "m"]):
        assert cli.main([*cmd, "--device", "cpu", "--devices", "2", "--backend", "monokernel"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "needs CUDA GPUs" in err


def test_one_device_runs_in_process():
    seen = []
    assert launch(1, ["x"], lambda env: seen.append(env) or 0, have=0) == 0
    assert seen == [WorkerEnv()] and not seen[0].is_worker


WORKER = """
import json, os, sys, time
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "KIE_WORKER"]
with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump({k: os.environ.get(k) for k in keys} | {"argv": sys.argv[1:]}, f)
if sys.argv[2] == "hang" and os.environ["RANK"] != "0":
    time.sleep(600)
sys.exit(int(sys.argv[2]) if os.environ["RANK"] == "1" and sys.argv[2] != "hang" else 0)
"""


def test_workers_env_and_failure(tmp_path, monkeypatch):
    (tmp_path / "fake_worker.py").write_text(WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.delenv("KIE_WORKER", raising=False)
    rc = launch(3, [str(tmp_path), "0"], lambda env: 99, have=3, module="fake_worker", timeout_s=60)
    assert rc == 0
    envs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"} and len({e["MASTER_PORT"] for e in envs}) == 1
    assert {e["KIE_WORKER"] for e in envs} == {"1"} and envs[0]["argv"] == [str(tmp_path), "0"]
    assert launch(2, [str(tmp_path), "7"], lambda env: 99, have=2, module="fake_worker", timeout_s=60) == 7
    # rank 0 speaks for the group: once it is done, the others get grace_s, then are stopped
    t0 = time.monotonic()
    assert launch(2, [str(tmp_path), "hang"], lambda env: 99, have=2, module="fake_worker", timeout_s=60,
                  grace_s=0.5) == 0
    assert time.monotonic() - t0 < 30
    # KIE_LAUNCH_WORKERS=1: one worker process even for one device (the N-device path with WORLD_SIZE=1)
    monkeypatch.setenv("KIE_LAUNCH_WORKERS", "1")
    (tmp_path / "rank0.json").unlink()
    assert launch(1, [str(tmp_path), "0"], lambda env: 99, have=0, module="fake_worker", timeout_s=60) == 0
    assert json.loads((tmp_path / "rank0.json").read_text())["WORLD_SIZE"] == "1"


def test_cli_generate_has_devices():
    a = cli.build_parser().parse_args(["generate", "m", "--prompt-ids", "1", "--devices", "3"])
    assert a.devices == 3
    out = subprocess.run([sys.executable, "-m", "kie_moe.cli", "generate", "--help"], capture_output=True, text=True)
    assert "--devices" in out.stdout


def test_benchmark_script_help():
    here = os.path.dirname(__file__)
    out = subprocess.run([sys.executable, os.path.join(here, "..", "..", "benchmarks", "kccl_latency.py"), "--help"],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "--sizes" in out.stdout
    sys.path.insert(0, os.path.join(here, "..", ".."))
    import benchmarks.kccl_latency as b                    # importable without a GPU
    assert b.parse_args(["--sizes", "4096"]).sizes == "4096"

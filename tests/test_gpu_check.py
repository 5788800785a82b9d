"""scripts/gpu-check (the one command the device machine runs) and the GPU-only benchmark drivers it calls, checked
where CI can: the script parses, every stage its header documents has a branch (a documented stage that falls to
`unknown stage` would lose a device call), and benchmarks/ncu_launches.py refuses bad input in one line."""
import re
import subprocess
import sys

import pytest

from .scripts import ROOT, load_script

SCRIPT = ROOT / "scripts" / "gpu-check"


def test_gpu_check_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_documented_stage_has_a_branch():
    text = SCRIPT.read_text()
    listed = text[text.index("# stages:") + len("# stages:"):text.index("# Each stage")]
    documented = set(listed.replace("#", " ").split())
    documented |= set(re.findall(r"^#   ([a-z][\w-]*(?::[A-Z]+)*)\s", text, re.M))
    assert {"env", "tests", "ncu:CASE", "layer-sweep:MODEL:FMT", "kccl"} <= documented
    body = text[text.index("for s in $STAGES"):]
    branches = set(re.findall(r"^\s+([a-z][\w|:*-]*)\)", body, re.M))
    patterns = {p for b in branches for p in b.split("|")}
    missing = []
    for st in documented:
        name = st.split(":")[0]
        if not (name in patterns or f"{name}:*" in patterns):
            missing.append(st)
    assert not missing, f"stages documented in scripts/gpu-check without a case branch: {missing}"
    assert {"ncu:*", "graph-ab:*", "tests", "parity"} <= patterns


@pytest.mark.parametrize("case, msg", [("experts-fp6", "unknown case 'experts-fp6'"),
                                       ("gate-fp8", "unknown case 'gate-fp8'"),
                                       ("experts", "unknown case 'experts'")])
def test_ncu_launches_refuses_bad_cases(case, msg, monkeypatch, capsys):
    mod = load_script("benchmarks/ncu_launches.py")
    monkeypatch.setattr(sys, "argv", ["ncu_launches.py", "--case", case])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert msg in str(e.value) and "experts-FMT | qkv-FMT | big-FMT | bigexperts-FMT" in str(e.value)


def test_ncu_launches_needs_a_gpu(monkeypatch):
    mod = load_script("benchmarks/ncu_launches.py")
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["ncu_launches.py", "--case", "experts-fp8"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        mod.main()

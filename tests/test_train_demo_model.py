"""scripts/train_demo_model.py (the demo model's retraining recipe, benchmarks/results/2026-12-03-demo-quality.md
section 5) on CPU: the site-packages collection's filters, the z-loss term, the best-state bookkeeping, and one tiny
end-to-end run (model folder + tar, the best state saved rather than the last, the quantization gate's numbers
against kie sweep's own reference-decoder path on the same windows)."""
from __future__ import annotations

import json
import math
import os
import tarfile

import pytest
import torch
import torch.nn.functional as F

from .scripts import load_script

SHIPPED_FILES = ["TRAINING.md", "config.json", "generation_config.json", "heldout.txt", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def tdm():
    return load_script("scripts/train_demo_model.py")


def _write(path, data: bytes | str):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def _site(tmp_path) -> str:
    """A fake site-packages: what each file is for is in its name or the comment next to it."""
    root = str(tmp_path / "site-packages")
    _write(f"{root}/pkg_a/mod.py", "def a():\n    return 1\n")
    _write(f"{root}/pkg_b/mod_copy.py", "def a():\n    return 1\n")                # duplicate of pkg_a/mod.py
    _write(f"{root}/pkg_c/stdcopy.py", "import os\nprint(os.sep)\n")               # a stdlib file's content
    _write(f"{root}/vendored/_strptime.py", "x = 'named like a held-out file'\n")
    _write(f"{root}/backports/zoneinfo/__init__.py", "y = 'the held-out package file'\n")
    _write(f"{root}/other/__init__.py", "z = 'an unrelated package'\n")            # kept: package names differ
    _write(f"{root}/pkg_a/big.py", "#" * 400_001)
    _write(f"{root}/pkg_a/latin.py", b"s = '\xe9'\n")                             # not UTF-8
    _write(f"{root}/pkg_a/__pycache__/cached.py", "never read\n")
    _write(f"{root}/pkg_a/data.txt", "not python\n")
    _write(f"{root}/pkg_d/tool.py", "def tool():\n    pass\n")
    return root


HELD = [("_strptime.py", "held 1"), ("zoneinfo/__init__.py", "held 2"), ("xml/sax/saxutils.py", "held 3")]
STD_TRAIN = [("posixpath.py", "import os\nprint(os.sep)\n")]


def test_extra_files_filters(tdm, tmp_path):
    root = _site(tmp_path)
    kept, st = tdm.extra_files([root], HELD, tdm.content_hashes(STD_TRAIN + HELD))
    assert [label for label, _ in kept] == ["0:other/__init__.py", "0:pkg_a/mod.py", "0:pkg_d/tool.py"]
    assert dict(kept)["0:pkg_a/mod.py"] == "def a():\n    return 1\n"
    assert {k: st[k] for k in ("files", "kept", "too_big", "undecodable", "named_like_heldout", "duplicate",
                               "capped")} == dict(files=9, kept=3, too_big=1, undecodable=1, named_like_heldout=2,
                                                  duplicate=2, capped=0)
    assert st["bytes"] == sum(len(t.encode()) for _, t in kept)
    # a cap keeps a deterministic subset (the same one twice), counted as capped
    small, st2 = tdm.extra_files([root], HELD, tdm.content_hashes(STD_TRAIN + HELD), max_bytes=1)
    again, _ = tdm.extra_files([root], HELD, tdm.content_hashes(STD_TRAIN + HELD), max_bytes=1)
    assert len(small) == 1 and small == again and small[0] in kept and st2["capped"] == 2


def test_heldout_name(tdm):
    assert tdm.heldout_name("multiprocessing/dummy/connection.py") == "connection.py"
    assert tdm.heldout_name("zoneinfo/__init__.py") == "zoneinfo/__init__.py"
    assert tdm.heldout_name("a/b/idlelib/__main__.py") == "idlelib/__main__.py"


def test_lm_z_loss_against_definition(tdm):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=g) * 3).requires_grad_()
    y = torch.randint(0, 11, (2, 5), generator=g)
    ce, z = tdm.lm_z_loss(logits, y)
    want_ce = F.cross_entropy(logits.detach().reshape(-1, 11), y.reshape(-1))
    assert float(ce.detach()) == pytest.approx(float(want_ce), rel=1e-6)
    rows = logits.detach().double().reshape(-1, 11).tolist()
    want = sum(math.log(sum(math.exp(v) for v in r)) ** 2 for r in rows) / len(rows)
    assert float(z.detach()) == pytest.approx(want, rel=1e-5)
    # d z / d logits = 2 lse * softmax / positions: pushes logsumexp towards 0
    z.backward()
    x = logits.detach().reshape(-1, 11)
    lse = torch.logsumexp(x, -1, keepdim=True)
    assert torch.allclose(logits.grad.reshape(-1, 11), 2 * lse * torch.softmax(x, -1) / x.shape[0], atol=1e-6)


def test_step_loss_adds_z_term(tdm):
    torch.manual_seed(0)
    model = tdm.make_model(tdm.TINY, 64, 1, 0, 16)
    model.set_experts_implementation("eager")
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        l0, ce0, z0 = tdm.step_loss(model, x, y, 0.0)
        l1, ce1, z1 = tdm.step_loss(model, x, y, 1e-4)
    assert float(ce0) == float(ce1) and float(z0) == float(z1)
    assert float(l1 - l0) == pytest.approx(1e-4 * float(z0), rel=1e-3)
    assert float(z0) == pytest.approx(math.log(64) ** 2, rel=0.05)  # near-uniform logits at init


def test_best_state_keeps_the_lowest(tdm):
    lin = torch.nn.Linear(3, 2)
    best = tdm.BestState()
    seen = {}
    for step, loss in [(1, 3.0), (2, 2.0), (3, float("nan")), (4, 2.5), (5, 2.0)]:
        with torch.no_grad():
            lin.weight.fill_(float(step))
        seen[step] = lin.weight.detach().clone()
        best.update(step, loss, lin)
    assert best.step == 2 and best.loss == 2.0          # NaN never wins, a tie keeps the earlier one
    best.restore(lin)
    assert torch.equal(lin.weight, seen[2])


def test_end_to_end_tiny(tdm, tmp_path, monkeypatch, capsys):
    """main() on a tiny model: the shipped file set plus one tar; the held-out loss is scripted (lowest at the
    first of three evaluations) so the saved weights must be that step's, not the last; the gate's fp8 numbers
    equal kie sweep's (kie's reference decoder, its own dequantisation) on the same windows."""
    root = _site(tmp_path)
    monkeypatch.setattr(tdm, "site_dirs", lambda: [root])
    states, scripted = [], iter([1.0, 2.0, 3.0])
    monkeypatch.setattr(tdm, "heldout_loss", lambda model, *a: (states.append(
        {k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()}), next(scripted))[1])
    out = str(tmp_path / "demo")
    rc = tdm.main(["--out", out, "--device", "cpu", "--tiny", "--steps", "6", "--eval-every", "2", "--lr", "1e-2",
                   "--warmup", "1", "--max-data-mb", "0.2", "--seq-len", "64", "--batch", "4", "--gate", "fp8",
                   "--log-every", "100"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    js = [json.loads(ln) for ln in lines if ln.startswith("{")]
    assert len(js) == 1 and js[0]["best_step"] == 2 and js[0]["steps"] == 6

    assert sorted(os.listdir(out)) == SHIPPED_FILES
    with tarfile.open(out + ".tar") as tf:
        names = tf.getnames()
        assert names == [f"demo-moe/{f}" for f in SHIPPED_FILES]
        for f in SHIPPED_FILES:
            assert tf.extractfile(f"demo-moe/{f}").read() == open(os.path.join(out, f), "rb").read(), f

    from transformers import Qwen3MoeForCausalLM
    saved = Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.bfloat16).state_dict()
    assert len(states) == 3
    assert all(torch.equal(saved[k], states[0][k]) for k in states[0])   # step 2's weights, not step 6's
    assert any(not torch.equal(states[0][k], states[2][k]) for k in states[0])

    md = open(os.path.join(out, "TRAINING.md")).read()
    assert "the **best** state is saved: step 2" in md and "## Quantization gate" in md and "| fp8 |" in md
    assert "of 9 files kept" in md
    g = js[0]["quant_gate"]
    assert g["window"] == 256 and g["scored_tokens"] == g["windows"] * 256
    assert g["windows"] == g["of_tokens"] // 257 > 0                      # every window of 256 that fits
    fp8 = g["schemes"]["fp8"]
    assert 0 <= fp8["top1"] <= 1 and fp8["kl"] >= 0 and 0.02 < fp8["weight_rel_err"] < 0.03

    # the gate against kie sweep (reference decoder, kie's own reading of the fp8 checkpoint) on 3 windows of 32
    from kie_moe import sweep as S
    n, T = 3, 32
    gate = tdm.quant_gate(out, torch.device("cpu"), ["fp8"], window=T, max_windows=n, log=lambda m: None)
    res = S.run(out, ["bf16", "fp8"], str(tmp_path / "sweep"), device="cpu", window=T, max_tokens=n * T,
                prompt_len=4, new_tokens=2, runs=1, probe_bytes=1 << 20, progress=False)
    rows = {r["scheme"]: r for r in res["rows"]}
    assert "error" not in rows["fp8"], rows["fp8"]
    assert rows["fp8"]["quality_tokens"] == gate["scored_tokens"] == n * T
    assert gate["bf16"]["ppl"] == pytest.approx(rows["bf16"]["ppl"], rel=1e-4)
    assert gate["schemes"]["fp8"]["ppl"] == pytest.approx(rows["fp8"]["ppl"], rel=1e-4)
    assert gate["schemes"]["fp8"]["kl"] == pytest.approx(rows["fp8"]["kl"], rel=1e-2, abs=1e-6)
    assert gate["schemes"]["fp8"]["top1"] == pytest.approx(rows["fp8"]["top1"], abs=2 / (n * T))

"""benchmarks/kernels_micro.py on CPU: --help works, and every section's plumbing (weights, launch arguments,
MoE ids, x8 sharing, the JSON rows) runs on tiny shapes through the interpreter, so a GPU run is never lost to a
typo. The timing itself only runs on the device machine."""

import importlib.util
from pathlib import Path

import pytest

from .helpers import DEV, needs_device

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels_micro.py"


def _load():
    spec = importlib.util.spec_from_file_location("kernels_micro", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_and_args(capsys):
    km = _load()
    with pytest.raises(SystemExit) as e:
        km.parse_args(["--help"])
    assert e.value.code == 0 and "--out" in capsys.readouterr().out
    a = km.parse_args(["--out", "k.json", "--formats", "fp8,nvfp4", "--sweep"])
    assert (a.out, a.formats, a.sweep) == ("k.json", "fp8,nvfp4", True)


@needs_device
@pytest.mark.skipif(DEV != "cpu", reason="the CPU plumbing run; on the GPU run the script itself")
def test_sections_run_on_tiny_shapes(monkeypatch):
    km = _load()
    monkeypatch.setattr(km, "DEV", "cpu")
    monkeypatch.setattr(km, "L2_BYTES", 0)  # one copy of each weight
    tiny = dict(hidden=64, q_heads=2, kv_heads=1, head_dim=32, layers=2, vocab=96)
    models = {
        "tiny-moe": dict(tiny, moe=dict(experts=4, top_k=2, inter=32, act="silu", router="softmax")),
        "tiny-oss": dict(tiny, qkv_bias=True, moe=dict(experts=4, top_k=2, inter=64, act="gpt_oss",
                                                       router="softmax_topk", interleaved=True, bias=True)),
        "tiny-dense": dict(tiny, inter=96),
    }
    for name, spec in models.items():
        res = km.model_section(name, spec, ["bf16", "nvfp4"], 1000.0, 1)
        for fmt in ("bf16", "nvfp4"):
            assert res[fmt]["ops"] and res[fmt]["decode_ms_no_attention"] > 0
    big = km.big_section(["fp8", "mxfp4"], 0.01, 1000.0, 1, K=256)
    assert [r["fmt"] for r in big] == ["fp8", "mxfp4"]
    assert all(r["check_rel_err"] < 1e-5 for r in big)

"""benchmarks/prefill_bench.py on CPU: a tiny preset end to end (build, timed prefill, reference parity, TTFT
through the backend's generate), so the GPU run is never lost to a typo; the JSON is well formed."""
import json
import pytest

from ..scripts import load_script



def _load():
    return load_script("benchmarks/prefill_bench.py")


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        _load().parse_args(["--help"])
    assert e.value.code == 0 and "--prompt-len" in capsys.readouterr().out


@pytest.mark.parametrize("backend,scheme", [("graph", "fp8"), ("monokernel", "bf16")])
def test_tiny_preset_writes_json(backend, scheme, tmp_path):
    out = tmp_path / "r" / "prefill.json"
    rc = _load().main(["--tiny", "--device", "cpu", "--prompt-len", "40", "--runs", "1", "--moe", "auto,loop",
                       "--parity-len", "8", "--backend", backend, "--scheme", scheme, "--out", str(out)]
                      + (["--no-ttft"] if backend == "monokernel" else []))
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["schema"] == "kie-prefill-bench/1" and res["prompt_len"] == 40 and res["backend"] == backend
    for k in ("device", "torch", "triton", "git_commit", "command"):
        assert k in res["env"]
    assert [r["moe"] for r in res["rows"]] == ["auto", "loop"]
    for r in res["rows"]:
        assert "error" not in r, r.get("trace")
        assert r["tok_per_s"] > 0 and len(r["prefill_s_runs"]) == 1
        assert r["tok_per_s"] == pytest.approx(40 / r["prefill_s"])
        p = r["parity"]
        assert p["argmax_equal"] and p["logits_rel_err"] < 1e-4 and p["kv_rel_err"] < 1e-4
        if backend == "graph":
            assert r["ttft_ms"] > 0 and len(r["ttft_ms_runs"]) == 1

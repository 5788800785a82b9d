"""benchmarks/peers.py on CPU: a child that segfaults or hangs is recorded (signal, timeout, log tail) and does not
stop the run; compile modes fall back in order and the row names the mode that produced the number; a family
transformers lacks is skipped without a child; the join gives ours / peer; and a real child (tiny HF model, eager
and static cache on CPU) returns a timed row. The GPU numbers themselves come from scripts/gpu-check's peers stage."""
import json
import pytest

from .scripts import load_script



@pytest.fixture(scope="module")
def peers():
    return load_script("benchmarks/peers.py")


def test_segfaulting_child_is_a_row(peers, tmp_path):
    r = peers.run_child({"kind": "selftest", "action": "segv"}, 60, str(tmp_path / "segv.log"))
    assert r["ok"] is False and r["signal"] == "SIGSEGV" and r["rc"] == -11
    assert "SIGSEGV" in r["error"]


def test_hanging_child_is_killed(peers, tmp_path):
    r = peers.run_child({"kind": "selftest", "action": "hang"}, 2, str(tmp_path / "hang.log"))
    assert r["ok"] is False and r["error"] == "timed out" and r["timed_out_s"] == 2 and r["child_s"] < 30


def test_compile_fallback_skip_and_ratio(peers, tmp_path):
    calls = []

    def spawn(spec, timeout, log):
        calls.append((spec["arch"], spec["kind"], spec.get("mode"), spec.get("compile_mode")))
        if spec["kind"] == "ours":
            return {"ok": True, "tok_per_s": 300.0}
        if spec.get("compile_mode") == "reduce-overhead":
            return {"ok": False, "rc": -11, "signal": "SIGSEGV", "error": "child died with SIGSEGV before a result"}
        return {"ok": True, "tok_per_s": 50.0 if spec["mode"] == "compile" else 10.0}

    out = tmp_path / "peers.json"
    a = peers.parse_args(["--arch", "qwen3-30b-a3b", "--arch", "laneformer-2b", "--out", str(out)])
    peers.Runner(a, spawn).run()
    assert ("laneformer-2b", "hf", "eager", None) not in calls            # no child for a family HF lacks
    assert [c[3] for c in calls if c[2] == "compile"] == ["reduce-overhead", "default"]
    res = json.loads(out.read_text())
    comp = next(r for r in res["rows"] if r["arch"] == "qwen3-30b-a3b" and r["mode"] == "compile")
    assert comp["compile_mode"] == "default" and comp["attempts"][0]["signal"] == "SIGSEGV"
    lane = [r for r in res["rows"] if r["arch"] == "laneformer-2b" and r["peer"] == "hf-transformers"]
    assert len(lane) == 2 and all("no model_type 'laneformer'" in r["skipped"] for r in lane)
    rat = {(x["arch"], x["peer_mode"]): x for x in res["ratios"]}
    assert rat[("qwen3-30b-a3b", "compile")]["ours_over_peer"] == pytest.approx(6.0)
    assert rat[("qwen3-30b-a3b", "eager")]["ours_over_peer"] == pytest.approx(30.0)
    assert "ours_over_peer" not in rat[("laneformer-2b", "eager")]


def test_ours_in_each_scheme_against_the_bf16_peer(peers, tmp_path):
    def spawn(spec, timeout, log):
        if spec["kind"] == "ours":
            return {"ok": True, "tok_per_s": {"bf16": 300.0, "fp8": 400.0}[spec["scheme"]]}
        return {"ok": True, "tok_per_s": 100.0}

    out = tmp_path / "peers.json"
    a = peers.parse_args(["--arch", "qwen3-30b-a3b", "--modes", "compile", "--ours-schemes", "bf16,fp8",
                          "--out", str(out)])
    peers.Runner(a, spawn).run()
    res = json.loads(out.read_text())
    assert [(r["peer"], r.get("scheme")) for r in res["rows"]] == \
        [("hf-transformers", None), ("kie", "bf16"), ("kie", "fp8")]
    rat = {x["ours_scheme"]: x for x in res["ratios"]}
    assert rat["bf16"]["ours_over_peer"] == pytest.approx(3.0) and rat["fp8"]["ours_over_peer"] == pytest.approx(4.0)
    assert rat["fp8"]["ours_source"] == "same run"
    # the join reads the schemes back from the file
    j = tmp_path / "join.json"
    assert peers.main(["--join", str(out), "--out", str(j)]) == 0
    assert {x["ours_scheme"]: x["ours_over_peer"] for x in json.loads(j.read_text())["ratios"]} == \
        pytest.approx({"bf16": 3.0, "fp8": 4.0})


def test_join_old_peers_with_graph_json(peers, tmp_path, capsys):
    old = [{"peer": "hf-transformers-compile", "arch": "llama-3.2-1b", "tok_per_s": 387.0},
           {"peer": "hf-transformers-eager", "arch": "qwen3-30b-a3b", "error": "boom"}]
    graph = {"rows": [{"arch": "llama-3.2-1b", "fmt": "bf16", "backend": "graph", "tok_per_s": 997.5},
                      {"arch": "llama-3.2-1b", "fmt": "fp8", "backend": "graph", "tok_per_s": 1200.0}]}
    (tmp_path / "p.json").write_text(json.dumps(old))
    (tmp_path / "g.json").write_text(json.dumps(graph))
    out = tmp_path / "join.json"
    assert peers.main(["--join", str(tmp_path / "p.json"), str(tmp_path / "g.json"), "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    x = next(x for x in res["ratios"] if x["arch"] == "llama-3.2-1b")
    assert x["peer_mode"] == "compile" and x["ours_over_peer"] == pytest.approx(997.5 / 387.0)
    assert (tmp_path / "join.md").read_text().count("|") > 10
    assert "2.58x" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_real_child_tiny_on_cpu(peers, tmp_path, mode):
    spec = dict(kind="hf", arch="llama-3.2-1b", mode=mode, tiny=True, device="cpu", prompt_len=4, new_tokens=3,
                runs=1)
    r = peers.run_child(spec, 300, str(tmp_path / "child.log"))
    assert r["ok"], r
    assert r["tokens"] == 3 and r["tok_per_s"] > 0 and r["e2e_tok_per_s"] > 0 and r["layers"] == 2

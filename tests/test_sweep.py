"""kie sweep on CPU: one row per scheme in results.json / .csv / .md, a real PNG whose plotted points are the
table's numbers, cached conversions, the in-memory fallback, and a synthetic ARCH labelled as random-id quality."""
from __future__ import annotations

import csv
import json
import math
import os

import pytest
import torch

from kie_moe import sweep as S
from kie_moe.cli import main
from kie_moe.models.errors import InputError

ALL = "bf16,fp8,fp8-block,nvfp4,mxfp4"
FAST = ["--device", "cpu", "--new-tokens", "3", "--runs", "1", "--probe-mb", "16", "--window", "32",
        "--max-tokens", "64", "--quiet"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from tests.server.tiny_chat import make_chat_checkpoint
    return make_chat_checkpoint(str(tmp_path_factory.mktemp("sweep_ckpt")), max_position=512)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> str:
    from tests.server.tiny_chat import corpus
    p = tmp_path_factory.mktemp("text") / "sample.txt"
    p.write_text("\n".join(corpus(400, seed=7)))
    return str(p)


@pytest.fixture(scope="module")
def swept(ckpt, text_file, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sweep_out"))
    rc = main(["sweep", ckpt, "--schemes", ALL, "--text", text_file, "--out", out, *FAST])
    return rc, out, json.load(open(os.path.join(out, "results.json")))


def test_results_json(swept):
    rc, out, res = swept
    assert rc == 0
    assert res["schema"] == S.SCHEMA
    assert [r["scheme"] for r in res["rows"]] == ALL.split(",")
    assert res["quality_data"].startswith("text sample.txt (64 tokens, windows of 32 spread over all ")
    for r in res["rows"]:
        assert "error" not in r, r
        for k in ("backend", "tok_per_s", "ms_per_token", "bytes_per_token", "pct_roofline", "kl", "top1", "ppl",
                  "ppl_bf16", "quality_tokens", "model_source"):
            assert r[k] is not None, (r["scheme"], k)
        assert r["tok_per_s"] > 0 and r["kl"] >= 0 and 0 <= r["top1"] <= 1 and r["ppl"] > 1
        assert r["quality_tokens"] == 64 and math.isclose(r["ppl_bf16"], res["rows"][0]["ppl"])
    bf16 = res["rows"][0]
    assert bf16["kl"] == 0 and bf16["top1"] == 1
    # 4-bit formats move the distribution more than per-channel fp8 does
    by = {r["scheme"]: r for r in res["rows"]}
    assert 0 < by["fp8"]["kl"] < by["nvfp4"]["kl"] and by["mxfp4"]["kl"] > 0


def test_csv_and_markdown_rows(swept):
    _, out, res = swept
    with open(os.path.join(out, "results.csv")) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(S.CSV_FIELDS)
    assert [r["scheme"] for r in rows] == ALL.split(",")
    for c, j in zip(rows, res["rows"]):
        for k in ("tok_per_s", "kl", "top1", "ppl", "bytes_per_token", "pct_roofline"):
            assert float(c[k]) == j[k], (j["scheme"], k)          # repr round trip: exact
    md = open(os.path.join(out, "results.md")).read()
    table = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith(("| scheme", "| ---"))]
    assert [line.split("|")[1].strip() for line in table] == ALL.split(",")
    for line, j in zip(table, res["rows"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[2] == f"{j['tok_per_s']:.1f}" and cells[7] == f"{j['kl']:.5f}" and cells[8] == f"{j['top1']:.4f}"
    assert f"![tok/s vs KL]({S.PLOT_FILE})" in md and res["env"]["command"] in md


def test_png_is_real_and_plots_the_table(swept):
    _, out, res = swept
    path = os.path.join(out, S.PLOT_FILE)
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    import matplotlib.image as mpimg
    img = mpimg.imread(path)
    w, h = res["plot"]["size_px"]
    assert img.shape[:2] == (h, w) == (450, 700)
    assert img.std() > 0.01                                            # not a blank canvas
    pts = res["plot"]["points"]
    assert [p["scheme"] for p in pts] == ALL.split(",")
    for p, r in zip(pts, res["rows"]):
        assert p["x"] == r["kl"] and p["y"] == r["tok_per_s"]


def test_conversions_are_cached(swept, ckpt):
    _, out, res = swept
    assert res["converter"] == "kie convert"
    assert res["rows"][1]["model_source"].startswith("converted: ")
    d, how = S.scheme_checkpoint(ckpt, "fp8", os.path.join(out, "checkpoints"), S.convert_checkpoint)
    assert how == "cached" and d == os.path.join(out, "checkpoints", "fp8")
    # fp8-block on a 64-wide model: every weight is smaller than one 128 x 128 block, kept in float, and said so
    assert "kept them in float" in res["rows"][2]["note"] and res["rows"][2]["kl"] == 0


def test_synthetic_arch_is_labelled(tmp_path):
    res = S.run("qwen3-30b-a3b", ["bf16", "fp8"], str(tmp_path), tiny=True, device="cpu", window=16, max_tokens=32,
                new_tokens=3, runs=1, probe_bytes=16 << 20, progress=False)
    assert res["quality_data"].startswith("random token ids") and "no perplexity" in res["quality_data"]
    assert [r["scheme"] for r in res["rows"]] == ["bf16", "fp8"]
    assert all(r["ppl"] is None and r["tok_per_s"] > 0 for r in res["rows"])
    assert res["rows"][1]["kl"] > 0 and res["rows"][1]["model_source"] == "quantized in memory"
    assert (tmp_path / S.PLOT_FILE).read_bytes()[:8] == PNG_SIGNATURE


def test_a_sweep_cut_short_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """A device command's time limit kills a sweep mid-way: results.json must already hold the finished rows."""
    from kie_moe import bench as B
    real = B.bench_row
    def bench_row(src, *a, **k):
        if src.scheme == "fp8":
            raise KeyboardInterrupt   # stands in for the kill; not one of the errors a row records
        return real(src, *a, **k)
    monkeypatch.setattr(B, "bench_row", bench_row)
    with pytest.raises(KeyboardInterrupt):
        S.run("qwen3-30b-a3b", ["bf16", "fp8"], str(tmp_path), tiny=True, device="cpu", window=16, max_tokens=16,
              new_tokens=2, runs=1, probe_bytes=16 << 20, progress=False)
    res = json.load(open(tmp_path / "results.json"))
    assert [r["scheme"] for r in res["rows"]] == ["bf16"] and res["rows"][0]["tok_per_s"] > 0
    assert "| bf16 |" in (tmp_path / "results.md").read_text()
    assert (tmp_path / S.PLOT_FILE).read_bytes()[:8] == PNG_SIGNATURE


def test_bad_arguments(ckpt, tmp_path, capsys):
    with pytest.raises(InputError):
        S.parse_schemes("fp8,int3")
    with pytest.raises(InputError):
        S.parse_schemes("fp8,fp8")
    assert main(["sweep", "qwen3-30b-a3b", "--tiny", "--text", str(tmp_path / "x.txt"), "--out", str(tmp_path),
                 *FAST]) == 2
    assert "a preset ARCH has random weights and no tokenizer" in capsys.readouterr().err
    assert main(["sweep", ckpt, "--text", str(tmp_path / "missing.txt"), "--out", str(tmp_path), *FAST]) == 2
    assert "missing.txt: cannot read it" in capsys.readouterr().err


def test_mse_observer_sweep_converts_again_and_says_so(ckpt, text_file, tmp_path, capsys):
    """--observer mse: the fp4 rows come from conversions with MSE-chosen scales (a cached minmax conversion is not
    reused: the stamp names the observer), the table and the checkpoint's config say so; a synthetic ARCH
    (quantized in memory) refuses it."""
    cache = str(tmp_path / "cache")
    common = ["--text", text_file, "--cache", cache, *FAST]
    assert main(["sweep", ckpt, "--schemes", "bf16,nvfp4", "--out", str(tmp_path / "mm"), *common]) == 0
    assert main(["sweep", ckpt, "--schemes", "bf16,nvfp4", "--out", str(tmp_path / "mse"), "--observer", "mse",
                 *common]) == 0
    mm, ms = (json.load(open(tmp_path / d / "results.json")) for d in ("mm", "mse"))
    assert ms["observer"] == "mse" and mm["observer"] == "minmax"
    assert ms["rows"][1]["model_source"].startswith("converted: ")          # not the cached minmax one
    assert "(fp4 scales: mse observer)" in (tmp_path / "mse" / "results.md").read_text()
    cfg = json.load(open(os.path.join(cache, "nvfp4", "config.json")))
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["observer"] == "mse"
    capsys.readouterr()
    assert main(["sweep", "qwen3-30b-a3b", "--tiny", "--schemes", "bf16,nvfp4", "--out", str(tmp_path / "syn"),
                 "--observer", "mse", *FAST]) == 2
    assert "needs a checkpoint" in capsys.readouterr().err


def test_gptq_sweep_converts_with_gptq_and_says_so(ckpt, text_file, tmp_path, capsys):
    """--gptq: each scheme is converted by `kie convert --gptq` over the calibration text (cached apart from the
    round-to-nearest conversion, under SCHEME-gptq, its stamp naming the calibration windows), the table says so,
    and the model it scores is a different one from RTN's; --calib without --gptq and --gptq on a synthetic ARCH
    are refused."""
    cache = str(tmp_path / "cache")
    common = ["--text", text_file, "--cache", cache, "--schemes", "bf16,nvfp4", *FAST]
    assert main(["sweep", ckpt, "--out", str(tmp_path / "rtn"), *common]) == 0
    assert main(["sweep", ckpt, "--out", str(tmp_path / "gptq"), "--gptq", "--calib", text_file,
                 "--calib-tokens", "512", *common]) == 0
    rtn, gq = (json.load(open(tmp_path / d / "results.json")) for d in ("rtn", "gptq"))
    assert rtn["gptq"] is None and "sample.txt (2 windows of 256" in gq["gptq"]["calibration"]
    assert gq["rows"][1]["model_source"] == f"converted: {os.path.join(cache, 'nvfp4-gptq')}"
    assert "codes by GPTQ, calibrated on" in (tmp_path / "gptq" / "results.md").read_text()
    assert gq["rows"][1]["kl"] != rtn["rows"][1]["kl"]
    stamp = json.load(open(os.path.join(cache, "nvfp4-gptq", S._STAMP)))
    assert stamp["gptq"]["damp"] == 0.01 and len(stamp["gptq"]["sha1"]) == 40
    capsys.readouterr()
    assert main(["sweep", ckpt, "--out", str(tmp_path / "x"), "--calib", text_file, *common]) == 2
    assert "add --gptq" in capsys.readouterr().err
    assert main(["sweep", "qwen3-30b-a3b", "--tiny", "--schemes", "bf16,nvfp4", "--out", str(tmp_path / "syn"),
                 "--gptq", *FAST]) == 2
    assert "--gptq: needs a checkpoint" in capsys.readouterr().err


def test_experts_only_sweep_keeps_attention_in_float(tmp_path, capsys):
    """--experts-only: each scheme is converted by `kie convert --experts-only` (cached under SCHEME-experts, its
    stamp says so): the scored checkpoint holds the scheme in the experts and float attention, and the table says
    so; a synthetic ARCH (quantized in memory, every Linear) refuses it."""
    from kie_moe.synthetic import open_model
    cache = str(tmp_path / "cache")
    assert main(["sweep", "demo", "--schemes", "bf16,fp8", "--out", str(tmp_path / "eo"), "--cache", cache,
                 "--experts-only", *FAST]) == 0
    res = json.load(open(tmp_path / "eo" / "results.json"))
    d = os.path.join(cache, "fp8-experts")
    assert res["experts_only"] is True and res["rows"][1]["model_source"] == f"converted: {d}"
    assert json.load(open(os.path.join(d, S._STAMP)))["experts_only"] is True
    assert "routed and shared experts only" in (tmp_path / "eo" / "results.md").read_text()
    src = open_model(d, torch.device("cpu"))
    assert src.scheme_of("layers.0.moe.experts.0.up") == "fp8" and src.scheme_of("layers.0.attn.q") == "bf16"
    capsys.readouterr()
    assert main(["sweep", "qwen3-30b-a3b", "--tiny", "--schemes", "bf16,fp8", "--out", str(tmp_path / "syn"),
                 "--experts-only", *FAST]) == 2
    assert "--experts-only: needs a checkpoint" in capsys.readouterr().err


def test_cheap_argument_errors_come_before_any_work(ckpt, tmp_path, capsys, monkeypatch):
    """A bad --window / --max-tokens / --text / --out is refused before the read probe and the bf16 model load
    (nothing is created), and --out is optional: ./sweep-MODEL."""
    from kie_moe import roofline as R
    def no_probe(*a, **k):
        raise AssertionError("the read probe ran before the arguments were checked")
    monkeypatch.setattr(R, "read_probe", no_probe)
    out = tmp_path / "o"
    for extra, needle in [(["--window", "0"], "--window must be at least 1"),
                          (["--max-tokens", "-1"], "--max-tokens must be >= 0"),
                          (["--text", str(tmp_path / "missing.txt")], "missing.txt: cannot read it")]:
        assert main(["sweep", ckpt, "--out", str(out), *FAST, *extra]) == 2
        assert needle in capsys.readouterr().err
        assert not out.exists()
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    assert main(["sweep", ckpt, "--out", str(out), "--text", str(bad), *FAST]) == 2
    assert "latin1.txt: not UTF-8 text" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.undo()
    assert main(["sweep", ckpt, "--schemes", "bf16", "--out", str(blocker / "x"), *FAST]) == 2
    assert "cannot create it" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", ckpt, "--schemes", "bf16", *FAST]) == 0
    assert (tmp_path / f"sweep-{os.path.basename(ckpt.rstrip('/'))}" / "results.json").exists()

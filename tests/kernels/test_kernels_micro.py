"""benchmarks/kernels_micro.py on CPU: --help works, and every section's plumbing (weights, launch arguments,
MoE ids, x8 sharing, the JSON rows) runs on tiny shapes through the interpreter, so a GPU run is never lost to a
typo. The timing itself only runs on the device machine."""

import pytest

from ..scripts import load_script
from .helpers import DEV, needs_device



def _load():
    return load_script("benchmarks/kernels_micro.py")


def test_help_and_args(capsys):
    km = _load()
    with pytest.raises(SystemExit) as e:
        km.parse_args(["--help"])
    assert e.value.code == 0 and "--out" in capsys.readouterr().out
    a = km.parse_args(["--out", "k.json", "--formats", "fp8,nvfp4", "--sweep"])
    assert (a.out, a.formats, a.sweep) == ("k.json", "fp8,nvfp4", True)
    d = km.parse_args([])                      # the default run: big GEMVs and every model's layer, in budget
    assert d.skip == "" and d.budget_s <= 220 and d.models.split(",") == km.DEFAULT_MODELS
    assert set(km.DEFAULT_MODELS) == {"qwen3-30b-a3b", "gpt-oss-120b", "laneformer-2b"}
    assert km.plan("mxfp4-experts") == ("mxfp4-experts", "bf16", "mxfp4") and km.plan("fp8")[1:] == ("fp8", "fp8")
    with pytest.raises(ValueError):
        km.plan("int4")
    for name in km.DEFAULT_MODELS:            # every default plan names a known format
        assert all(km.plan(p) for p in km.MODELS[name]["plans"])
    assert km.mma_config("2x8:r0:p") == dict(row_blocks=2, num_warps=8, maxnreg=0, packed=True)
    with pytest.raises(SystemExit, match="RBxW"):
        km.mma_config("2x4:q")


_TINY = dict(hidden=64, q_heads=2, kv_heads=1, head_dim=32, layers=2, vocab=96)
_TINY_MODELS = {
    "tiny-moe": dict(_TINY, qk_norm="head", moe=dict(experts=4, top_k=2, inter=32, act="silu", router="softmax")),
    "tiny-oss": dict(_TINY, qkv_bias=True, sinks=True, windows=[(None, 0.5), (8, 0.5)],
                     moe=dict(experts=4, top_k=2, inter=64, act="gpt_oss", router="softmax_topk",
                              interleaved=True, bias=True)),
    "tiny-lane": dict(_TINY, inter=96, lanes=4, windows=[(8, 0.6), (None, 0.4)]),
}


@needs_device
@pytest.mark.skipif(DEV != "cpu", reason="the CPU plumbing run; on the GPU run the script itself")
@pytest.mark.parametrize("name", [*_TINY_MODELS, "big", "big-experts"])   # one case each: CI's workers share them
def test_sections_run_on_tiny_shapes(name, monkeypatch):
    km = _load()
    monkeypatch.setattr(km, "DEV", "cpu")
    monkeypatch.setattr(km, "L2_BYTES", 0)  # one copy of each weight
    models = {name: _TINY_MODELS[name]} if name in _TINY_MODELS else {}
    plans = {"tiny-moe": ["bf16", "nvfp4"], "tiny-oss": ["mxfp4-experts", "fp8_block"], "tiny-lane": ["fp8", "mxfp4"]}
    for spec in models.values():          # the one tiny model this case names
        res = km.model_section(name, spec, plans[name], 1000.0, 1, ctxs=(16, 24))
        assert len(res["attention"]) == 2 * len(spec.get("windows", [0]))
        for label in plans[name]:
            r = res["plans"][label]
            assert r["ops"] and not r["missing"], r["missing"]
            assert all("error" not in o for o in r["ops"]), r["ops"]
            for key in ("ctx16_us", "ctx16_us_eager", "ctx24_us"):
                assert r["sums"][key]["decode_ms"] > 0
            assert ("all_lanes_one_device" in r) == ("lanes" in spec)
            if "moe" in spec:            # KIE_SELECT_IN_EXPERTS's A/B rows: router + both expert launches
                blocks = [o for o in r["ops"] if o["op"].startswith("router + experts")]
                assert [o["op"] for o in blocks] == ["router + experts", "router + experts (top-k in the expert launch)"]
                assert all(o["launches"] == 3 and o["us"] > 0 for o in blocks)
                folds = [o for o in r["ops"] if o["op"].startswith("o_proj + router")]   # KIE_ROUTER_FOLD's A/B
                float_o = r["attn_fmt"] not in ("nvfp4", "mxfp4")           # fp4 experts too (their x8 from o_proj's)
                assert [o["launches"] for o in folds] == ([4, 3] if float_o else [])
                assert all(o["us"] > 0 and o["ab_row"] for o in folds)
                counted = sum(o["us"] for o in r["ops"] if not o.get("ab_row"))   # the A/B rows stay out of the sums
                assert sum(o["us"] for o in r["ops"]) > counted
        if name == "tiny-oss":              # the released gpt-oss layout: bf16 attention, mxfp4 experts
            r = res["plans"]["mxfp4-experts"]
            assert (r["attn_fmt"], r["ffn_fmt"]) == ("bf16", "mxfp4")
            assert [o["launches"] for o in r["ops"] if o["op"].startswith("q, k, v")] == []
            assert [o["launches"] for o in res["plans"]["fp8_block"]["ops"] if o["op"].startswith("q, k, v")] == [3]
    if name == "big":
        big = km.big_section(["fp8", "mxfp4"], 0.01, 1000.0, 1, K=256)
        assert [r["fmt"] for r in big] == ["fp8", "mxfp4"]
        assert all(r["check_rel_err"] < 1e-5 for r in big)
    if name != "big-experts":
        return
    ex = km.big_experts_section(["fp8_block", "nvfp4"], 0.05, 1000.0, 1, H=128, I=256, model_shapes=False)
    assert [r["fmt"] for r in ex] == ["fp8_block"] * 4 + ["nvfp4"] * 6 and all(r["fn"] == "moe_experts" for r in ex)
    # fp8-block: gate / up in one K loop, that on the router's normed x, its former tiles
    assert [r["op"].split("] ")[-1] for r in ex[1:4]] == ["glu pair", "glu pair xn", "glu tiles"]
    # fp4: both paths, the tensor cores on packed stacks, then the down launch's other row-block choice
    assert [r["op"].split("] ")[-1] for r in ex[4:7]] == ["cuda-core", "mma", "mma packed"]
    assert ex[7]["op"].split()[-1] in ("down-rb1", "down-rb2")
    assert [r["op"].split()[-1] for r in ex[8:]] == ["glu-ks2", "glu-ks3"]      # the GLU in K chunks
    tk = km.experts_topk_section(["fp8", "nvfp4"], [1, 3], 1000.0, 1, H=128, I=256)
    assert [(r["fmt"], r["shape"][1], r["glu_programs"]) for r in tk] == [
        ("fp8", 1, 256 // 8), ("fp8", 3, 3 * 256 // 8), ("nvfp4", 1, 256 // 64), ("nvfp4", 3, 3 * 256 // 64)]
    assert all(r["op"].endswith(" mma") == (r["fmt"] == "nvfp4") and r["us"] > 0 for r in tk)
    for r in ex:                         # active bytes only: top-k experts of 2k, at least the asked-for size
        E, k, I, H = r["shape"]
        assert E == max(8, 2 * k) and r["mb"] >= 0.05 * 1.048576


def test_budget_skips_instead_of_running(monkeypatch):
    km = _load()
    monkeypatch.setattr(km, "DEV", "cpu")
    spent = km.Budget(1e-9)
    spec = dict(hidden=64, q_heads=2, kv_heads=1, head_dim=32, layers=2, vocab=96, inter=96)
    res = km.model_section("late", spec, ["bf16"], 1000.0, 1, ctxs=(16,), budget=spent)
    r = res["plans"]["bf16"]
    assert all(o.get("skipped") == "time budget" for o in r["ops"]) and r["sums"] == {} and r["missing"]
    assert km.big_section(["fp8"], 0.01, 1000.0, 1, K=256, budget=spent) == [
        dict(op="gemv fp8", skipped="time budget")]


@needs_device
@pytest.mark.skipif(DEV != "cpu", reason="the CPU plumbing run; on the GPU run the script itself")
def test_layer_sweep_times_each_launch_shape_and_records_failures(monkeypatch):
    km = _load()
    monkeypatch.setattr(km, "DEV", "cpu")
    monkeypatch.setattr(km, "L2_BYTES", 0)
    tiny = dict(hidden=64, q_heads=2, kv_heads=1, head_dim=32, layers=2, vocab=96, qk_norm="head",
                moe=dict(experts=4, top_k=2, inter=32, act="silu", router="softmax"))
    monkeypatch.setitem(km.MODELS, "tiny-moe", tiny)
    full = km._layer_sweep_grid("fp8")
    assert {op: len(g) for op, g in full.items()} == dict(qkv=32, o=32, router=13, up=37, down=54)
    assert sum(lab.endswith("w=2 split=None") for lab, _ in full["qkv"]) == 9       # the 2-warp rows
    assert [lab for lab, _ in full["qkv"][-4:]] == [f"bn={bn} bk={bk} w=4 split=None pf=1"   # the prefetch rows
                                                   for bn, bk in ((16, 512), (8, 512), (4, 1024), (8, 1024))]
    assert len(km._layer_sweep_grid("bf16")["qkv"]) == 28                 # bf16 prefetches already
    bad = ("bn=8 bk=300", dict(config=km.TileConfig(8, 300)))       # block_k not a power of two: an error row
    grid = {op: g[:2] for op, g in full.items()}
    grid["o"] = grid["o"] + [bad]
    monkeypatch.setattr(km, "_layer_sweep_grid", lambda fmt: grid)
    res = km.layer_sweep_section("tiny-moe:fp8", 1000.0, 1, km.Budget(None))
    assert list(res["ops"]) == ["up", "down", "qkv", "o", "router"]
    for op, rows in res["ops"].items():
        assert [r["tiles"] for r in rows] == [lab for lab, _ in grid[op]]
        assert all("us" in r for r in rows if r["tiles"] != "bn=8 bk=300"), rows
    assert "powers of two" in res["ops"]["o"][-1]["error"]
    assert res["best"]["qkv"]["default_us"] is not None
    only = km.layer_sweep_section("tiny-moe:fp8", 1000.0, 1, km.Budget(None), only=["down"])
    assert list(only["ops"]) == ["down"]
    with pytest.raises(SystemExit):
        km.layer_sweep_section("tiny-moe:fp9", 1000.0, 1, km.Budget(None))

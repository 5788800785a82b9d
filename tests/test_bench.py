"""kie bench / kie preview on CPU: the JSON schema, the numbers' internal consistency (bytes x tok/s = GB/s, % of
the probe), the bytes-per-token accounting against independent counts, and the user errors (exit 2, one line)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from kie_moe import bench as B
from kie_moe import roofline as R
from kie_moe.cli import main

RUN = ["--device", "cpu", "--new-tokens", "4", "--runs", "2", "--probe-mb", "16"]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models on a busy 2-core machine: OpenMP spin-waits make 2 threads far slower than 1."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    from tests.server.tiny_chat import make_chat_checkpoint
    return make_chat_checkpoint(str(tmp_path_factory.mktemp("bench_ckpt")), max_position=512)


def run_json(capsys, argv) -> tuple[int, dict]:
    rc = main(argv)
    out = capsys.readouterr().out
    return rc, json.loads(out)


def check_row(r: dict, runs: int):
    assert set(B.ROW_FIELDS) <= set(r), set(B.ROW_FIELDS) - set(r)
    assert len(r["tok_per_s_runs"]) == r["runs"] == runs
    assert r["tok_per_s"] > 0 and min(r["tok_per_s_runs"]) <= r["tok_per_s"] <= max(r["tok_per_s_runs"])
    assert math.isclose(r["ms_per_token"], 1e3 / r["tok_per_s"])
    assert r["ttft_s"] > 0 and len(r["ttft_s_runs"]) == runs
    if r["context_fill"] == "prefill":       # a real prefill: prompt tokens over TTFT
        assert math.isclose(r["prefill_tok_per_s"], r["prompt_len"] / r["ttft_s"])
    else:
        assert r["prefill_tok_per_s"] is None
    b = r["bytes"]
    assert b["total"] == b["weights"] + b["scales"] + b["kv"] == r["bytes_per_token"] > 0
    assert sum(b["detail"].values()) == b["weights"] + b["scales"]
    assert math.isclose(r["achieved_gbps"], r["tok_per_s"] * r["bytes_per_token"] / 1e9)
    n = r["devices"]                         # N devices: each reads bytes / N, the ceiling is N probes
    assert math.isclose(r["bytes_per_device"], r["bytes_per_token"] / n)
    assert math.isclose(r["pct_roofline"], 100 * r["achieved_gbps"] / (n * r["read_probe_gbps"]))
    assert math.isclose(r["roofline_tok_per_s"], n * r["read_probe_gbps"] * 1e9 / r["bytes_per_token"])
    assert len(r["token_ids"]) == r["new_tokens"] and (n == 1 or r["parallel"])   # N > 1 names its path


def test_bench_checkpoint_json(ckpt, tmp_path, capsys, monkeypatch):
    out = tmp_path / "sub" / "bench.json"
    monkeypatch.setenv("KIE_GLU_PAIR", "0")       # an A/B switch in effect: named in the row's environment
    monkeypatch.delenv("KIE_ROUTER_XN", raising=False)
    rc, res = run_json(capsys, ["bench", ckpt, *RUN, "--json", "--out", str(out)])
    assert rc == 0
    assert res == json.loads(out.read_text())
    assert res["schema"] == B.SCHEMA
    env = res["env"]
    for k in ("date", "command", "torch", "triton", "python", "device", "driver", "git_commit"):
        assert k in env
    assert env["command"].startswith("kie bench ") and env["device"] == "cpu"
    assert env["kie_switches"]["KIE_GLU_PAIR"] == "0" and "KIE_ROUTER_XN" not in env["kie_switches"]
    assert res["read_probe"]["gbps"] > 0 and res["read_probe"]["bytes"] == 16 << 20
    (r,) = res["rows"]
    check_row(r, 2)
    assert (r["source"], r["scheme"], r["backend"], r["prompt_len"], r["context_fill"]) == \
        ("checkpoint", "bf16", "reference", 32, "prefill")
    assert r["bytes"]["scales"] == 0 and r["backend_note"] == ""


def test_bench_table_and_context(ckpt, capsys):
    assert main(["bench", ckpt, *RUN, "--context-len", "100"]) == 0
    text = capsys.readouterr().out
    for word in ("tok/s", "ms/token", "TTFT", "bytes/token", "achieved", "roofline", "prompt 100 tokens"):
        assert word in text


def test_bench_synthetic_scheme(capsys):
    rc, res = run_json(capsys, ["bench", "qwen3-30b-a3b", "--tiny", "--scheme", "fp8", *RUN, "--json"])
    assert rc == 0
    (r,) = res["rows"]
    check_row(r, 2)
    assert (r["source"], r["model"], r["scheme"], r["family"]) == \
        ("synthetic", "qwen3-30b-a3b (tiny)", "fp8", "qwen3_moe")
    # the reference backend dequantizes: it streams float32, and says so
    assert "dequantizes fp8" in r["backend_note"] and r["bytes"]["scales"] == 0


def test_quantized_lm_head_bytes_and_store():
    """--quantize-lm-head: the roofline counts the head in the scheme's bytes (an independent count: nvfp4 codes
    V x H / 2, e4m3 scales V x H / 16, one fp32 global scale), and the store hands out its codes."""
    from kie_moe import synthetic as S
    from kie_moe.models.presets import preset
    from kie_moe.models.registry import spec_from_config
    spec = spec_from_config(preset("qwen3-30b-a3b"))
    V, H = 151936, 2048
    plain = R.weight_bytes(spec, S._scheme_fn("nvfp4"))
    head = R.weight_bytes(spec, S._scheme_fn("nvfp4", lm_head=True))
    assert plain.detail["head"] == V * H * 2
    assert head.detail["head"] == V * H // 2 + V * H // 16 + 4
    assert plain.total - head.total == plain.detail["head"] - head.detail["head"]
    src = S.open_model("qwen3-30b-a3b", torch.device("cpu"), scheme="nvfp4", tiny=True, quantize_lm_head=True)
    store = src.model.weights
    q = store.quantized_tensor("lm_head")
    assert q is not None and q.scheme == "nvfp4"
    raw = store.store.get("lm_head")
    assert torch.equal(store.get("lm_head"), q.dequantize(raw.dtype)) and not torch.equal(store.get("lm_head"), raw)
    assert src.scheme_of("lm_head") == "nvfp4" and src.scheme_of("embed") == "bf16"
    off = S.open_model("qwen3-30b-a3b", torch.device("cpu"), scheme="nvfp4", tiny=True)
    assert off.model.weights.quantized_tensor("lm_head") is None and off.scheme_of("lm_head") == "bf16"


def test_bench_quantize_lm_head_cli(capsys):
    rc, res = run_json(capsys, ["bench", "qwen3-30b-a3b", "--tiny", "--scheme", "fp8", "--quantize-lm-head", *RUN,
                                "--json"])
    assert rc == 0
    (r,) = res["rows"]
    check_row(r, 2)
    assert (r["scheme"], r["lm_head_scheme"]) == ("fp8", "fp8")
    assert main(["bench", "qwen3-30b-a3b", "--tiny", *RUN]) == 0
    assert "(lm_head" not in capsys.readouterr().out
    assert main(["bench", "qwen3-30b-a3b", "--tiny", "--scheme", "fp8", "--quantize-lm-head", *RUN]) == 0
    assert "scheme fp8 (lm_head fp8)" in capsys.readouterr().out
    assert main(["bench", "qwen3-30b-a3b", "--tiny", "--quantize-lm-head", *RUN]) == 2
    assert "--quantize-lm-head needs a quantization --scheme" in capsys.readouterr().err
    assert main(["bench", "llama-3.2-1b", "--tiny", "--scheme", "fp8", "--quantize-lm-head", *RUN]) == 2
    assert "ties its lm_head to the embedding" in capsys.readouterr().err
    assert main(["bench", "--all", "--quantize-lm-head", "--scheme", "fp8", *RUN]) == 2
    assert "--quantize-lm-head applies to one MODEL" in capsys.readouterr().err


def test_checkpoint_with_quantized_lm_head_counts_it(ckpt, tmp_path):
    """A checkpoint converted with --quantize-lm-head: bench's byte count takes the head's scheme from its
    config.json (it counted the head as float before)."""
    from kie_moe import synthetic as S
    dst = tmp_path / "fp8-head"
    assert main(["convert", ckpt, str(dst), "--scheme", "fp8", "--quantize-lm-head", "--quiet"]) == 0
    src = S.open_model(str(dst), torch.device("cpu"))
    assert src.scheme == "fp8" and src.scheme_of("lm_head") == "fp8"
    plain = tmp_path / "fp8"
    assert main(["convert", ckpt, str(plain), "--scheme", "fp8", "--quiet"]) == 0
    assert S.open_model(str(plain), torch.device("cpu")).scheme_of("lm_head") == "bf16"
    with pytest.raises(B.InputError, match="already fp8; its lm_head"):
        S.open_model(str(plain), torch.device("cpu"), scheme="fp8", quantize_lm_head=True)


def test_weight_bytes_against_param_counts():
    from kie_moe.models.synth import build, count_params
    from kie_moe.models.presets import preset
    for arch in ("qwen3-30b-a3b", "llama-3.2-1b"):
        _, spec = build(preset(arch))
        b = R.weight_bytes(spec)
        _, active_no_embed = count_params(spec, embed_in_active=False)
        row = 0 if spec.tie_word_embeddings else spec.hidden_size   # one embedding row unless it is the head
        assert b.weights == 2 * (active_no_embed + row) and b.scales == 0
    # qwen3-30b-a3b fp8: Linear codes 1 byte instead of 2, plus one float32 scale per output row
    from kie_moe.synthetic import is_quantized_linear
    _, spec = build(preset("qwen3-30b-a3b"))
    f = R.weight_bytes(spec, lambda n: "fp8" if is_quantized_linear(n) else "bf16")
    bf = R.weight_bytes(spec)
    D, lin, rows = spec.hidden_size, 0, 0
    for lay in spec.layers:
        a, m = lay.attn, lay.moe
        lin += D * (a.q_size + 2 * a.kv_size) + a.q_size * D + m.top_k * 3 * m.intermediate_size * D
        rows += a.q_size + 2 * a.kv_size + D + m.top_k * (2 * m.intermediate_size + D)
    assert f.weights == bf.weights - lin
    assert f.scales == 4 * rows


def test_weight_bytes_unquantizable_shapes_stay_float():
    from kie_moe.models.synth import build
    from kie_moe.models.presets import tiny
    _, spec = build(tiny("qwen3-30b-a3b"))
    # fp8-block needs no multiple of 128, but nvfp4 needs in % 16 == 0: the tiny expert down (in=24) stays float
    nv = R.weight_bytes(spec, lambda n: "nvfp4" if "experts." in n else "bf16")
    from kie_moe.quant.schemes import NotQuantizable, get_scheme
    with pytest.raises(NotQuantizable):
        get_scheme("nvfp4").check((spec.hidden_size, spec.layers[0].moe.intermediate_size))
    assert nv.scales > 0 and nv.weights < R.weight_bytes(spec).weights


def test_kv_bytes():
    from types import SimpleNamespace as NS
    from kie_moe.models.synth import build
    from kie_moe.models.presets import preset
    _, spec = build(preset("llama-3.2-1b"))
    a = spec.layers[0].attn
    per = 2 * a.num_kv_heads * a.head_dim * 2 * spec.num_layers
    assert R.kv_bytes_mean(spec, 100, 1) == per * 101
    assert R.kv_bytes_mean(spec, 0, 4) == per * (1 + 2 + 3 + 4) // 4
    # a sliding layer reads at most its window; MLA caches the latent + rope key
    gqa = NS(kind="gqa", num_kv_heads=2, head_dim=8, kv_lora_rank=0, qk_rope_head_dim=0)
    mla = NS(kind="mla", num_kv_heads=4, head_dim=24, kv_lora_rank=16, qk_rope_head_dim=8)
    sp = NS(layers=[NS(attn=gqa, sliding_window=7), NS(attn=gqa, sliding_window=None),
                    NS(attn=mla, sliding_window=None)])
    assert R.kv_bytes_mean(sp, 99, 1, elem_bytes=2) == 2 * (32 * 7 + 32 * 100 + 24 * 100)


def test_quantized_linear_table_matches_converter():
    from kie_moe.models import quantizable
    from kie_moe.models.registry import adapter_for
    from kie_moe.models.synth import build
    from kie_moe.models.presets import tiny
    from kie_moe.synthetic import is_quantized_linear
    for arch in ("qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b", "llama-3.2-1b"):
        _, spec = build(tiny(arch))
        for ref in adapter_for(spec.family).tensor_refs(spec):
            assert is_quantized_linear(ref.name) == quantizable.is_linear(ref.name), ref.name


def test_synthetic_prefill_fills_known_caches():
    class Graphish:
        name = "graph"
        caches = [(torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)), torch.zeros(8, 6)]
    be = Graphish()
    B.synthetic_prefill(be)(list(range(5)))
    for t in (be.caches[0][0], be.caches[0][1], be.caches[1]):
        assert t[:5].abs().sum() > 0 and t[5:].abs().sum() == 0

    class Ref:
        name = "reference"
    assert B.synthetic_prefill(Ref()) is None


def test_bench_user_errors(tmp_path, capsys):
    assert main(["bench", str(tmp_path), *RUN]) == 2
    assert f"{tmp_path}: not a checkpoint directory" in capsys.readouterr().err
    assert main(["bench", "no-such-arch", *RUN]) == 2
    assert "neither a checkpoint directory nor a preset" in capsys.readouterr().err
    assert main(["bench", "--all", "llama-3.2-1b", *RUN]) == 2
    assert main(["bench", "qwen3-30b-a3b", "--tiny", *RUN[:2], "--new-tokens", "1"]) == 2
    assert "--new-tokens must be at least 2" in capsys.readouterr().err


def test_preview_tiny_and_devices(capsys):
    rc, res = run_json(capsys, ["preview", "--tiny", *RUN, "--json"])
    assert rc == 0
    r, rf = res["row"], res["roofline"]
    check_row(r, 2)
    assert res["published"]["tok_per_s"] == 2100 and res["published"]["devices"] == 8
    assert r["backend_label"].startswith("reference (fallback: monokernel")      # labelled, never passed off
    ideal = rf["ideal_tok_per_s"]
    assert math.isclose(ideal["8"], 8 * ideal["1"])
    assert math.isclose(ideal["1"], rf["bandwidth_gbps"] * 1e9 / r["bytes_per_token"])
    if not torch.cuda.is_available():        # more devices than visible: one line, nothing run
        assert main(["preview", "--devices", "2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--devices 2: only 0 GPUs visible" in err
    assert main(["preview", "--devices", "2", "--device", "cpu"]) == 2      # not --tiny: no CPU preview
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["preview"]) == 2 or torch.cuda.is_available()


def test_bench_all_records_every_row(monkeypatch, capsys):
    # the suite's loop on CPU: one synthetic model per arch, wrapped per scheme; a failing row is recorded, not fatal
    monkeypatch.setattr(B, "SUITE", (("llama-3.2-1b", "bf16", ("reference",)),
                                     ("qwen3-30b-a3b", "bf16", ("reference",)),
                                     ("qwen3-30b-a3b", "nvfp4", ("reference", "no-such-backend"))))
    rc, res = run_json(capsys, ["bench", "--all", "--tiny", *RUN, "--json"])
    assert rc == 1
    rows = res["rows"]
    assert [(r["model"], r["scheme"], r["backend"]) for r in rows] == [
        ("llama-3.2-1b (tiny)", "bf16", "reference"), ("qwen3-30b-a3b (tiny)", "bf16", "reference"),
        ("qwen3-30b-a3b (tiny)", "nvfp4", "reference"), ("qwen3-30b-a3b (tiny)", "nvfp4", "no-such-backend")]
    for r in rows[:3]:
        check_row(r, 2)
    assert "unknown backend 'no-such-backend'" in rows[3]["error"]
    # --archs runs only those presets' rows of the matrix; a name outside it is a user error
    rc, res = run_json(capsys, ["bench", "--all", "--archs", "llama-3.2-1b", "--tiny", *RUN, "--json"])
    assert rc == 0 and [(r["model"], r["backend"]) for r in res["rows"]] == [("llama-3.2-1b (tiny)", "reference")]
    assert main(["bench", "--all", "--archs", "mixtral-8x7b", "--tiny", *RUN]) == 2
    assert "none of these is in the --all matrix" in capsys.readouterr().err


def test_bench_all_out_holds_every_row_measured_so_far(monkeypatch, capsys, tmp_path):
    # a suite cut short by a time limit keeps its rows: --out is rewritten after each row, before the next starts
    monkeypatch.setattr(B, "SUITE", (("llama-3.2-1b", "bf16", ("reference",)),
                                     ("qwen3-30b-a3b", "bf16", ("reference",))))
    out = tmp_path / "bench.json"
    seen = []
    real_bench_row = B.bench_row

    def bench_row(src, *a, **k):                 # what the file holds when the next row starts
        seen.append(len(json.loads(out.read_text())["rows"]) if out.exists() else 0)
        return real_bench_row(src, *a, **k)
    monkeypatch.setattr(B, "bench_row", bench_row)
    rc, res = run_json(capsys, ["bench", "--all", "--tiny", *RUN, "--json", "--out", str(out)])
    assert rc == 0 and seen == [0, 1]
    assert json.loads(out.read_text())["rows"] == res["rows"]


# ---- --devices N on CPU: N worker processes (kie_moe/launch.py, ranks.py), rank 0 writes the result -----------------

def test_bench_two_cpu_ranks_same_tokens(tmp_path, capsys):
    """Tensor + expert parallel reference ranks over KCCL (a HostHeap in /dev/shm) give the single-device greedy
    tokens of a tiny MoE; the row names the path and its roofline is two devices'."""
    args = ["bench", "qwen3-30b-a3b", "--tiny", "--device", "cpu", "--new-tokens", "8", "--runs", "1",
            "--probe-mb", "16"]
    rc, one = run_json(capsys, [*args, "--json"])
    assert rc == 0
    out = tmp_path / "two.json"
    assert main([*args, "--devices", "2", "--out", str(out)]) == 0
    two = json.loads(out.read_text())
    (r1,), (r2,) = one["rows"], two["rows"]
    check_row(r1, 1)
    check_row(r2, 1)
    assert (r1["backend"], r1["devices"]) == ("reference", 1)
    assert (r2["backend"], r2["devices"]) == ("tp-reference+kccl", 2)
    assert "2 CPU processes" in r2["parallel"] and "KCCL HostHeap" in r2["parallel"]
    assert "nominal" in r2["backend_note"]          # CPU ranks share one memory system: said, not hidden
    assert r2["token_ids"] == r1["token_ids"] and len(set(r1["token_ids"])) > 2
    assert r2["bytes_per_token"] == r1["bytes_per_token"]
    assert two["env"]["command"].endswith("--devices 2 --out " + str(out))


def test_preview_two_cpu_ranks(tmp_path, capsys):
    """kie preview --devices 2 on CPU: Laneformer DTP lane ranks over KCCL, labelled as the monokernel's fallback,
    the same greedy tokens as one device, the roofline of two devices."""
    args = ["preview", "--tiny", "--device", "cpu", "--new-tokens", "6", "--runs", "1", "--probe-mb", "16"]
    rc, one = run_json(capsys, [*args, "--json"])
    assert rc == 0
    out = tmp_path / "preview.json"
    assert main([*args, "--devices", "2", "--out", str(out)]) == 0
    two = json.loads(out.read_text())
    r, rf = two["row"], two["roofline"]
    check_row(r, 1)
    assert two["devices"] == r["devices"] == 2 and r["backend"] == "dtp-reference+kccl"
    assert r["backend_label"].startswith("dtp-reference+kccl (fallback: monokernel") and "CUDA" in r["backend_label"]
    assert "2 of 4 lanes each" in r["parallel"]
    ideal = rf["ideal_tok_per_s"]
    assert math.isclose(ideal["2"], 2 * ideal["1"]) and math.isclose(ideal["8"], 8 * ideal["1"])
    assert math.isclose(rf["measured_pct_of_ideal"], 100 * r["tok_per_s"] / ideal["2"])
    assert r["token_ids"] == one["row"]["token_ids"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["monokernel", "reference"])
def test_gpu_one_device_through_the_worker_path(backend, tmp_path, capsys, monkeypatch):
    """One GPU, KIE_LAUNCH_WORKERS=1: `kie bench --devices 1` runs the N-device path (a worker process, an NCCL group
    + gloo control group; TpRank over torch symmetric memory, or the reference rank over GpuHeap) and gives the
    tokens of the same code in this process: the one-rank sharded monokernel (in-kernel prefill, as TpRank), or the
    single-device reference backend."""
    from kie_moe.engine import ReferenceBackend
    from kie_moe.kernels.monokernel.shard import ShardedMonokernel
    from kie_moe.sampling import SamplingParams
    from kie_moe.synthetic import open_model
    dev = torch.device("cuda", 0)
    src = open_model("qwen3-30b-a3b", dev, tiny=True)
    ids = B.prompt_ids(src.model.spec.vocab_size, 32)
    be = ShardedMonokernel(src.model, 1, dev) if backend == "monokernel" else ReferenceBackend(src.model, dev)
    want = list(be.generate(ids, SamplingParams(max_new_tokens=8, ignore_eos=True), set()))
    del be, src
    monkeypatch.setenv("KIE_LAUNCH_WORKERS", "1")
    out = tmp_path / "w.json"
    assert main(["bench", "qwen3-30b-a3b", "--tiny", "--backend", backend, "--new-tokens", "8", "--runs", "1",
                 "--out", str(out)]) == 0
    (r,) = json.loads(out.read_text())["rows"]
    check_row(r, 1)
    assert r["backend"] == {"monokernel": "monokernel-tp", "reference": "tp-reference+kccl"}[backend]
    assert r["devices"] == 1 and "1 GPU" in r["parallel"]
    assert r["token_ids"] == want


def test_a_git_archive_export_names_its_commit(tmp_path):
    """Device machines get the tree through `git archive` (no .git): results must still name the commit."""
    import os
    import subprocess
    import tarfile
    repo = os.path.dirname(os.path.dirname(os.path.abspath(R.__file__)))
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.fail(f"{repo} is not a git checkout: this test needs the repository, as CI's fresh clone is")
    tar = tmp_path / "head.tar"
    subprocess.run(["git", "-C", repo, "archive", "-o", str(tar), "HEAD", "kie_moe/ARCHIVE_COMMIT"], check=True)
    with tarfile.open(tar) as t:
        t.extractall(tmp_path / "x", filter="data")
    assert R.archive_commit(str(tmp_path / "x" / "kie_moe")) == head.stdout.strip()[:12]
    assert R.archive_commit(os.path.dirname(R.__file__)) is None          # a checkout: rev-parse answers instead
    assert R.archive_commit(str(tmp_path)) is None                        # no file at all


def test_auto_backend_moves_past_a_model_the_monokernel_does_not_support(monkeypatch, capsys):
    # tiny qwen3-30b-a3b in nvfp4: the experts' down_proj (in = 24, not a multiple of 16) stays float, so the
    # expert Linears mix formats, which the monokernel planner refuses (the embedded demo model's fp8-block
    # conversion on the H200 hit this). --backend monokernel says so; auto takes the next backend and says why.
    from kie_moe import engine
    from kie_moe.synthetic import open_model
    cpu = torch.device("cpu")
    monkeypatch.setitem(engine.AUTO_ORDER, "cpu", ("monokernel", "reference"))   # the CUDA order, runnable here
    src = open_model("qwen3-30b-a3b", cpu, scheme="nvfp4", tiny=True)
    with pytest.raises(NotImplementedError, match="mix formats"):
        engine.make_backend("monokernel", src.model, cpu)
    be = engine.make_backend("auto", src.model, cpu)
    assert be.name == "reference"
    assert be.auto_note.startswith("auto skipped monokernel: ") and "mix formats" in be.auto_note
    assert "backend auto: monokernel does not support this model" in capsys.readouterr().err
    row = B.bench_row(src, "auto", cpu, {"gbps": 1.0}, prompt_len=4, new_tokens=3, runs=1)
    assert row["backend"] == "reference" and row["backend_note"].startswith("auto skipped monokernel")
    # a model it supports gets the monokernel
    ok = open_model("qwen3-30b-a3b", cpu, tiny=True)
    assert engine.make_backend("auto", ok.model, cpu).name == "monokernel"


def test_auto_backend_on_cuda_takes_the_graph_backend_and_the_monokernel_for_the_laneformer(monkeypatch, capsys):
    # The CUDA order run here (the graph backend under TRITON_INTERPRET=1, as CI runs its kernels): a MoE model gets
    # the graph backend (2-3x the monokernel's decode rate today); the Laneformer, which the graph backend refuses
    # as a family, gets the monokernel without a warning, the reason kept in auto_note.
    from kie_moe import engine
    from kie_moe.models.errors import InputError, Unsupported
    from kie_moe.synthetic import open_model
    assert engine.AUTO_ORDER["cuda"][0] == "graph"
    cpu = torch.device("cpu")
    monkeypatch.setitem(engine.AUTO_ORDER, "cpu", engine.AUTO_ORDER["cuda"])
    moe = open_model("qwen3-30b-a3b", cpu, tiny=True)
    assert engine.make_backend("auto", moe.model, cpu).name == "graph"
    lane = open_model("laneformer-2b", cpu, tiny=True)
    with pytest.raises(Unsupported, match="laneformer family") as e:
        engine.make_backend("graph", lane.model, cpu)
    assert isinstance(e.value, InputError)          # a named --backend graph still reports it as a user error
    be = engine.make_backend("auto", lane.model, cpu)
    assert be.name == "monokernel" and be.auto_note.startswith("auto skipped graph: ")
    assert "backend auto" not in capsys.readouterr().err


def test_quantizing_store_shares_nvfp4_globals_as_convert_writes(tmp_path):
    """QuantizingStore (kie bench ARCH --scheme nvfp4) gives fused partners (q/k/v, an expert's gate/up) the global
    scale kie convert writes for them (the graph backend can then fuse q/k/v into one launch); other schemes and
    partner-less Linears keep their own."""
    import glob

    from safetensors.torch import load_file

    from kie_moe.models.registry import load_model
    from kie_moe.synthetic import QuantizingStore
    from tests.models.hf_tiny import make_checkpoint
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    make_checkpoint("qwen3_moe_mixed", src)
    assert main(["convert", src, dst, "--scheme", "nvfp4", "--quiet"]) == 0
    written = {}
    for f in glob.glob(f"{dst}/*.safetensors"):
        written.update(load_file(f))
    store = QuantizingStore(load_model(src).weights, "nvfp4")
    pairs = {"layers.0.attn.q": "model.layers.0.self_attn.q_proj", "layers.0.attn.v": "model.layers.0.self_attn.v_proj",
             "layers.1.moe.experts.3.gate": "model.layers.1.mlp.experts.3.gate_proj",
             "layers.1.moe.experts.3.up": "model.layers.1.mlp.experts.3.up_proj"}
    for canon, hf in pairs.items():
        got = store.quantized_tensor(canon).tensors["weight_global_scale"]
        assert torch.equal(got.reshape(-1), written[f"{hf}.weight_global_scale"].reshape(-1)), canon
    g = lambda n: store.quantized_tensor(n).tensors["weight_global_scale"]  # noqa: E731
    assert torch.equal(g("layers.0.attn.q"), g("layers.0.attn.k"))
    assert not torch.equal(g("layers.0.attn.q"), g("layers.0.attn.o"))      # o has no partner
    assert "weight_global_scale" not in QuantizingStore(load_model(src).weights, "mxfp4").quantized_tensor(
        "layers.0.attn.q").tensors


def test_bench_times_filtered_sampling_on_the_monokernel(capsys):
    """--temperature / --top-k / --top-p: the timed generations sample (seed 0, so runs replay), the row says how,
    and the monokernel runs its top-k / top-p variant; the row counts the draws that fell back to plain temperature
    sampling (what the sampler counts replaying the run); bad combinations are refused before any work."""
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend
    from kie_moe.sampling import SamplingParams
    from kie_moe.synthetic import open_model
    argv = ["bench", "qwen3-30b-a3b", "--tiny", "--backend", "monokernel", "--device", "cpu", "--new-tokens", "3",
            "--runs", "1", "--probe-mb", "16", "--temperature", "1.5", "--top-p", "0.95", "--json"]
    rc, res = run_json(capsys, argv)
    assert rc == 0
    (r,) = res["rows"]
    check_row(r, 1)
    smp = r["sampling"]
    assert r["backend"] == "monokernel" and {k: smp[k] for k in ("temperature", "top_k", "top_p", "draws")} \
        == {"temperature": 1.5, "top_k": 0, "top_p": 0.95, "draws": 3}
    be = MonokernelBackend(open_model("qwen3-30b-a3b", torch.device("cpu"), tiny=True).model, "cpu")
    p = SamplingParams(max_new_tokens=3, temperature=1.5, top_p=0.95, seed=0, ignore_eos=True)
    assert list(be.generate(B.prompt_ids(be.spec.vocab_size, 32, 0), p, set())) \
        == r["token_ids"] and be.last_launch["filtered"]
    assert smp["fallback_draws"] == be.sampling_fallbacks()
    # interpreted, every token arrives at the launch's end: tok/s is over the whole generation, and the row says so
    assert "interpreted" in r["backend_note"] and 2.7 < r["tok_per_s"] * r["ttft_s"] <= 3.0 + 1e-9
    for extra, needle in [(["--top-k", "5"], "need --temperature > 0"), (["--temperature", "nan"], "temperature"),
                          (["--temperature", "1", "--top-p", "0"], "top_p")]:
        assert main(["bench", "qwen3-30b-a3b", "--tiny", *RUN, *extra]) == 2
        assert needle in capsys.readouterr().err

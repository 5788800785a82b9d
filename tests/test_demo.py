"""`kie demo` on the shipped model (kie_moe/assets/demo-moe), in a fast configuration: the table is well-formed,
fp8 predicts what bf16 predicts on held-out text, the cache is reused, the CLI wiring works, and the model's own
tokenizer round-trips Python source."""
from __future__ import annotations

import json
import math
import os

import pytest

from kie_moe import cli, demo
from kie_moe.tokenizer import Tokenizer

MODEL = demo.DEFAULT_MODEL
FAST = dict(max_new_tokens=8, windows=2, window_len=128)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("demo-cache"))


@pytest.fixture(scope="module")
def result(cache):
    logs, streamed = [], []
    res = demo.run_demo(out=cache, device="cpu", on_text=streamed.append, log=logs.append, **FAST)
    return res, logs, "".join(streamed)


def test_shipped_model_files():
    files = sorted(os.listdir(MODEL))
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "TRAINING.md", "heldout.txt"):
        assert f in files, f"{MODEL}: {f} missing"
    # what comes back from the GPU run: at most 8 files of at most 16 MiB
    assert len(files) <= 8
    assert all(os.path.getsize(os.path.join(MODEL, f)) <= 16 * 2**20 for f in files)
    assert json.load(open(os.path.join(MODEL, "config.json")))["model_type"] == "qwen3_moe"


def test_table_well_formed(result):
    res, logs, streamed = result
    assert [r.scheme for r in res.rows] == ["bf16", "fp8", "nvfp4"]
    assert res.device == "cpu" and res.backend == "reference"
    assert res.eval_tokens == FAST["windows"] * FAST["window_len"]
    vocab = json.load(open(os.path.join(MODEL, "config.json")))["vocab_size"]
    for r in res.rows:
        for v in (r.tokens_per_s, r.top1, r.kl, r.ppl):
            assert isinstance(v, float) and math.isfinite(v), (r.scheme, v)
        assert r.bytes > 0 and r.tokens_per_s > 0
        assert 0.0 <= r.top1 <= 1.0 and r.kl >= 0.0
        assert 1.0 < r.ppl < vocab  # better than uniform: the model learned something
        assert 1 <= r.n_tokens <= FAST["max_new_tokens"]
        assert f"[{r.scheme}] {demo.PROMPT}" in streamed
    bf16, fp8, nvfp4 = res.rows
    assert bf16.top1 == 1.0 and bf16.kl == pytest.approx(0.0, abs=1e-6)
    assert bf16.bytes > fp8.bytes > nvfp4.bytes  # scales included, 8-bit and 4-bit weights are smaller
    # the printed table: a header, a rule, one row per scheme whose number cells parse, then the caption
    lines = demo.plain_table(res).splitlines()
    assert lines[0].split()[0] == "scheme" and len(lines) == 2 + len(res.rows) + 1
    for line, r in zip(lines[2:], res.rows):
        cells = line.split()
        assert cells[0] == r.scheme and len(cells) == len(demo.COLUMNS)
        assert all(math.isfinite(float(c)) for c in cells[1:])
    assert sum("converted to" in m for m in logs) == 2


def test_fp8_agrees_with_bf16(result):
    bf16, fp8, nvfp4 = result[0].rows
    # Bounds from what the shipped model (retrained 2026-12-03, see its TRAINING.md) measures on these 256 tokens on
    # CPU: fp8 top-1 0.965 (247 of 256), KL 0.0027, ppl +0.40%; nvfp4 0.879 / 0.038 / +3.1% (whole held-out text,
    # H200 gate: fp8 0.9765 / 0.0025 / +0.21%, nvfp4 0.9142 / 0.0250 / +2.10%;
    # benchmarks/results/2026-12-03-demo-quality.md section 6). Margins: fp8 3x on KL, ~4x on the ppl change, 6 more
    # flipped tokens on top-1; nvfp4 2x on KL and ppl change, 15 more flipped tokens. They still trip on an fp8
    # converter whose error is twice fp8's (Gaussian noise of 2 x 2.6% on the same modules: top-1 0.934, KL 0.0095
    # here) and on one that writes 4-bit-sized error into fp8. The 99% fp8 top-1 target is not met (0.9765)
    # and is reported as such, not tested here.
    assert fp8.top1 >= 0.94, f"fp8 top-1 agreement with bf16 only {fp8.top1:.3f}"
    assert fp8.kl < 0.008
    assert abs(fp8.ppl / bf16.ppl - 1) < 0.015
    assert fp8.kl <= nvfp4.kl  # 4-bit weights lose more than 8-bit ones
    assert nvfp4.top1 >= 0.82 and nvfp4.kl < 0.08 and abs(nvfp4.ppl / bf16.ppl - 1) < 0.06
    # greedy text of fp8 starts like bf16's (the first token is the one most likely to agree)
    assert fp8.text[:1] == bf16.text[:1]


def test_cache_reused(result, cache):
    logs = []
    fp = demo.fingerprint(MODEL)
    path = demo.converted(MODEL, cache, "fp8", fp, logs.append)
    assert path == result[0].rows[1].path and logs == []


def test_cli_json_and_errors(result, cache, capsys, tmp_path):
    rc = cli.main(["demo", "--out", cache, "--device", "cpu", "--schemes", "fp8", "--max-new-tokens", "4",
                   "--windows", "1", "--window-len", "64", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    d = json.loads(out.out)
    assert [r["scheme"] for r in d["rows"]] == ["bf16", "fp8"] and d["eval_tokens"] == 64
    assert "converted to" not in out.err  # the module fixture's conversion is reused
    rc = cli.main(["demo", "--model", str(tmp_path / "nope"), "--out", cache])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "nope" in err
    rc = cli.main(["demo", "--out", cache, "--schemes", "fp7"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "fp7" in err


def test_tokenizer_round_trips_python():
    tok = Tokenizer(MODEL)
    samples = [open(demo.__file__, encoding="utf-8").read(), open(cli.__file__, encoding="utf-8").read(),
               "def f(x):\n\treturn x  # tab, two spaces, unicode: café ✓ 数\r\n\n\n    pass   \n", ""]
    for src in samples:
        ids = tok.encode(src)
        assert ids[0] == tok.tok.bos_token_id  # encode prepends <|bos|>, as every training document starts
        assert tok.decode(ids) == src
    assert len(tok.encode(samples[0])) < len(samples[0].encode()) / 2  # BPE compresses Python source
    assert tok.eos_token_id is not None
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "hi" in tok.decode(chat) and len(chat) > 3  # role markers around the message


def test_cli_gptq_rows(result, cache, capsys):
    """kie demo --gptq: rows labelled SCHEME+gptq from a GPTQ conversion cached apart from the round-to-nearest one
    (and reused on the next run); over the same held-out windows it is closer to bf16 than round to nearest."""
    args = ["demo", "--out", cache, "--device", "cpu", "--schemes", "fp8", "--max-new-tokens", "8", "--windows", "2",
            "--window-len", "128", "--json", "--gptq", "--calib-tokens", "1024"]
    rc = cli.main(args)
    out = capsys.readouterr()
    assert rc == 0, out.err
    d = json.loads(out.out)
    assert [r["scheme"] for r in d["rows"]] == ["bf16", "fp8+gptq"]
    assert "converted to fp8 by GPTQ" in out.err and "calib.txt (4 windows of 256" in out.err
    rtn = next(r for r in result[0].rows if r.scheme == "fp8")
    assert d["rows"][1]["path"] != rtn.path and "-gptq-" in d["rows"][1]["path"]
    assert d["rows"][1]["kl"] < rtn.kl, (d["rows"][1]["kl"], rtn.kl)
    assert cli.main(args) == 0 and "converted to" not in capsys.readouterr().err
    assert cli.main(["demo", "--out", cache, "--calib", "x.txt"]) == 2
    assert "add --gptq" in capsys.readouterr().err


def test_generate_takes_demo_as_the_embedded_model(capsys):
    """`kie generate demo` decodes the shipped model, as `kie bench demo` / `kie sweep demo` name it: the same
    greedy tokens as its directory's path gives, and those are the reference decoder's."""
    import torch
    from kie_moe.models.reference import ReferenceDecoder
    from kie_moe.models.registry import load_model
    outs = []
    for name in ("demo", MODEL):
        rc = cli.main(["generate", name, "--device", "cpu", "--backend", "reference", "--prompt-ids", "5,6,7",
                       "--max-new-tokens", "3", "--ignore-eos", "--json"])
        out = capsys.readouterr().out
        assert rc == 0, out
        outs.append(json.loads(out.strip().splitlines()[-1]))
    ids = [o["token_ids"] for o in outs]
    m = load_model(MODEL)
    dec = ReferenceDecoder(m.spec, m.weights)
    logits, want = dec.forward(torch.tensor([5, 6, 7]))[-1], []
    for _ in range(3):
        want.append(int(torch.argmax(logits)))
        logits = dec.forward(torch.tensor([want[-1]]))[-1]
    assert ids[0] == ids[1] == want

"""Held-out quality data (kie_moe.heldout) and the perplexity that kie sweep and kie demo compute from it, on the
shipped demo model, against HF transformers' own Qwen3MoeForCausalLM.

What these would have caught (2026-12-03, on the demo model shipped before the retraining): kie sweep scored the
first 512 tokens of heldout.txt (one docstring; ppl 2632) while kie demo scored 4 windows spread over the file (ppl
210): "the same held-out text" gave two numbers 12x apart. Each command's arithmetic was right (HF gives 2631.78 on the sweep's old windows too); the data were not
the same.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kie_moe import demo, heldout as H, sweep as S

MODEL = demo.DEFAULT_MODEL
N, T = 3, 48            # small: the reference decoder loops over tokens in its MoE


def test_windows_spread_over_the_whole_text():
    ids = list(range(1000))
    w = H.windows(ids, 5, 99)
    assert w.shape == (5, 100)
    assert w[0, 0] == 0 and w[-1, -1] == 999                        # first at the start, last at the end
    starts = w[:, 0].tolist()
    assert all(b - a >= 100 for a, b in zip(starts, starts[1:]))     # no overlap
    for row in w:                                                     # contiguous slices of the text
        assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 100))
    assert H.windows(ids, 0, 99).shape == (10, 100)                  # 0: every window that fits, still in range
    assert H.windows(ids, 50, 99).shape == (10, 100)                 # more than fit: as many as fit
    assert H.windows(ids, 10, 99)[-1, -1] == 999
    assert torch.equal(H.windows(ids, 1, 99)[0], torch.arange(100))


def _hf_model():
    from transformers import Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def _expected_windows(n: int, t: int) -> torch.Tensor:
    """The documented windows, built here from the spec with HF's tokenizer: text ids without special tokens,
    n windows of t + 1 starting at round(i * (L - t - 1) / (n - 1))."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(MODEL)
    text = open(H.heldout_file(MODEL), encoding="utf-8").read()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    span = len(ids) - (t + 1)
    return torch.tensor([ids[round(i * span / (n - 1)):][:t + 1] for i in range(n)])


@pytest.fixture(scope="module")
def hf_ppl() -> tuple[torch.Tensor, float]:
    wins = _expected_windows(N, T)
    assert not (wins == 1).any()  # no <|bos|> (id 1) inserted: windows start mid-document, as in training
    with torch.no_grad():
        logits = _hf_model()(input_ids=wins[:, :-1]).logits.float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), wins[:, 1:].reshape(-1))
    return wins, math.exp(float(nll))


def test_sweep_perplexity_matches_hf_transformers(hf_ppl, tmp_path):
    wins, want = hf_ppl
    from kie_moe.models.registry import load_model
    spec = load_model(MODEL).spec
    got_w, label = S.token_windows(MODEL, spec, None, T, N * T)
    assert torch.equal(got_w, wins), "kie sweep scores other tokens than the documented windows"
    assert label.startswith("held-out text ") and f"({N * T} tokens, windows of {T} spread" in label
    res = S.run(MODEL, ["bf16"], str(tmp_path), device="cpu", window=T, max_tokens=N * T, prompt_len=4,
                new_tokens=2, runs=1, probe_bytes=1 << 20, progress=False)
    row = res["rows"][0]
    assert "error" not in row, row
    assert row["quality_tokens"] == N * T and res["quality_dtype"] == "float32"
    assert row["ppl"] == pytest.approx(want, rel=1e-4) and row["ppl_bf16"] == row["ppl"]


def test_demo_scores_the_same_tokens_as_sweep(hf_ppl, tmp_path):
    wins, want = hf_ppl
    res = demo.run_demo(out=str(tmp_path), device="cpu", backend="reference", schemes=(), max_new_tokens=1,
                        windows=N, window_len=T)
    assert res.eval_tokens == N * T
    assert res.rows[0].ppl == pytest.approx(want, rel=1e-4)


def test_defaults_agree():
    """kie demo's and kie sweep's default windows are the same ones (same count, same length)."""
    import inspect
    from kie_moe.cli import build_parser
    p = build_parser()
    d = p.parse_args(["demo"])
    s = p.parse_args(["sweep", "demo", "--out", "x"])
    assert (d.windows, d.window_len) == (H.DEFAULT_WINDOWS, H.DEFAULT_WINDOW_LEN)
    assert s.window == H.DEFAULT_WINDOW_LEN and s.max_tokens is None
    assert inspect.signature(demo.run_demo).parameters["windows"].default == H.DEFAULT_WINDOWS
    from kie_moe.models.registry import load_model
    spec = load_model(MODEL).spec
    w, _ = S.token_windows(MODEL, spec, None, s.window, s.max_tokens)
    assert w.shape == (H.DEFAULT_WINDOWS, H.DEFAULT_WINDOW_LEN + 1)

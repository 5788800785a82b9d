"""GPTQ (quant/gptq.py, models/calibrate.py, kie convert --gptq) against its oracles: round-to-nearest
(quant.schemes.quantize) where GPTQ must reduce to it, the layer-output error ||X W^T - X Q^T|| it minimises,
compressed-tensors' own decompressors for what it writes, and the reference decoder's logits for the model it
produces."""
from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor

from kie_moe import cli
from kie_moe.heldout import CALIB, calibration_windows, gptq_options
from kie_moe.models.calibrate import GptqOptions, calibrate_gptq
from kie_moe.models.errors import InputError
from kie_moe.models.loader import read_config
from kie_moe.models.quantizable import convert_checkpoint, is_linear
from kie_moe.models.registry import load_model
from kie_moe.quant import ct_scheme, quantize
from kie_moe.quant.gptq import HessianAccumulator, gptq_quantize

from quant_ckpt_helpers import SCHEME_NAMES, to_v5_fused_experts
from test_convert import decoder, qsource, run_cli

# odd rows; `in` a multiple of 32 (the fp4 group) but not of the 128-column GPTQ block or the fp8 block
OUT, IN = 37, 160


def _weight(seed=0, out=OUT, n=IN):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, n, generator=g) * (1 + torch.rand(out, 1, generator=g))


def _correlated_inputs(seed=1, rows=2048, n=IN):
    """Inputs with a few strong shared directions and per-channel scales, like a transformer's activations."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(8, n, generator=g)
    x = torch.randn(rows, 8, generator=g) @ basis * 2 + 0.3 * torch.randn(rows, n, generator=g)
    return x * torch.exp(torch.randn(n, generator=g) * 0.5)


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_diagonal_hessian_gives_round_to_nearest_bit_for_bit(scheme):
    """With uncorrelated inputs (diagonal H) no rounding error is carried to any other column, so every code is
    the nearest one: GPTQ == RTN exactly, also with actorder permuting the columns by a diagonal that varies."""
    w = _weight()
    h = torch.diag(torch.rand(IN, generator=torch.Generator().manual_seed(3)) + 0.1)
    rtn = quantize(w, scheme, name="w")
    for actorder in (True, False):
        q = gptq_quantize(w, h, scheme, name="w", actorder=actorder)
        assert q.tensors.keys() == rtn.tensors.keys()
        for k in rtn.tensors:
            assert torch.equal(q.tensors[k], rtn.tensors[k]), (scheme, actorder, k)


def _textbook_gptq(w, h, scheme, damp, actorder):
    """Frantar et al. 2022 as first written (OBQ's update, float64): round one column, spread its error over the
    columns still to come through H^-1, then remove that column from H^-1; no Cholesky factor, no lazy blocks.
    -> the stored codes. Independent of quant/gptq.py but for the scheme's own scales and rounding."""
    from kie_moe.quant.schemes import get_scheme
    sch = get_scheme(scheme)
    rtn = quantize(w, sch, name="w")
    out, n = w.shape
    step = sch._dequantize({**rtn.tensors, sch.weight_name: sch._store(torch.ones(out, n))}, (out, n)).double()
    hh = h.double()
    hinv = torch.linalg.inv(hh + damp * float(torch.diagonal(hh).mean()) * torch.eye(n, dtype=torch.float64))
    order = torch.argsort(torch.diagonal(hh), descending=True, stable=True).tolist() if actorder else list(range(n))
    wk = w.double().clone()
    z = torch.empty_like(wk)
    for k, q in enumerate(order):
        z[:, q] = wk[:, q] / step[:, q]
        err = (wk[:, q] - sch._round(z[:, q].float()).double() * step[:, q]) / hinv[q, q]
        rest = order[k + 1:]
        wk[:, rest] -= err[:, None] * hinv[q, rest][None, :]
        hinv = hinv - hinv[:, q:q + 1] @ hinv[q:q + 1, :] / hinv[q, q]
    return sch.weight_name, sch._store(z.float())


@pytest.mark.parametrize("actorder", [True, False])
@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_gptq_codes_equal_the_textbook_algorithm(scheme, actorder):
    """Our GPTQ (float32, inverse Cholesky factor, 128-column lazy blocks) chooses the codes the paper's column-by-
    column algorithm in float64 chooses (measured: all equal but one near tie of 5,920 in fp8-block input order)."""
    from kie_moe.quant.gptq import DEFAULT_DAMP
    w, x = _weight(), _correlated_inputs()
    acc = HessianAccumulator(IN)
    acc.add(x)
    q = gptq_quantize(w, acc.value, scheme, name="w", actorder=actorder)
    key, want = _textbook_gptq(w, acc.value, scheme, DEFAULT_DAMP, actorder)
    same = (q.tensors[key].view(torch.uint8) == want.view(torch.uint8)).float().mean()
    assert same >= 0.999, (scheme, actorder, float(same))


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_gptq_lowers_the_layer_output_error(scheme):
    """On correlated inputs GPTQ's layer output error is well below RTN's (the paper's claim; measured here 0.35-0.6x
    of RTN's squared error depending on the format); scales are RTN's, bit for bit, only codes change."""
    w, x = _weight(), _correlated_inputs()
    acc = HessianAccumulator(IN)
    for part in x.split(500):                       # the running mean over uneven batches is X^T X / N
        acc.add(part)
    torch.testing.assert_close(acc.value, x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)
    rtn = quantize(w, scheme, name="w")
    q = gptq_quantize(w, acc.value, scheme, name="w")

    def err(t):
        return float(((x @ (w - t.dequantize(torch.float32)).t()) ** 2).mean())
    assert err(q) < 0.75 * err(rtn), (scheme, err(q), err(rtn))
    for k in rtn.tensors:
        if "scale" in k:
            assert torch.equal(q.tensors[k], rtn.tensors[k]), (scheme, k)
    codes = "weight" if "weight" in rtn.tensors else "weight_packed"
    assert not torch.equal(q.tensors[codes], rtn.tensors[codes])
    # the codes are the format's: compressed-tensors' own decompressor reads them to our values
    cts = ct_scheme(scheme)
    comp = BaseCompressor.get_value_from_registry(cts.format)
    dec = comp.decompress(dict(q.tensors), cts)["weight"]
    assert torch.equal(dec, q.dequantize(dec.dtype))


def test_rows_are_independent_and_dead_columns_round_to_nearest():
    """A row's codes depend on that row only (so gate and up quantized together or apart agree), and a column no
    input ever reached (H row / column 0: an unused channel) is rounded to nearest."""
    w, x = _weight(out=40), _correlated_inputs()
    x[:, 7] = 0
    h = x.t() @ x / x.shape[0]
    whole = gptq_quantize(w, h, "fp8", name="w")
    top, bottom = gptq_quantize(w[:17], h, "fp8", name="w"), gptq_quantize(w[17:], h, "fp8", name="w")
    assert torch.equal(whole.tensors["weight"].view(torch.uint8),
                       torch.cat([top.tensors["weight"], bottom.tensors["weight"]]).view(torch.uint8))
    rtn = quantize(w, "fp8", name="w")
    # column 7 is processed with no error carried into it only if it comes first; with actorder it is last
    assert torch.equal(whole.tensors["weight"][:, 7].view(torch.uint8), rtn.tensors["weight"][:, 7].view(torch.uint8))


def test_bad_hessians_name_the_tensor():
    w = _weight()
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q: Hessian of shape \(3, 3\) does not match in=160"):
        gptq_quantize(w, torch.eye(3), "fp8", name="layers.0.attn.q")
    h = torch.eye(IN)
    h[2, 2] = float("nan")
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q: calibration Hessian has NaN"):
        gptq_quantize(w, h, "fp8", name="layers.0.attn.q")
    with pytest.raises(ValueError, match="one \\[out, in\\] weight"):
        gptq_quantize(w.reshape(1, OUT, IN), torch.eye(IN), "fp8", name="stack")
    with pytest.raises(ValueError, match="inputs of width 5"):
        HessianAccumulator(IN).add(torch.ones(2, 5))
    assert gptq_quantize(w, None, "nvfp4", name="w").tensors.keys() == quantize(w, "nvfp4").tensors.keys()


# ------------------------------------------------------------------------------------------ whole checkpoints
def _windows(vocab, n=6, length=48, seed=5):
    return torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))


def _logits(path, wins):
    dec, _ = decoder(path)
    out = []
    for w in wins:
        dec.reset()
        out.append(torch.log_softmax(dec.forward(w).float(), -1))
    return torch.cat(out)


def _kl(ref, test):
    return float((ref.exp() * (ref - test)).sum(-1).mean())


@pytest.mark.parametrize("case,scheme", [("qwen3_moe_norm", "nvfp4"), ("gpt_oss", "mxfp4"), ("deepseek_v2", "fp8"),
                                         ("v5_fused", "nvfp4")])
def test_gptq_checkpoint_is_closer_to_the_float_model_on_its_calibration_text(case, scheme, tiny, tmp_path):
    """kie convert's GPTQ path on tiny models of several layouts (per-expert modules, gpt-oss's fused [E, in, out]
    parameter, MLA + shared experts, transformers-v5 fused gate_up slices): the checkpoint keeps RTN's scales and
    format, compressed-tensors reads it, and over the calibration windows the reference decoder's next-token
    distributions are closer to the float model's than RTN's (what GPTQ minimises, layer by layer)."""
    src = tiny(case) if case != "v5_fused" else to_v5_fused_experts(tiny("qwen3_moe_norm"), str(tmp_path / "v5"), 8)
    vocab = read_config(src)["vocab_size"]
    wins = _windows(vocab)
    rtn = convert_checkpoint(src, str(tmp_path / "rtn"), scheme, progress=False, on_warning=lambda m: None)
    rep = convert_checkpoint(src, str(tmp_path / "gptq"), scheme, progress=False, on_warning=lambda m: None,
                             gptq=GptqOptions(wins, "cpu", 0.01, "random ids"))
    assert rep.quantized == rtn.quantized and rep.kept == rtn.kept
    assert 0 < rep.gptq_slices
    a, b = qsource(str(tmp_path / "rtn")), qsource(str(tmp_path / "gptq"))
    comp, cts = BaseCompressor.get_value_from_registry(ct_scheme(scheme).format), ct_scheme(scheme)
    changed = 0
    for name in a.shapes():
        if not a.is_quantized(name):
            continue
        qa, qb = a.read_quantized(name), b.read_quantized(name)
        for k, v in qa.tensors.items():
            if "scale" in k:
                assert torch.equal(v, qb.tensors[k]), (name, k)
        changed += not all(torch.equal(v.view(torch.uint8) if v.element_size() == 1 else v, qb.tensors[k].view(
            torch.uint8) if v.element_size() == 1 else qb.tensors[k]) for k, v in qa.tensors.items())
        for part in qb.unstack() if len(qb.shape) == 3 else [qb]:
            dec = comp.decompress(dict(part.tensors), cts)["weight"]
            assert torch.equal(dec, part.dequantize(dec.dtype)), name
    assert changed > 0
    ref = _logits(src, wins)
    kl_rtn, kl_gptq = _kl(ref, _logits(str(tmp_path / "rtn"), wins)), _kl(ref, _logits(str(tmp_path / "gptq"), wins))
    assert kl_gptq < 0.9 * kl_rtn, (kl_gptq, kl_rtn)


@pytest.mark.parametrize("case,scheme", [("qwen3_moe_norm", "nvfp4"), ("gpt_oss", "fp8"), ("v5_fused", "fp8")])
def test_written_codes_are_gptq_of_the_source_weight_under_the_calibration_hessian(case, scheme, tiny, tmp_path):
    """Whichever way the converter gets a slice's codes (those calibration chose for a per-expert or unfused module,
    or a fresh solve for gpt-oss's fused [E, in, out] slices), they are exactly gptq_quantize(source weight,
    Hessian of that Linear's calibration input, the converter's global scale): checked module by module against
    calibrate_gptq's own Hessians."""
    src = tiny(case) if case != "v5_fused" else to_v5_fused_experts(tiny("qwen3_moe_norm"), str(tmp_path / "v5"), 8)
    wins = _windows(read_config(src)["vocab_size"])
    rep = convert_checkpoint(src, str(tmp_path / "q"), scheme, progress=False, on_warning=lambda m: None,
                             gptq=GptqOptions(wins, "cpu", 0.01, "random ids"))
    cal = calibrate_gptq(load_model(src), scheme, wins)
    written, m = qsource(str(tmp_path / "q")), load_model(src)
    checked = 0
    for layer in range(m.spec.num_layers):
        if f"layers.{layer}.moe.experts.1.gate" not in cal.hessians:
            continue
        cases = [(f"layers.{layer}.attn.o", f"model.layers.{layer}.self_attn.o_proj.weight", None)]
        if case == "gpt_oss":    # one [E, in, out] parameter, gate/up interleaved: expert 1's whole slice
            fused = f"model.layers.{layer}.mlp.experts.gate_up_proj"
            cases.append((f"layers.{layer}.moe.experts.1.gate", fused, m.weights.source.read(fused)[1].t()))
        else:
            cases.append((f"layers.{layer}.moe.experts.1.gate",
                          f"model.layers.{layer}.mlp.experts.1.gate_proj.weight", None))
        for name, module, w in cases:
            q = written.read_quantized(module)
            q = q.unstack()[1] if len(q.shape) == 3 else q
            w = m.weights.get(name) if w is None else w
            want = gptq_quantize(w.float(), cal.hessians[name], scheme, q.tensors.get("weight_global_scale"),
                                 name=name)
            for k, v in want.tensors.items():
                got = q.tensors[k]
                assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                                   v.view(torch.uint8) if v.element_size() == 1 else v), (name, k)
            checked += 1
    assert checked >= 2 and rep.gptq_slices > 0


def test_calibration_counts_unrouted_experts(tiny):
    """An expert no calibration token is routed to has no Hessian (it will be rounded to nearest); the routed ones
    have one, and every Hessian is symmetric positive semi-definite [in, in]. Four copies of one token stay
    identical through every layer (same query, keys and values at every position), so each MoE layer routes them
    all to the same top-k experts and exactly E - k experts a layer are unseen."""
    m = load_model(tiny("qwen3_moe_norm"))
    cal = calibrate_gptq(m, "fp8", torch.full((1, 4), 7, dtype=torch.long))
    moe = [lay.moe for lay in m.spec.layers if lay.moe is not None]
    assert moe and len(cal.unseen) == sum(3 * (mo.num_experts - mo.top_k) for mo in moe)
    assert all(".moe.experts." in n for n in cal.unseen)
    assert sum(".moe.experts." in n for n in cal.hessians) == sum(3 * mo.top_k for mo in moe)
    assert cal.tokens == 4
    for n, h in cal.hessians.items():
        assert h.shape[0] == h.shape[1] and torch.allclose(h, h.t()), n
        assert float(torch.linalg.eigvalsh(h.double()).min()) > -1e-6 * float(h.diagonal().max()), n


def test_gptq_refuses_laneformer(tiny, tmp_path):
    with pytest.raises(InputError, match="--gptq: .*not supported"):
        convert_checkpoint(tiny("laneformer"), str(tmp_path / "o"), "fp8", progress=False,
                           gptq=GptqOptions(torch.zeros(1, 8, dtype=torch.long)))


# ---------------------------------------------------------------------------------- the demo model, the CLI
def test_cli_convert_gptq_on_the_demo_model(tmp_path, capsys):
    """`kie convert demo --gptq` calibrates on the demo model's calib.txt (disjoint from heldout.txt) and writes a
    checkpoint `kie generate` runs."""
    from kie_moe import demo
    text = open(f"{demo.DEFAULT_MODEL}/{CALIB}", encoding="utf-8").read()
    held = open(f"{demo.DEFAULT_MODEL}/heldout.txt", encoding="utf-8").read()
    held_files = {l for l in held.splitlines() if l.startswith("# file: ")}
    assert held_files and not held_files & {l for l in text.splitlines() if l.startswith("# file: ")}
    dst = str(tmp_path / "q")
    rc, out, err = run_cli(capsys, ["convert", demo.DEFAULT_MODEL, dst, "--scheme", "fp8", "--gptq",
                                    "--calib-tokens", "512", "--device", "cpu"])
    assert rc == 0, err
    assert "calib.txt (2 windows of 256" in err and "slices by GPTQ" in err
    rc, out, err = run_cli(capsys, ["generate", dst, "--prompt-ids", "1,5,9", "--max-new-tokens", "3",
                                    "--ignore-eos", "--device", "cpu", "--backend", "reference", "--json"])
    assert rc == 0, err


def test_calibration_text_errors(tiny, tmp_path, capsys):
    from kie_moe import demo
    with pytest.raises(InputError, match="has no calib.txt; give --calib FILE"):
        gptq_options(tiny("llama"), None, 1024, "cpu", 0.01)
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    with pytest.raises(InputError, match=r"short\.txt: \d+ tokens, fewer than one calibration window of 256"):
        calibration_windows(demo.DEFAULT_MODEL, str(short), 1024, 4096)
    with pytest.raises(InputError, match="--calib-tokens must be at least one window"):
        calibration_windows(demo.DEFAULT_MODEL, None, 100, 4096)
    with pytest.raises(InputError, match="cannot read it"):
        calibration_windows(demo.DEFAULT_MODEL, str(tmp_path / "missing.txt"), 1024, 4096)
    with pytest.raises(InputError, match="--damp must be in"):
        gptq_options(demo.DEFAULT_MODEL, None, 1024, "cpu", 1.5)
    rc, _, err = run_cli(capsys, ["convert", demo.DEFAULT_MODEL, str(tmp_path / "o"), "--scheme", "fp8",
                                  "--calib", str(short)])
    assert rc == 2 and "add --gptq" in err
    wins, label = calibration_windows(demo.DEFAULT_MODEL, None, 1000, 4096)
    assert wins.shape == (3, 256) and "calib.txt" in label


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_gptq_on_cuda_matches_the_cpu_solve(scheme):
    """The same weight and Hessian solved on the GPU (--device cuda) give the CPU's scales bit for bit and its codes
    but for rare rounding-boundary flips (the Cholesky factors differ in the last bits between the two
    libraries), with the same layer output error."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w, x = _weight(), _correlated_inputs()
    h = x.t() @ x / x.shape[0]
    cpu, gpu = gptq_quantize(w, h, scheme, name="w"), gptq_quantize(w, h.cuda(), scheme, name="w")
    for k, t in cpu.tensors.items():
        g = gpu.tensors[k]
        assert g.device.type == "cpu" and g.dtype == t.dtype, k      # written where the weight lives
        if "scale" in k:
            assert torch.equal(g, t), k
        else:
            assert float((g.view(torch.uint8) != t.view(torch.uint8)).float().mean()) < 0.002, k

    def err(q):
        return float(((x @ (w - q.dequantize(torch.float32)).t()) ** 2).mean())
    assert abs(err(gpu) - err(cpu)) < 0.01 * err(cpu)


def test_gptq_from_a_quantized_source_and_with_the_lm_head(tiny, converted, tmp_path):
    """Two paths the layouts above do not take: an already quantized source (fp8 -> nvfp4: the store dequantizes
    to bf16 and the converter to float32, so every slice is solved again from its Hessian rather than reusing
    calibration's codes), and --quantize-lm-head (its Hessian from the final norm's output): both written as
    gptq_quantize of the converter's weight under calibrate_gptq's Hessian."""
    fp8_dir = converted("qwen3_moe_norm", "fp8")[0]
    wins = _windows(read_config(fp8_dir)["vocab_size"])
    dst = str(tmp_path / "nv")
    rep = convert_checkpoint(fp8_dir, dst, "nvfp4", progress=False, on_warning=lambda m: None,
                             gptq=GptqOptions(wins, "cpu", 0.01, "random ids"))
    cal = calibrate_gptq(load_model(fp8_dir), "nvfp4", wins)
    src, out = qsource(fp8_dir), qsource(dst)
    module = "model.layers.1.mlp.experts.1.gate_proj.weight"
    q = out.read_quantized(module)
    want = gptq_quantize(src.read_quantized(module).dequantize(torch.float32),
                         cal.hessians["layers.1.moe.experts.1.gate"], "nvfp4", q.tensors["weight_global_scale"],
                         name=module)
    assert torch.equal(q.tensors["weight_packed"], want.tensors["weight_packed"]) and rep.gptq_slices > 0

    src_dir = tiny("qwen3_moe_norm")
    rep = convert_checkpoint(src_dir, str(tmp_path / "lm"), "fp8", progress=False, quantize_lm_head=True,
                             gptq=GptqOptions(wins % read_config(src_dir)["vocab_size"], "cpu", 0.01, "random ids"))
    assert "lm_head" in rep.quantized
    cal = calibrate_gptq(load_model(src_dir), "fp8", wins % read_config(src_dir)["vocab_size"],
                         targets=lambda n: is_linear(n) or n == "lm_head")
    q = qsource(str(tmp_path / "lm")).read_quantized("lm_head.weight")
    want = gptq_quantize(load_model(src_dir).weights.get("lm_head").float(), cal.hessians["lm_head"], "fp8",
                         name="lm_head")
    assert torch.equal(q.tensors["weight"].view(torch.uint8), want.tensors["weight"].view(torch.uint8))
    assert not torch.equal(q.tensors["weight"].view(torch.uint8),
                           quantize(load_model(src_dir).weights.get("lm_head").float(), "fp8").tensors["weight"]
                           .view(torch.uint8))

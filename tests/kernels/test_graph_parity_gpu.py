"""Greedy parity of the graph backend (its CUDA graph, 32 steps) with the fp32 reference decoder on the same weights,
on the tiny checkpoint of every family:

- every preset's tiny variant (models/presets.py `tiny()`: llama, qwen3_moe, mixtral, olmoe, gpt_oss, deepseek_v2,
  deepseek_v3 and the Laneformer preset that dense/ registers), random weights from models/synth;
- every tests/models/hf_tiny.py case (checkpoints written by transformers' own classes; the only source of the
  dense qwen3 and qwen2_moe families, plus sliding-window / mixed dense-MoE / un-normalised top-k variants).

Two runs per case:

- bf16 (weights, KV cache, activations: what `--backend graph` runs). Where its tokens leave the reference's, the
  explanation is measured, not assumed. The reference runs teacher-forced on the graph's own tokens; at every step
  where the graph's token is not the fp32 argmax, the fp32 logit gap (argmax minus the graph's token; at the first
  divergence this is the top-2 margin) must be either <= TIE (0.1 logits; these models' logits have std ~1.2 and
  their bf16 paths differ from fp32 by 0.02-0.07 logits, 0.1-0.2 for OLMoE's clip_qkv + full q/k norm), or <= the
  most that the bf16 *reference decoder* itself moves any two logits apart at that very step on the same history
  (max minus min of its signed logit errors: a gap is a difference of two logits; a near tie upstream, e.g. in a
  router's top-k: qwen3-235b's tiny variant flips an expert at step 2 in bf16, and the bf16 reference then sits
  0.42 logits from fp32, measured with the interpreter), or a measured router near tie: at one of the step's
  MoE calls whose fp32 top-k margin is <= TIE, swapping the k-th and (k+1)-th experts' router logits makes the
  fp32 reference itself give the graph's token (within TIE). Anything else fails. The graph's
  logits at the last step (its logits buffer after the run) must be within max(0.5, 2x the bf16 reference's error
  at that step) of the fp32 reference.
- fp32 (the same launches and CUDA graph with fp32 weights, KV and activations): strict. The only difference left
  is summation order, so every token must be the fp32 argmax up to a gap of 1e-3, and the last step's logits must
  be within 1e-2 of the reference: a wrong kernel cannot hide behind bf16 noise here.

Reports: one line per case on stdout (run with -s), record_property in the junit XML, and, when KIE_PARITY_OUT
names a file, one JSON line per case appended to it (scripts/gpu-check's `parity` stage writes
$R/graph-parity.jsonl). A family the backend refuses (InputError: laneformer on the graph backend today) is
skipped with the backend's own message.

`run_parity` also runs on CPU through Triton's interpreter: test_parity_report_on_cpu runs OLMoE, whose bf16 run
leaves the fp32 argmax at step 4 on a 0.07 margin, so the divergence path itself is tested in CI.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from kie_moe.models.errors import ConfigError, InputError
from kie_moe.sampling import SamplingParams

from .helpers import DEV, needs_device

STEPS = 32
PROMPT = list(range(5, 25))
# per backend dtype: (largest fp32 logit gap that counts as a near tie, largest last-step logit error)
TOLERANCE = {torch.bfloat16: (0.1, 0.5), torch.float32: (1e-3, 1e-2)}


def _presets_with_tiny() -> list[str]:
    from kie_moe.models.presets import preset_names, tiny
    out = []
    for name in preset_names():
        try:
            tiny(name)
        except ConfigError:        # a preset without a tiny variant has nothing to test here
            continue
        out.append(name)
    return out


def _hf_cases() -> list[str]:
    from tests.models.hf_tiny import CASES
    return list(CASES)


CASES = [f"preset:{n}" for n in _presets_with_tiny()] + [f"hf:{c}" for c in _hf_cases()]


def load_case(case: str, device, tmp_dir: str):
    """'preset:NAME' (synthetic tiny weights on `device`) or 'hf:CASE' (transformers-made checkpoint), bf16."""
    from kie_moe.models.registry import LoadedModel, load_model
    kind, name = case.split(":", 1)
    if kind == "preset":
        from kie_moe.models.synth import synth_weights_on_device
        spec, store = synth_weights_on_device(name, device, torch.bfloat16, tiny=True)
        return LoadedModel(f"<tiny {name}>", {}, spec, store)
    from tests.models.hf_tiny import make_checkpoint
    make_checkpoint(name, tmp_dir, torch.bfloat16)
    return load_model(tmp_dir)


def reference_decoder(model, device, dtype):
    """The family's oracle decoder (as kie_moe.engine.ReferenceBackend picks it)."""
    from kie_moe.models.registry import adapter_for
    adapter = adapter_for(model.spec.family)
    if hasattr(adapter, "reference_decoder"):
        return adapter.reference_decoder(model.spec, model.weights, device, dtype)
    from kie_moe.models.reference import ReferenceDecoder
    return ReferenceDecoder(model.spec, model.weights, device, dtype)


@torch.no_grad()
def _free_running(ref, prompt, n):
    """fp32 greedy tokens and each step's top-2 margin."""
    ref.reset()
    logits = ref.forward(torch.tensor(prompt))[-1].float()
    toks, margins = [], []
    for _ in range(n):
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        toks.append(int(torch.argmax(logits)))
        logits = ref.forward(torch.tensor([toks[-1]]))[-1].float()
    return toks, margins


@torch.no_grad()
def _teacher_forced(ref, prompt, tokens):
    """Logits [len(tokens), V] (float32, on the CPU) at each step given the history `tokens`."""
    ref.reset()
    out = [ref.forward(torch.tensor(prompt))[-1].float()]
    for t in tokens[:-1]:
        out.append(ref.forward(torch.tensor([t]))[-1].float())
    return torch.stack(out).cpu()


def _history(prompt, tokens, step):
    """The forwards that lead to `step` (teacher-forced) and the step's own input."""
    if step == 0:
        return [], prompt
    return [prompt] + [[t] for t in tokens[:step - 1]], [tokens[step - 1]]


@torch.no_grad()
def _step_with_router_swap(ref, prompt, tokens, step, call=None) -> tuple[torch.Tensor, list]:
    """fp32 logits [V] at `step` (teacher-forced on `tokens`) and that step's router margins, one per MoE call (the
    k-th minus the (k+1)-th router logit of its last row: how close the reference is to picking another expert).
    call=i: at the step's i-th MoE call, the k-th and (k+1)-th experts swap their logits (the smallest change that
    picks the other expert): what the model computes on the other side of that router near tie."""
    import kie_moe.models.reference as R
    orig, margins = R.route, []

    def spy(moe, logits, score_bias):
        k = moe.top_k
        if logits.shape[-1] > k:
            v, order = torch.sort(logits[-1].float(), descending=True)
            margins.append(float(v[k - 1] - v[k]))
            if call is not None and len(margins) - 1 == call:
                logits = logits.clone()
                logits[-1, order[k - 1]], logits[-1, order[k]] = v[k], v[k - 1]
        return orig(moe, logits, score_bias)

    before, now = _history(prompt, tokens, step)
    ref.reset()
    for ids in before:
        ref.forward(torch.tensor(ids))
    R.route = spy
    try:
        logits = ref.forward(torch.tensor(now))[-1].float().cpu()
    finally:
        R.route = orig
    return logits, margins


def _router_flip(ref, prompt, tokens, step, margins, tie, tries=3) -> dict | None:
    """Does the fp32 reference give the graph's token at `step` when one router near tie (margin <= tie, the
    `tries` smallest of the step's `margins`) goes the other way? The first such flip, or None."""
    for c in sorted(range(len(margins)), key=margins.__getitem__)[:tries]:
        if margins[c] > tie:
            break
        logits, _ = _step_with_router_swap(ref, prompt, tokens, step, call=c)
        gap = float(logits.max() - logits[tokens[step]])
        if gap <= tie:
            return dict(moe_call=c, router_margin=round(margins[c], 5), gap_after=round(gap, 5))
    return None


def run_parity(model, device, steps: int = STEPS, prompt=PROMPT, backend_dtype=torch.bfloat16) -> dict:
    """Graph backend tokens vs the fp32 reference -> report dict (see the module docstring). Raises InputError
    when the graph backend refuses the family."""
    from kie_moe.kernels.graph import GraphBackend
    be = GraphBackend(model, device, dtype=backend_dtype)
    got = list(be.generate(prompt, SamplingParams(max_new_tokens=steps, ignore_eos=True), set()))
    last_logits = be.logits.float().cpu()
    del be
    tie, err_max = TOLERANCE[backend_dtype]
    ref = reference_decoder(model, device, torch.float32)
    want, margins = _free_running(ref, prompt, steps)
    tf = _teacher_forced(ref, prompt, got)
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    best = tf.argmax(-1)
    gaps = (tf.max(-1).values - tf.gather(1, torch.tensor(got)[:, None]).squeeze(1)).tolist()
    off = [s for s in range(steps) if got[s] != int(best[s])]
    # the same math in the backend's precision on the same history: how far does precision alone move the logits?
    low = tf if backend_dtype == torch.float32 else \
        _teacher_forced(reference_decoder(model, device, backend_dtype), prompt, got)
    err = low - tf
    low_err = err.abs().max(-1).values.tolist()
    # a gap is a difference of two logits: the most the low-precision reference moves any pair apart at this step
    low_pair = (err.max(-1).values - err.min(-1).values).tolist()
    dis = []
    for s in off:
        why, flip = None, None
        margins_s = _step_with_router_swap(ref, prompt, got, s)[1]
        if gaps[s] <= tie:
            why = "near tie"
        elif backend_dtype != torch.float32 and gaps[s] <= low_pair[s]:
            why = "within the low-precision reference's own error at this step"
        elif backend_dtype != torch.float32:
            flip = _router_flip(ref, prompt, got, s, margins_s, tie)
            if flip:
                why = "router near tie: the fp32 reference gives this token with that expert choice flipped"
        margin_r = min(margins_s, default=None)
        dis.append(dict(step=s, got=got[s], argmax=int(best[s]), gap=round(gaps[s], 5),
                        low_precision_ref_err=round(low_err[s], 5), low_precision_ref_pair=round(low_pair[s], 5),
                        low_precision_ref_token=int(low[s].argmax()),
                        router_margin=None if margin_r is None else round(margin_r, 5), router_flip=flip,
                        accepted_as=why))
    del ref
    return dict(
        dtype=str(backend_dtype).replace("torch.", ""), steps=steps, equal=got == want, first_divergence=first,
        margin_at_divergence=None if first is None else margins[first], disagreements=dis,
        max_gap=max([gaps[s] for s in off], default=0.0), tie=tie, min_margin=min(margins),
        last_step_logit_err=float((last_logits - tf[-1]).abs().max()),
        # bf16: a router near tie moves whole logit vectors; allow what the bf16 reference itself shows there
        last_step_logit_err_max=max(err_max, 2 * low_err[-1]) if backend_dtype != torch.float32 else err_max,
        low_precision_ref_err_max=max(low_err), logit_std=float(tf.std(-1).mean()), got=got, want=want)


def _report(case: str, r: dict) -> str:
    head = "equal" if r["equal"] else (f"diverges at step {r['first_divergence']} (fp32 top-2 margin there "
                                       f"{r['margin_at_divergence']:.4f})")
    why = "; ".join(f"step {d['step']}: gap {d['gap']:.4f}, {r['dtype']} reference "
                    f"err {d['low_precision_ref_err']:.4f}"
                    + f" (pairs {d['low_precision_ref_pair']:.4f})"
                    + (f", router margin {d['router_margin']:.4f}" if d.get("router_margin") is not None else "")
                    + (f", fp32 with MoE call {d['router_flip']['moe_call']}'s experts flipped: gap "
                       f"{d['router_flip']['gap_after']:.4f}" if d.get("router_flip") else "")
                    + f" -> {d['accepted_as'] or 'NOT EXPLAINED'}"
                    for d in r["disagreements"])
    line = (f"[graph parity {r['dtype']}] {case}: {head}; {len(r['disagreements'])} teacher-forced disagreements"
            + (f" ({why})" if why else "") + f"; min margin {r['min_margin']:.4f}; last-step logit err "
            f"{r['last_step_logit_err']:.4f} (allowed {r['last_step_logit_err_max']:.4f}; {r['dtype']} reference's "
            f"own max err {r['low_precision_ref_err_max']:.4f}; logit std {r['logit_std']:.2f})")
    print(line, flush=True)
    path = os.environ.get("KIE_PARITY_OUT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(dict(case=case, **r)) + "\n")
    return line


def check(r: dict):
    bad = [d for d in r["disagreements"] if d["accepted_as"] is None]
    assert not bad, (f"{r['dtype']}: graph tokens leave the fp32 argmax by more than a near tie (gap > {r['tie']}) "
                     f"or the low-precision reference's own error at {bad}; first divergence at step "
                     f"{r['first_divergence']}, fp32 top-2 margin there {r['margin_at_divergence']}")
    assert r["last_step_logit_err"] <= r["last_step_logit_err_max"], \
        f"{r['dtype']}: graph logits at the last step are {r['last_step_logit_err']:.4g} from the fp32 reference"


def _gpu_case(case, tmp_path, record_property, dtype):
    dev = torch.device("cuda", torch.cuda.current_device())
    model = load_case(case, dev, str(tmp_path))
    try:
        r = run_parity(model, dev, backend_dtype=dtype)
    except InputError as e:
        if os.environ.get("KIE_PARITY_OUT"):
            with open(os.environ["KIE_PARITY_OUT"], "a") as f:
                f.write(json.dumps(dict(case=case, dtype=str(dtype).replace("torch.", ""), skipped=str(e))) + "\n")
        pytest.skip(f"graph backend refuses {case}: {e}")
    for k in ("equal", "first_divergence", "margin_at_divergence", "max_gap", "last_step_logit_err"):
        record_property(k, r[k])
    _report(case, r)
    check(r)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES)
def test_graph_greedy_parity_bf16_cuda(case, tmp_path, record_property):
    _gpu_case(case, tmp_path, record_property, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES)
def test_graph_greedy_parity_fp32_cuda(case, tmp_path, record_property):
    _gpu_case(case, tmp_path, record_property, torch.float32)


# Quantized graph paths on the GPU (inline-PTX fp4 decode, fused q/k/v, x8 handovers): an fp32 checkpoint quantized
# in memory (QuantizingStore: the reference reads the same codes dequantized to fp32), the strict fp32 run.
QCASES = ["hf:qwen3", "hf:qwen2_moe", "hf:gpt_oss", "hf:deepseek_v3", "hf:mixtral_window"]


def test_quantized_parity_cases_exist():
    """The GPU-only cases above name tiny checkpoints that exist (CI never collects them, so a typo would first show
    as a failure on the GPU)."""
    from tests.models.hf_tiny import CASES
    assert [c for c in QCASES if c.split(":", 1)[1] not in CASES] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("case", QCASES)
def test_graph_quantized_parity_fp32_cuda(case, fmt, tmp_path, record_property):
    from kie_moe.models.registry import LoadedModel, load_model
    from kie_moe.synthetic import QuantizingStore
    from tests.models.hf_tiny import make_checkpoint
    dev = torch.device("cuda", torch.cuda.current_device())
    make_checkpoint(case.split(":", 1)[1], str(tmp_path), torch.float32)
    m = load_model(str(tmp_path))
    model = LoadedModel(m.path, m.config, m.spec, QuantizingStore(m.weights, fmt))
    r = run_parity(model, dev, backend_dtype=torch.float32)
    for k in ("equal", "first_divergence", "last_step_logit_err"):
        record_property(k, r[k])
    _report(f"{case} {fmt}", r)
    check(r)


@needs_device
@pytest.mark.skipif(DEV != "cpu", reason="the interpreter run of the parity plumbing; the GPU runs the tests above")
def test_parity_report_on_cpu(tmp_path):
    """OLMoE's tiny HF checkpoint in bf16 leaves the fp32 argmax at step 4 on a 0.07 margin (measured): the report
    must find that step and its margin and accept it as a near tie; the other steps agree."""
    model = load_case("hf:olmoe", "cpu", str(tmp_path))
    r = run_parity(model, torch.device("cpu"), steps=6)
    _report("hf:olmoe (cpu)", r)
    assert r["first_divergence"] == 4 and r["margin_at_divergence"] < r["tie"]
    assert [(d["step"], d["accepted_as"]) for d in r["disagreements"]] == [(4, "near tie")]
    assert isinstance(r["disagreements"][0]["router_margin"], float)   # OLMoE routes: the diagnostic has a value
    check(r)


@needs_device
@pytest.mark.skipif(DEV != "cpu", reason="reference-only plumbing of the parity check")
def test_router_swap_replay_on_cpu(tmp_path):
    """The router-flip replay: without a swap it is the teacher-forced step; with the swap at the step's closest
    MoE call that call picks the (k+1)-th expert (other logits), and the margins are the reference's own."""
    model = load_case("hf:olmoe", "cpu", str(tmp_path))
    ref = reference_decoder(model, torch.device("cpu"), torch.float32)
    toks = [7, 3, 11, 2]
    tf = _teacher_forced(ref, PROMPT, toks)
    for step in (0, 3):
        plain, margins = _step_with_router_swap(ref, PROMPT, toks, step)
        assert torch.equal(plain, tf[step])
        assert 0 < len(margins) <= model.spec.num_layers and min(margins) >= 0
        closest = min(range(len(margins)), key=margins.__getitem__)
        swapped, again = _step_with_router_swap(ref, PROMPT, toks, step, call=closest)
        assert again[:closest + 1] == margins[:closest + 1]   # the calls up to the swap saw the same logits
        assert (swapped - plain).abs().max() > 1e-4

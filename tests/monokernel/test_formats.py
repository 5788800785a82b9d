"""Quantized weights in the monokernel (fp8, fp8-block, nvfp4, mxfp4) under the interpreter.

The tiny checkpoints' Linears are quantized with quant.schemes.quantize (compressed-tensors' format); the
reference decoder runs on the same codes dequantized by quant.schemes, the kernel streams the codes. Greedy
tokens, the last step's LM-head tile maxima and every appended K/V row must match (check_against_reference), and
the packed buffers must dequantize back to quant.schemes' values."""
import pytest
import torch

from kie_moe.kernels.monokernel import plan as P
from kie_moe.kernels.monokernel.runtime import MonokernelBackend
from kie_moe.quant.schemes import quantize
from kie_moe.sampling import SamplingParams

from .test_monokernel import PROMPT, check_against_reference


class DequantStore:
    """The reference's view of a quantized checkpoint: quantized Linears read back dequantized."""

    def __init__(self, store, q):
        self.store, self.q = store, q

    def names(self):
        return self.store.names()

    def __contains__(self, name):
        return name in self.store

    def get(self, name):
        return self.q[name].dequantize() if name in self.q else self.store.get(name)


def quantize_model(m, scheme, kinds):
    q = {n: quantize(m.weights.get(n).float(), scheme, name=n) for n in m.weights.names() if P.qkind(n) in kinds}
    assert q, "nothing to quantize"
    return q


CASES = [  # (tiny checkpoint, scheme, Linear kinds quantized, prefill): every format, every kind, dense and MoE
    ("qwen2_moe", "fp8", ("attn", "exp"), "torch"),          # + shared expert with its gate, qkv biases
    ("qwen3_moe_mixed", "fp8-block", ("attn", "mlp", "exp"), "torch"),   # ragged 128-blocks, dense + MoE layers
    ("olmoe", "nvfp4", ("attn", "exp"), "torch"),
    ("llama", "mxfp4", ("attn", "mlp"), "kernel"),   # in-kernel prefill (the default is the batched torch one)
]


@pytest.mark.parametrize("case,scheme,kinds,prefill", CASES, ids=[f"{c}-{s}" for c, s, _, _ in CASES])
def test_quantized_greedy_matches_reference(case, scheme, kinds, prefill, tiny_model):
    m = tiny_model(case)
    q = quantize_model(m, scheme, kinds)
    be = MonokernelBackend(m, "cpu", quantized=q.get, prefill=prefill, num_stages=2 if scheme == "fp8" else 0)
    assert be.prefill_mode == prefill
    d = be.plan.dims
    want_fmt = {"fp8": 1, "fp8-block": 2, "nvfp4": 3, "mxfp4": 4}[scheme]
    assert {k: getattr(d, f"FMT_{k.upper()}") for k in kinds} == {k: want_fmt for k in kinds}
    # the packed buffers give back exactly what the format means
    for name in q:
        torch.testing.assert_close(be.plan.view(name), q[name].dequantize(), rtol=1e-6, atol=1e-7)
    prompt = PROMPT if prefill == "torch" else PROMPT[:4]   # in-kernel prefill: each prompt token is a step
    got = list(be.generate(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True), set()))

    class M:   # the reference model: same spec, dequantized weights
        spec = m.spec
        weights = DequantStore(m.weights, q)
    check_against_reference(be, M, prompt, got)    # tokens, last LM-head tile maxima, every appended K/V row


def test_mixed_formats_in_one_kind_are_refused(tiny_model):
    m = tiny_model("llama")
    q = quantize_model(m, "fp8", ("attn",))
    q.pop("layers.0.attn.q")
    with pytest.raises(NotImplementedError, match="attn Linears mix formats"):
        P.build_plan(m.spec, m.weights, "cpu", quantized=q.get)


def test_store_that_quantizes_on_request_is_streamed_as_codes(tiny_model):
    """kie bench's presets quantize through synthetic.QuantizingStore: the monokernel must stream its codes
    (the format it reports in the plan), not a float copy, and still decode like the reference on the same
    (dequantized) weights."""
    from kie_moe.models.registry import LoadedModel
    from kie_moe.synthetic import QuantizingStore
    m = tiny_model("qwen2_moe")
    qm = LoadedModel(m.path, m.config, m.spec, QuantizingStore(m.weights, "fp8"))
    be = MonokernelBackend(qm, "cpu", prefill="torch", num_stages=0)
    d = be.plan.dims
    assert (d.FMT_ATTN, d.FMT_EXP) == (1, 1)
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), set()))
    check_against_reference(be, qm, PROMPT, got)


@pytest.mark.parametrize("case,scheme,kinds,prefill", CASES[:3], ids=[f"{c}-{s}" for c, s, _, _ in CASES[:3]])
def test_e4m3_as_bytes(case, scheme, kinds, prefill, tiny_model, monkeypatch):
    """Before sm_89 (no fp8e4nv in Triton) the quantized buffers go in as uint8 and qtile decodes the e4m3 bits
    (KIE_E4M3_BITS=1 forces that here): the reference's greedy tokens still."""
    from kie_moe.kernels import device_caps
    monkeypatch.setattr(device_caps, "FORCE_BITS", True)
    m = tiny_model(case)
    q = quantize_model(m, scheme, kinds)
    be = MonokernelBackend(m, "cpu", quantized=q.get, prefill=prefill)
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), set()))
    args, _ = be.kernel_args(be.tasks(1), 1, 0, 1, 0)
    assert args[3].dtype == torch.uint8 and args[6].dtype == torch.uint8    # qw8, qs8f: bytes, not fp8e4nv

    class M:
        spec = m.spec
        weights = DequantStore(m.weights, q)
    check_against_reference(be, M, PROMPT, got)

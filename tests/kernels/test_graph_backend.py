"""The graph backend's decode step (the same launches it captures on the GPU) run eagerly through Triton's
interpreter: greedy tokens equal the reference decoder's on tiny checkpoints of several families."""
import pytest
import torch

from kie_moe.kernels.graph import GraphBackend
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.models.registry import load_model
from kie_moe.sampling import SamplingParams
from tests.models.hf_tiny import make_checkpoint

STEPS = 4


def ref_greedy(m, prompt, n):
    dec = ReferenceDecoder(m.spec, m.weights)
    logits = dec.forward(torch.tensor(prompt))[-1]
    out = []
    for _ in range(n):
        t = int(torch.argmax(logits))
        out.append(t)
        logits = dec.forward(torch.tensor([t]))[-1]
    return out


@pytest.mark.parametrize("case", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_graph_backend_greedy_matches_reference(case, tmp_path):
    make_checkpoint(case, str(tmp_path))
    m = load_model(str(tmp_path))
    prompt = list(range(7, 15))
    want = ref_greedy(m, prompt, STEPS)
    be = GraphBackend(m, torch.device("cpu"))
    got = list(be.generate(prompt, SamplingParams(max_new_tokens=STEPS, ignore_eos=True), set()))
    assert got == want


@pytest.mark.parametrize("case", ["qwen3", "gpt_oss"])
def test_fused_rope_attention_step_equals_the_two_launches(case, tmp_path, monkeypatch):
    """KIE_FUSED_ROPE_ATTN's path (attention.rope_gqa_decode) in the whole decode step: the same tokens and the
    same last-step logits as rope_append + gqa_decode, and the reference decoder's greedy tokens (Qwen3: per-head
    q/k norm; gpt-oss: sinks and sliding windows)."""
    import kie_moe.kernels.graph as G
    make_checkpoint(case, str(tmp_path))
    m = load_model(str(tmp_path))
    prompt = list(range(7, 15))
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(G, "FUSED_ROPE_ATTN", fused)
        be = GraphBackend(m, torch.device("cpu"))
        runs[fused] = (list(be.generate(prompt, SamplingParams(max_new_tokens=STEPS, ignore_eos=True), set())),
                       be.logits.float().clone())
    assert runs[True][0] == runs[False][0] == ref_greedy(m, prompt, STEPS)
    assert torch.equal(runs[True][1], runs[False][1])


@pytest.mark.parametrize("fmt", ["nvfp4"])  # mxfp4's packed path: tests/kernels/test_fp4_mma.py
def test_quantized_lm_head_packed_for_the_tensor_cores(fmt, tmp_path, monkeypatch):
    """A quantized lm_head big enough for gemv()'s tensor-core dispatch (threshold lowered to the tiny vocab) is
    re-laid once (packing "mma"): greedy tokens equal the reference decoder's on the same (dequantized) weights,
    and the last logits are those of the CUDA-core tile on the checkpoint bytes (KIE_GEMV_MMA=0) within the mma
    path's one fp16 rounding of the normed input (fp4_mma's xh: 2^-11 relative)."""
    import kie_moe.kernels.gemv as GV
    from kie_moe.models.registry import LoadedModel
    from kie_moe.synthetic import QuantizingStore
    make_checkpoint("qwen3", str(tmp_path))
    m0 = load_model(str(tmp_path))
    m = LoadedModel(m0.path, m0.config, m0.spec, QuantizingStore(m0.weights, fmt, lm_head=True))
    monkeypatch.setattr(GV, "MMA_MIN_ROWS", 64)
    prompt = list(range(7, 15))
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(GV, "MMA_GEMV", on)
        be = GraphBackend(m, torch.device("cpu"))
        assert be.lm_head.fmt == fmt and be.lm_head.packing == ("mma" if on else "checkpoint")
        runs[on] = (list(be.generate(prompt, SamplingParams(max_new_tokens=STEPS, ignore_eos=True), set())),
                    be.logits.float().clone())
    assert runs[True][0] == runs[False][0] == ref_greedy(m, prompt, STEPS)
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=0, atol=2e-3 * runs[False][1].abs().max())


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

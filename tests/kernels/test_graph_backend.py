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

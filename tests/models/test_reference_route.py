"""models.reference.route with experts chosen elsewhere (ids=...): the weights of exactly those experts, computed as
for its own choice (what the real-width prefill test uses to compare past a router near tie)."""
import pytest
import torch

from kie_moe.models.reference import route
from kie_moe.models.spec import MoESpec

SPECS = {
    "softmax_norm": MoESpec(num_experts=12, top_k=3, intermediate_size=8, norm_topk_prob=True),
    "sigmoid_groups_bias": MoESpec(num_experts=12, top_k=3, intermediate_size=8, scoring="sigmoid",
                                   norm_topk_prob=True, routed_scaling_factor=2.5, n_group=4, topk_group=2,
                                   group_score="top2sum", score_correction_bias=True),
    "softmax_topk": MoESpec(num_experts=12, top_k=3, intermediate_size=8, scoring="softmax_topk"),
}


@pytest.mark.parametrize("name", list(SPECS))
def test_route_with_given_ids(name):
    m = SPECS[name]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 12, generator=g)
    bias = torch.randn(12, generator=g) * 0.1 if m.score_correction_bias else None
    own_ids, own_w = route(m, logits, bias)
    ids, w = route(m, logits, bias, ids=own_ids)          # its own choice given back: the same weights
    assert torch.equal(ids, own_ids) and torch.allclose(w, own_w, atol=0, rtol=1e-6)
    other = (own_ids + 1) % 12                             # another choice: the weights of those experts
    ids, w = route(m, logits, bias, ids=other)
    assert torch.equal(ids, other)
    if m.scoring == "softmax_topk":
        want = torch.softmax(logits.gather(1, other), -1)
    else:
        s = torch.softmax(logits, -1) if m.scoring == "softmax" else torch.sigmoid(logits)
        want = s.gather(1, other)
        want = want / want.sum(-1, keepdim=True) * m.routed_scaling_factor
    assert torch.allclose(w, want, rtol=1e-5, atol=1e-7)

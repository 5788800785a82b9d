"""Quality metrics against torch's own KL / cross-entropy and hand-computable cases."""

import math

import pytest
import torch
import torch.nn.functional as F

from kie_moe.quant import QualityReport, compare_logits, kl_divergence, perplexity, top1_agreement


def _logits(*shape, seed=0, scale=3.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_kl_matches_torch_kl_div_and_is_directional():
    ref, test = _logits(2, 7, 50, seed=1), _logits(2, 7, 50, seed=2)
    # F.kl_div(input=log q, target=log p, log_target) = sum p (log p - log q); batchmean over 14 rows
    oracle = F.kl_div(
        F.log_softmax(test, -1).reshape(14, 50), F.log_softmax(ref, -1).reshape(14, 50), reduction="batchmean", log_target=True
    )
    assert kl_divergence(ref, test) == pytest.approx(float(oracle), rel=1e-5)
    assert kl_divergence(ref, test) != pytest.approx(kl_divergence(test, ref), rel=1e-3)
    assert kl_divergence(ref, ref) == pytest.approx(0.0, abs=1e-6)
    assert kl_divergence(ref, ref + 5.0) == pytest.approx(0.0, abs=1e-5)  # softmax is shift invariant


def test_kl_two_point_closed_form_and_masked_vocab():
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    test = torch.log(torch.tensor([[0.9, 0.1]]))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence(ref, test) == pytest.approx(expected, rel=1e-6)
    # -inf where the reference has no mass: finite, not NaN
    ref_m = torch.tensor([[0.0, 0.0, -math.inf]])
    test_m = torch.tensor([[0.0, 1.0, 2.0]])
    assert math.isfinite(kl_divergence(ref_m, test_m))
    bf16 = kl_divergence(ref.to(torch.bfloat16), test.to(torch.bfloat16))
    assert bf16 == pytest.approx(expected, rel=1e-2)


def test_top1_agreement():
    ref = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0], [1.0, 0.0, 0.0]])
    test = torch.tensor([[0.0, 2.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert top1_agreement(ref, test) == 0.5
    assert top1_agreement(ref, ref) == 1.0


def test_perplexity_matches_cross_entropy_and_uniform_case():
    logits = _logits(3, 9, 40, seed=3)
    targets = torch.randint(0, 40, (3, 9), generator=torch.Generator().manual_seed(4))
    ce = F.cross_entropy(logits.reshape(-1, 40), targets.reshape(-1))
    assert perplexity(logits, targets) == pytest.approx(math.exp(float(ce)), rel=1e-5)
    assert perplexity(torch.zeros(5, 17), torch.arange(5)) == pytest.approx(17.0, rel=1e-6)  # uniform -> V
    # ignored positions drop out
    t2 = targets.clone()
    t2[:, :4] = -100
    ce2 = F.cross_entropy(logits[:, 4:].reshape(-1, 40), targets[:, 4:].reshape(-1))
    assert perplexity(logits, t2) == pytest.approx(math.exp(float(ce2)), rel=1e-5)


def test_metric_input_errors():
    with pytest.raises(ValueError, match="differ in shape"):
        kl_divergence(torch.zeros(2, 5), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="do not fit targets"):
        perplexity(torch.zeros(2, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="ignore_index"):
        perplexity(torch.zeros(2, 5), torch.full((2,), -100))


def test_compare_logits_report():
    ref, test = _logits(8, 30, seed=5), _logits(8, 30, seed=5) + 0.1 * _logits(8, 30, seed=6)
    targets = torch.arange(8)
    r = compare_logits(ref, test, targets)
    assert isinstance(r, QualityReport)
    assert r.kl == kl_divergence(ref, test) and r.top1 == top1_agreement(ref, test)
    assert r.ppl_ref == perplexity(ref, targets) and r.ppl_test == perplexity(test, targets)
    assert 0 < r.kl < 0.1 and r.top1 >= 0.75
    assert compare_logits(ref, test).ppl_ref is None

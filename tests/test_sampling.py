"""The host sampler's rules, checked against direct probability computations."""
import pytest
import torch

from kie_moe.models.errors import InputError
from kie_moe.sampling import SamplingParams, sample


def draws(logits, p, n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.bincount(torch.tensor([sample(logits, p, g) for _ in range(n)]), minlength=logits.numel()).float() / n


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert sample(logits, SamplingParams(), None) == 1


def test_temperature_matches_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 0.7])
    freq = draws(logits, SamplingParams(temperature=0.8, seed=0))
    want = torch.softmax(logits / 0.8, -1)
    assert (freq - want).abs().max() < 0.03


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0, 2.0])
    f = draws(logits, SamplingParams(temperature=1.0, top_k=2), n=2000)
    assert f[[2, 3, 4]].sum() == 0 and f[0] > 0 and f[1] > 0
    probs = torch.softmax(logits, -1)           # [.43, .39, .02, .007, .16]: top_p .8 keeps tokens 0 and 1
    f = draws(logits, SamplingParams(temperature=1.0, top_p=0.8), n=2000)
    assert f[[2, 3, 4]].sum() == 0
    assert abs(f[0] - probs[0] / probs[:2].sum()) < 0.04
    assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), torch.Generator().manual_seed(3)) == 0


def test_seed_reproducible():
    logits = torch.randn(50)
    p = SamplingParams(temperature=1.0)
    a = [sample(logits, p, torch.Generator().manual_seed(7)) for _ in range(5)]
    b = [sample(logits, p, torch.Generator().manual_seed(7)) for _ in range(5)]
    assert a == b


@pytest.mark.parametrize("kw", [dict(max_new_tokens=0), dict(temperature=-0.1), dict(top_p=1.5), dict(top_k=-1)])
def test_invalid_params(kw):
    with pytest.raises(InputError):
        SamplingParams(**kw)

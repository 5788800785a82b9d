"""On-device sampling (kernels/sampling.py): greedy == torch.argmax, and the draws follow the distribution of
kie_moe.sampling's host rules (temperature, top-k, top-p), reproducibly per (seed, step).

Distribution checks draw thousands of samples in one launch (draws_per_prog: one program handles a block of
steps), since the interpreter pays per program; bounds are 5 standard deviations of a binomial frequency.
"""
import os

import pytest
import torch

from kie_moe.kernels.sampling import DeviceSampler, sample_probs_ref, sample_tokens
from kie_moe.sampling import SamplingParams, sample

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="no interpreter, no GPU")

N = 4096
DPP = N if INTERPRET else 64          # draws per program: one block under the interpreter, GPU-sized otherwise


def freqs(toks: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(toks.long().cpu(), minlength=V).float() / toks.numel()


def assert_distribution(toks, probs, what=""):
    f = freqs(toks, probs.numel())
    assert (f[probs == 0] == 0).all(), f"{what}: drew tokens outside the support {torch.nonzero(f * (probs == 0))}"
    bound = 5 * (probs * (1 - probs) / toks.numel()).sqrt() + 1e-3
    bad = (f - probs).abs() > bound
    assert not bad.any(), f"{what}: frequencies {f[bad]} vs probabilities {probs[bad]}"


@pytest.mark.parametrize("V,block_v", [(1, 8), (37, 8), (1000, 128), (1000, 4096)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax_lowest_index_on_ties(V, block_v, dtype):
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(V, generator=g) * 3).to(dtype)
    assert int(sample_tokens(logits.to(DEV), block_v=block_v)[0]) == int(torch.argmax(logits))
    if V > 30:
        for a, b in ((3, 30), (V - 1, 2), (9, 10)):          # ties across tiles, reversed order, inside a tile
            t = logits.clone()
            t[a] = t[b] = t.max() + 1
            assert int(sample_tokens(t.to(DEV), block_v=block_v)[0]) == min(a, b) == int(torch.argmax(t))


def test_temperature_matches_softmax_and_host_rules():
    logits = torch.tensor([1.0, 0.0, -0.5, 0.7, 0.2, -2.0, 0.9, 0.1, -1.0, 0.4, 0.3])    # 11 tokens, 3 tiles of 4
    toks = sample_tokens(logits.to(DEV), temperature=0.8, seed=5, num_draws=N, block_v=4, draws_per_prog=DPP)
    assert_distribution(toks, sample_probs_ref(logits, 0.8), "temperature 0.8")
    # the reference distribution is the host sampler's: check it once against kie_moe.sampling.sample
    host = torch.tensor([sample(logits, SamplingParams(temperature=0.8), torch.Generator().manual_seed(i))
                         for i in range(1500)])
    f = freqs(host, 11)
    assert (f - sample_probs_ref(logits, 0.8)).abs().max() < 0.05


@pytest.mark.parametrize("kw,k_cand", [(dict(top_k=3), 4), (dict(top_p=0.6), 4), (dict(top_k=4, top_p=0.7), 4),
                                       (dict(top_k=1), 2), (dict(top_p=1e-6), 2)])
def test_top_k_top_p_match_host_rules(kw, k_cand):
    logits = torch.tensor([1.0, 0.0, -0.5, 0.7, 0.2, -2.0, 0.9, 0.1, -1.0, 0.4, 0.3])
    s = DeviceSampler(11, DEV, k_cand=k_cand, block_v=4, num_draws=N, draws_per_prog=DPP).configure(0.8, seed=9, **kw)
    toks = s(logits.to(DEV)).clone()
    assert int(s.status[0]) == 0, "the filter should have been exact here"
    assert_distribution(toks, sample_probs_ref(logits, 0.8, **kw), str(kw))
    if kw.get("top_k") == 1 or kw.get("top_p") == 1e-6:
        assert (toks == 0).all()


def test_reference_distribution_is_hf_transformers_warpers():
    """sample_probs_ref, the distribution the draws above are checked against, is HF transformers' own
    Temperature -> TopK -> TopP logits warpers (generate()'s order) followed by softmax, for the cases above and 40
    random top_p at two temperatures."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    logits = torch.tensor([1.0, 0.0, -0.5, 0.7, 0.2, -2.0, 0.9, 0.1, -1.0, 0.4, 0.3])
    g = torch.Generator().manual_seed(0)
    cases = [dict(top_k=3), dict(top_p=0.6), dict(top_k=4, top_p=0.7), dict(top_k=1), dict(top_p=1e-6),
             dict(top_k=5, top_p=0.95)] + [dict(top_p=p) for p in torch.rand(20, generator=g).tolist()]
    for t in (0.8, 1.3):
        for kw in cases:
            z = TemperatureLogitsWarper(t)(None, logits[None].clone())
            if "top_k" in kw:
                z = TopKLogitsWarper(kw["top_k"])(None, z)
            if "top_p" in kw:
                z = TopPLogitsWarper(kw["top_p"])(None, z)
            torch.testing.assert_close(sample_probs_ref(logits, t, **kw), torch.softmax(z[0], -1), rtol=0,
                                       atol=1e-6, msg=lambda m: f"{t} {kw}: {m}")


def test_top_p_wider_than_candidates_falls_back_and_counts():
    """A flat distribution whose nucleus exceeds the candidates: plain temperature sampling, status counts it."""
    logits = torch.zeros(37)
    s = DeviceSampler(37, DEV, k_cand=2, block_v=8, num_draws=N, draws_per_prog=DPP).configure(1.0, top_p=0.9, seed=1)
    toks = s(logits.to(DEV))
    assert int(s.status[0]) == N
    assert_distribution(toks, torch.full((37,), 1 / 37), "fallback")


def test_seed_step_reproducible_and_device_state_advances():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, generator=g).to(DEV)
    a = sample_tokens(logits, temperature=1.0, seed=7, step=0, num_draws=8, block_v=64, draws_per_prog=8)
    b = sample_tokens(logits, temperature=1.0, seed=7, step=0, num_draws=8, block_v=64, draws_per_prog=2)
    c = sample_tokens(logits, temperature=1.0, seed=8, step=0, num_draws=8, block_v=64, draws_per_prog=8)
    assert torch.equal(a, b), "a draw must not depend on how draws are grouped into programs"
    assert not torch.equal(a, c) and len(set(a.tolist())) > 1
    # the decode-loop object: one draw per call, the step advances on the device, tokens land in the ring
    s = DeviceSampler(300, DEV, block_v=64, ring_size=4, filter=True, k_cand=8).configure(1.0, seed=7, top_k=8)
    ref = sample_tokens(logits, temperature=1.0, top_k=8, seed=7, step=0, num_draws=5, block_v=64, k_cand=8).tolist()
    got = [int(s(logits)[0]) for _ in range(5)]
    assert got == ref and int(s.rng[1]) == 5
    assert s.ring.tolist() == [got[4], got[1], got[2], got[3]]
    top8 = set(torch.topk(logits, 8).indices.tolist())
    assert set(got) <= top8
    s.configure(0.0)                                                     # greedy through the same object
    assert int(s(logits)[0]) == int(torch.argmax(logits))


@pytest.mark.parametrize("drawn", [5, -1])
def test_next_step_inputs_equal_the_torch_tail(drawn):
    """The graph step's tail in one launch: token = max(draw, 0), pos + 1, x = embed[token] in fp32, as the four
    torch launches it replaces (next_step_inputs_ref); D = 37 over 16-wide programs (a ragged last one)."""
    from kie_moe.kernels.sampling import next_step_inputs, next_step_inputs_ref
    g = torch.Generator().manual_seed(4)
    embed = torch.randn(11, 37, generator=g).to(torch.bfloat16).to(DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    runs = []
    for fn, kw in ((next_step_inputs, dict(block=16)), (next_step_inputs_ref, {})):
        out, token, pos = torch.tensor([drawn], **i32), torch.tensor([3], **i32), torch.tensor([40], **i32)
        x = torch.full((37,), float("nan"), device=DEV)
        fn(out, token, pos, embed, x, **kw)
        runs.append((out.tolist(), token.tolist(), pos.tolist(), x.clone()))
    (o, t, p, x), (o_r, t_r, p_r, x_r) = runs
    assert (o, t, p) == (o_r, t_r, p_r) == ([drawn], [max(drawn, 0)], [41])
    assert torch.equal(x, x_r) and torch.equal(x, embed[max(drawn, 0)].float())


def test_next_step_inputs_names_a_bad_tensor():
    from kie_moe.kernels.sampling import next_step_inputs
    i32 = dict(dtype=torch.int32, device=DEV)
    one, embed = torch.zeros(1, **i32), torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError, match="pos must be a contiguous torch.int32 tensor with 1 element"):
        next_step_inputs(one, one, torch.zeros(1, dtype=torch.int64, device=DEV), embed, torch.zeros(8, device=DEV))
    with pytest.raises(ValueError, match="x must be a contiguous torch.float32 tensor with 8 element"):
        next_step_inputs(one, one, one.clone(), embed, torch.zeros(7, device=DEV))
    with pytest.raises(ValueError, match="host_ring needs ring_size >= 1"):
        DeviceSampler(100, DEV, host_ring=True)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8), dict(temperature=0.8, top_k=5),
                                dict(temperature=0.8, top_p=0.9)])
def test_non_finite_logits_give_minus_one(bad, kw):
    """A NaN / +inf logit in any tile, wherever the maximum is, gives token -1 for every draw; -inf (a masked token)
    is a valid logit."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1000, generator=g)
    logits[7] = 50.0                          # the clear winner, in another tile than the bad value
    t = logits.clone()
    t[900] = bad
    got = sample_tokens(t.to(DEV), block_v=128, num_draws=4, **kw)
    assert got.tolist() == [-1] * 4
    t = logits.clone()
    t[900] = -float("inf")
    assert int(sample_tokens(t.to(DEV), block_v=128)[0]) == 7


def test_sampler_rejects_bad_inputs():
    from kie_moe.models.errors import InputError
    with pytest.raises(InputError, match="top_k 5: .* keeps 4 candidates"):
        DeviceSampler(100, DEV, k_cand=4).configure(1.0, top_k=5)
    DeviceSampler(100, DEV, k_cand=4).configure(0.0, top_k=5)    # greedy: top-k does not apply
    with pytest.raises(ValueError, match="filter"):
        DeviceSampler(100, DEV, filter=False).configure(1.0, top_p=0.5)
    with pytest.raises(ValueError, match="logits"):
        DeviceSampler(100, DEV)(torch.zeros(99, device=DEV))
    with pytest.raises(ValueError, match="block_v"):
        DeviceSampler(100, DEV, block_v=100)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [151936, 201088])
def test_real_vocab_gpu(V):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(V, device="cuda", generator=g) * 4
    assert int(sample_tokens(logits)[0]) == int(torch.argmax(logits))
    s = DeviceSampler(V, "cuda", num_draws=N).configure(0.7, top_k=20, top_p=0.9, seed=3)
    toks = s(logits)
    assert int(s.status[0]) == 0
    assert_distribution(toks, sample_probs_ref(logits.cpu(), 0.7, top_k=20, top_p=0.9), "real vocab")

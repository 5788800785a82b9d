"""Model simulations whose ranks talk only through KCCL: Laneformer DTP (lane plans) and a tiny Qwen3-MoE split
tensor + expert parallel give the single-device greedy tokens (and logits up to summation-order rounding)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from kie_moe.dense import adapter
from kie_moe.dense.reference import greedy
from kie_moe.kccl.collectives import KcclCollective
from kie_moe.kccl.tp_sim import TpSimulatedDecoder, kccl_laneformer, rank_weights
from kie_moe.models.errors import ConfigError
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.models.registry import load_model

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dense"))
from laneformer_helpers import PROMPT, config  # noqa: E402

from kie_moe.dense.preset import write_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def laneformer(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("lf") / "m")
    write_checkpoint(config(), d, seed=1, dtype=torch.float32, init_std=0.3, norm_jitter=0.2)
    m = load_model(d)
    want = greedy(adapter.reference_decoder(m.spec, m.weights), torch.tensor(PROMPT), 6)
    return m, want


@pytest.mark.parametrize("world", [2, 4])
def test_laneformer_through_kccl(world, laneformer):
    m, (want_tokens, want_logits) = laneformer
    sim = kccl_laneformer(m.spec, m.weights, world, timeout=30)
    assert all(isinstance(r.coll, KcclCollective) for r in sim.ranks)
    tokens, logits = greedy(sim, torch.tensor(PROMPT), 6)
    assert tokens == want_tokens and len(set(tokens)) >= 3
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sim.ranks[0].coll.heap.epoch > 6          # the transfers really went through the heap


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from models.hf_tiny import make_checkpoint
    d = str(tmp_path_factory.mktemp("moe") / "m")
    make_checkpoint("qwen3_moe_norm", d, torch.float32, seed=3)
    m = load_model(d)
    prompt = torch.tensor([3, 17, 101, 5, 64, 200, 9])
    want = greedy(ReferenceDecoder(m.spec, m.weights), prompt, 8)
    return m, prompt, want


@pytest.mark.parametrize("world", [2, 4])
def test_moe_tensor_expert_parallel_through_kccl(world, qwen3_moe):
    m, prompt, (want_tokens, want_logits) = qwen3_moe
    sim = TpSimulatedDecoder(m.spec, m.weights, world, timeout=30)
    tokens, logits = greedy(sim, prompt, 8)
    assert tokens == want_tokens and len(set(tokens)) >= 3
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # each rank holds only its share: 4 heads / N, experts e*N//E == r, a vocab piece of lm_head
    r1 = sim.ranks[1]
    assert r1.spec.layers[0].attn.num_heads == 4 // world
    moe_layer = next(i for i, l in enumerate(m.spec.layers) if l.moe is not None)
    E = m.spec.layers[moe_layer].moe.num_experts
    owned = [e for e in range(E) if f"layers.{moe_layer}.moe.experts.{e}.gate" in r1.w]
    assert owned == [e for e in range(E) if e * world // E == 1]
    per = -(-m.spec.vocab_size // world)                   # ceil(V/N) rows each, the last piece short
    assert r1.w["lm_head"].shape[0] == min(per, m.spec.vocab_size - per) and m.spec.vocab_size % world


def test_moe_split_errors(qwen3_moe):
    m = qwen3_moe[0]
    with pytest.raises(ConfigError, match="cannot split num_heads=4"):
        rank_weights(m.spec, m.weights, 0, 3)

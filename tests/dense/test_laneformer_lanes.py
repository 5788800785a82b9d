"""Lane plans and the N-rank simulation: ranks that own L/N lanes and talk only through a Collective give the
single-device tokens and logits."""
from __future__ import annotations

import threading

import pytest
import torch
from laneformer_helpers import EIGHT_LANES, PROMPT, config

from kie_moe.dense import adapter
from kie_moe.dense.lanes import ALL_GATHER, ALL_REDUCE, FINAL, lane_plan
from kie_moe.dense.reference import greedy
from kie_moe.dense.simulate import InProcessGroup, SimulatedDecoder
from kie_moe.models.errors import ConfigError
from kie_moe.models.families.common import Cfg
from kie_moe.models.registry import load_model

SWITCHES = {
    "early-comm_d2_lane-norms_pre-agg": {},
    "no-early_d1_shared-norm_replicate": dict(use_early_comm=False, broadcast_delay=1, replicated_rmsn_scale=True,
                                              pre_norm_lane_agg=False, sliding_window_n_layers=-2),
    "no-comm_replicate": dict(use_comm=False, pre_norm_lane_agg=False),
    "delay0": dict(broadcast_delay=0),
}
GRID = [(4, 2), (4, 4), (8, 2), (8, 4)]


@pytest.mark.parametrize("lanes,world", GRID)
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_simulation_equals_single_device(lanes, world, switch, make_model):
    cfg = config(**SWITCHES[switch], **(EIGHT_LANES if lanes == 8 else {}))
    m = load_model(make_model(cfg))
    single = adapter.reference_decoder(m.spec, m.weights)
    sim = SimulatedDecoder(m.spec, m.weights, world)
    want_tokens, want_logits = greedy(single, torch.tensor(PROMPT), 6)
    tokens, logits = greedy(sim, torch.tensor(PROMPT), 6)
    assert tokens == want_tokens and len(set(tokens)) >= 3
    for got, want in zip(logits, want_logits):
        # the ranks sum partials in another grouping (per device, then across devices): rounding only, of the size
        # of the logits (|logit| up to ~9 here: 1e-5 absolute was ~10 ulps and failed on some CPUs' BLAS)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # each rank really holds only its lanes
    r = sim.ranks[1]
    assert r.layers[0]["attn.q"].shape[0] == lanes // world and r.cache[0][0].shape[0] == lanes // world


def test_plan_contents():
    s = adapter.build_spec(Cfg(config(num_hidden_layers=6, broadcast_delay=2)))
    plan = lane_plan(s, 2)
    assert [d.lanes for d in plan.devices] == [(0, 1), (2, 3)]
    dev = plan.devices[1]
    assert dev.lane_slice == slice(2, 4)
    t0 = dev.sends_after(0, "attn")
    assert (t0.op, t0.consumers, t0.due, t0.elements) == (ALL_REDUCE, (0, 2), 0, 32)
    t2 = dev.sends_after(2, "ffn")
    assert (t2.op, t2.consumers, t2.slack) == (ALL_GATHER, (4,), 2)
    assert dev.sends_after(4, "attn") is None and dev.sends_after(5, "ffn") is None   # last d layers: no one reads
    assert [t.layer for t in dev.needs_before(3, "attn")] == [1]
    assert [t.layer for t in dev.needs_before(5, "ffn")] == [3]
    assert dev.needs_before(2, "attn")[0].sublayer == "attn"
    final = dev.sends_after(6, FINAL)
    assert final.op == ALL_REDUCE and dev.transfers[-1] is final
    assert all(d.transfers == dev.transfers for d in plan.devices)    # collectives match across ranks
    # no communication at all: only the final lane aggregation
    s = adapter.build_spec(Cfg(config(use_comm=False, use_early_comm=False)))
    assert [t.sublayer for t in lane_plan(s, 4).devices[0].transfers] == [FINAL]
    # no early comm: layers 0..d-1 send nothing at once, but layer d reads them late
    s = adapter.build_spec(Cfg(config(use_early_comm=False, broadcast_delay=2)))
    t = lane_plan(s, 2).devices[0].sends_after(1, "attn")
    assert (t.op, t.consumers) == (ALL_GATHER, (3,))


def test_world_must_divide_lanes():
    s = adapter.build_spec(Cfg(config()))
    with pytest.raises(ConfigError, match="num_lanes=4"):
        lane_plan(s, 3)


def test_in_process_collective():
    g = InProcessGroup(3, timeout=10)
    out = [None] * 3

    def run(r):
        c = g.handle(r)
        out[r] = (c.all_reduce_sum(torch.full((2,), float(r + 1))), c.all_gather(torch.tensor([r])))

    ts = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    for s, gathered in out:
        assert s.tolist() == [6.0, 6.0] and gathered.tolist() == [[0], [1], [2]]


def test_a_failing_rank_raises_instead_of_hanging(make_model):
    m = load_model(make_model(config()))
    sim = SimulatedDecoder(m.spec, m.weights, 2, timeout=10)

    def boom(ids):
        raise ValueError("rank 1 exploded")

    sim.ranks[1].forward = boom
    with pytest.raises(ValueError, match="rank 1 exploded"):
        sim.forward(torch.tensor(PROMPT))

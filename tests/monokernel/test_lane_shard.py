"""Laneformer over N ranks in the monokernel (Delayed Tensor Parallelism; lanes.py's docstring, shard.py): rank r
owns lanes [r L/N, (r+1) L/N), puts its pre-summed partials after each sublayer and waits for the other ranks' only
d layers later. Under TRITON_INTERPRET=1 with simulated ranks (shard.ShardedMonokernel): greedy tokens equal
dense/reference.py's decoder (and so each other) for N = 1, 2, 4; N = 1 runs the same put / signal / wait tasks and
equals the unsharded lane plan bit for bit; the task table's waits point d layers back. Small configs (2-4 lanes,
3 layers, 6 steps): each case stays well under 30 s in the interpreter."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from kie_moe.kernels.monokernel import lanes as LN
from kie_moe.kernels.monokernel import plan as P
from kie_moe.kernels.monokernel.runtime import MonokernelBackend
from kie_moe.kernels.monokernel.shard import ShardedMonokernel
from kie_moe.models.errors import ConfigError
from kie_moe.sampling import SamplingParams

from .test_laneformer import CASES as LANE_CASES
from .test_laneformer import PROMPT, lane_model, reference  # noqa: F401  (lane_model: the fixture)
from .test_shard import PTXAS

STEPS = 6
GREEDY = SamplingParams(max_new_tokens=STEPS, ignore_eos=True)
FOUR = dict(num_lanes=4, num_attention_heads=8, num_key_value_heads=4, intermediate_size=48)

CASES = {  # name: (config overrides, ranks)
    "d2_early-comm_pre-agg-2": ({}, 2),
    "d1_no-early_shared-norm_lane-mean-2": (LANE_CASES["d1_no-early_shared-norm_lane-mean_last2-unclamped"][0], 2),
    "d2_early_no-comm_lane-mean-2": (LANE_CASES["d2_early_no-comm_lane-norms_lane-mean_no-window"][0], 2),
    "d0_plain-tp-2": (LANE_CASES["d0_plain-tp_lane-norms_pre-agg_last2"][0], 2),
    "4-lanes_d2_lane-mean-2": (LANE_CASES["4-lanes_tied_lane-norms_lane-mean_d2"][0], 2),
    "4-lanes_d1_early-comm_pre-agg-4": (dict(FOUR, broadcast_delay=1), 4),
    "4-lanes_d2_no-early_lane-mean-4": (dict(FOUR, use_early_comm=False, pre_norm_lane_agg=False), 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_give_the_reference_tokens(case, lane_model):  # noqa: F811
    over, world = CASES[case]
    m = lane_model(over)
    sm = ShardedMonokernel(m, world, "cpu", n_sms=1)
    assert [be.plan.dims.LANES for be in sm.ranks] == [m.spec.num_lanes // world] * world
    prompt = PROMPT if world < 4 else PROMPT[:5]   # 4 interpreted ranks: fewer prompt steps (< 30 s)
    got = list(sm.generate(prompt, GREEDY, set()))
    want = reference(m, prompt, STEPS)[0]
    assert got == want and len(set(got)) >= 3
    D = m.spec.hidden_size
    xf = [be.x[be.plan.dims.LANES * D:(be.plan.dims.LANES + 1) * D] for be in sm.ranks]
    assert all(torch.equal(x, xf[0]) for x in xf[1:])   # the LM head's input: bit-identical on every rank


@pytest.mark.parametrize("case", ["d2_early_comm_lane-norms_pre-agg_first2",
                                  "d1_no-early_shared-norm_lane-mean_last2-unclamped",
                                  "d0_plain-tp_lane-norms_pre-agg_last2"])
def test_one_rank_is_the_unsharded_lane_plan_bit_for_bit(case, lane_model):  # noqa: F811
    m = lane_model(LANE_CASES[case][0])
    base = MonokernelBackend(m, "cpu", prefill="kernel", n_sms=1)
    want = list(base.generate(PROMPT, GREEDY, set()))
    sm = ShardedMonokernel(m, 1, "cpu", n_sms=1)
    assert list(sm.generate(PROMPT, GREEDY, set())) == want
    be = sm.ranks[0]
    d = be.plan.dims
    n_state = d.D * (d.LANES + 1)   # lanes + xf (the history ring's layout differs: TP keeps every layer's p)
    assert torch.equal(be.x[:n_state], base.x[:n_state]) and torch.equal(be.kv, base.kv)
    lay = be.plan.sym_layout()   # this rank's LM-head tile maxima: in its row of the symmetric pv
    assert torch.equal(be.sym.view(torch.float32)[lay["pv"]:lay["pv"] + be.plan.n_lm_tiles], base.pv)
    # the KCCL counters really counted: every step, one signal per put tile
    steps = len(PROMPT) - 1 + STEPS
    ctr = be.sym[lay["ctr"]:lay["ctr"] + lay["n_ctr"]]
    T, L = be.plan.tp_tiles, d.L
    assert int(ctr[2 * L * T]) == steps * be.plan.n_lm_tiles                    # LM head
    assert (ctr[2 * L * T + 1:] == steps).all()                                 # final aggregation tiles
    tasks = be.tasks(1)
    for xc in tasks[:, P.F_XCTR].tolist():
        if 0 <= xc < 2 * L * T:
            assert int(ctr[xc]) == steps


def _tasks(m, world, rank=0):
    rspec, store = LN.shard_lanes(m.spec, m.weights, rank, world)
    pl = P.build_plan(rspec, store, "cpu", tp=(rank, world), n_sms=2)
    return pl, P.build_tasks(pl)


@pytest.mark.parametrize("over", [{}, dict(broadcast_delay=1, use_early_comm=False), dict(broadcast_delay=0)],
                         ids=["d2_early", "d1_no-early", "d0"])
def test_wait_targets_are_d_layers_back(over, lane_model):  # noqa: F811
    """A delayed layer i's output tasks wait (F_XWAIT) on the KCCL counter of the same tile of layer i - d, never on
    their own layer's; same-layer totals (i < d with early comm; d = 0) go through REDUCE tasks; a layer puts
    (F_XCTR) exactly when some layer reads its partials; nothing waits on a counter nobody signals."""
    m = lane_model(over)
    pl, t = _tasks(m, 2)
    d, T, L = pl.dims, pl.tp_tiles, m.spec.num_layers
    assert (d.LANES, d.LANES_ALL, d.TP) == (1, 2, 2)
    xc = lambda i, k, tile: (i * 2 + k) * T + tile  # noqa: E731
    for k, op, rows in ((0, P.OP_LANE_O, pl.op_rows["o"]), (1, P.OP_LANE_DOWN, pl.op_rows["down"])):
        for i in range(L):
            outs = t[(t[:, P.F_OP] == op) & (t[:, P.F_LAYER] == i)]
            red = t[(t[:, P.F_OP] == P.OP_REDUCE) & (t[:, P.F_LAYER] == i) & (t[:, P.F_AUX] == k)]
            assert outs.shape[0] == len(rows)
            for tile, r in enumerate(outs.tolist()):
                if LN.delayed(d, i):
                    assert i >= d.DELAY > 0 and r[P.F_XWAIT] == xc(i - d.DELAY, k, tile)
                else:
                    assert r[P.F_XWAIT] == -1
                assert r[P.F_XCTR] == (xc(i, k, tile) if LN.sends(d, i) else -1)
            if LN.same_layer_total(d, i):
                assert [r[P.F_WAIT] for r in red.tolist()] == [xc(i, k, tile) for tile in range(len(rows))]
                assert (red[:, P.F_WCNT] == 2).all() and (red[:, P.F_WBASE] == 2).all()
            else:
                assert red.shape[0] == 0
    if over.get("broadcast_delay", 2) == 2:   # layers 0, 1: ALL (reduce); layer 2 waits for layer 0
        assert LN.delayed(d, 2) and not LN.delayed(d, 1) and not LN.sends(d, 2)
    puts = {x for x in t[:, P.F_XCTR].tolist() if x >= 0}
    waits = {x for x in t[:, P.F_XWAIT].tolist() if x >= 0}
    waits |= set(t[t[:, P.F_OP] == P.OP_REDUCE][:, P.F_WAIT].tolist())
    assert waits <= puts and len(waits) > 0
    agg = t[t[:, P.F_OP] == P.OP_LANE_AGG]
    assert agg.shape[0] == len(pl.op_rows["lane_agg"]) and (agg[:, P.F_XCTR] == 2 * L * T + 1).all()
    lay = pl.sym_layout()
    assert lay["words"] == 2 * L * 2 * d.D + 2 * d.D + 2 * 2 * pl.n_lm_tiles + 2 * L * T + 1 + agg.shape[0]


def test_shard_lanes_slices_and_refuses(lane_model):  # noqa: F811
    m = lane_model(FOUR)
    rspec, s = LN.shard_lanes(m.spec, m.weights, 1, 2)
    assert (rspec.num_lanes, rspec.num_heads, rspec.num_kv_heads, rspec.intermediate_size) == (2, 4, 2, 24)
    assert rspec.head_dim == m.spec.head_dim
    torch.testing.assert_close(s.get("layers.1.attn.q"), m.weights.get("layers.1.attn.q")[2:4])
    torch.testing.assert_close(s.get("layers.0.mlp.down"), m.weights.get("layers.0.mlp.down")[2:4])
    torch.testing.assert_close(s.get("layers.0.attn_norm"), m.weights.get("layers.0.attn_norm")[2:4])
    torch.testing.assert_close(s.get("embed"), m.weights.get("embed"))
    with pytest.raises(ConfigError, match="cannot split num_lanes=4"):
        LN.shard_lanes(m.spec, m.weights, 0, 3)


def test_deadlock_names_the_delayed_wait(lane_model):  # noqa: F811
    """A lane rank stuck at its delayed wait (here: on a counter nobody signals) is named: task, layer, rows."""
    m = lane_model(dict(broadcast_delay=1, use_early_comm=False))
    sm = ShardedMonokernel(m, 2, "cpu", n_sms=1)
    be = sm.ranks[1]
    tasks = be.tasks(1)
    row = next(i for i in range(tasks.shape[0]) if int(tasks[i, P.F_XWAIT]) >= 0)
    assert int(tasks[row, P.F_LAYER]) == 1 and int(tasks[row, P.F_OP]) == P.OP_LANE_O
    tasks[row, P.F_XWAIT] = 2 * m.spec.num_layers * be.plan.tp_tiles - 1   # the last layer's FFN: never put
    with pytest.raises(RuntimeError, match=r"deadlock: .*rank 1 waits at task \d+ \(lane_o_proj layer 1 rows"):
        list(sm.generate(PROMPT[:3], SamplingParams(max_new_tokens=1, ignore_eos=True), set()))

SCRIPT = r"""
import sys, torch
from kie_moe.models.registry import load_model
from kie_moe.kernels.monokernel.runtime import compile_offline
from kie_moe.kernels.monokernel.shard import rank_backend
m = load_model(sys.argv[1])
be = rank_backend(m, 1, 2, "cpu", offline=True, wdtype=torch.bfloat16, n_sms=132)
ptx = compile_offline(be).asm["ptx"]
for needle in ("ld.global.acquire.sys", "red.release.sys.global.add", "%globaltimer"):
    assert needle in ptx, needle
print("ok", len(ptx))
"""


@pytest.mark.skipif(not (os.path.exists(PTXAS) or shutil.which("ptxas")), reason="no ptxas in this triton build")
def test_lane_rank_kernel_compiles_for_sm90(lane_model):  # noqa: F811
    """Rank 1 of 2 of a lane-mean d1 model (delayed waits, puts, lane_agg / REDUCE aux 2) builds for sm_90."""
    m = lane_model(LANE_CASES["d1_no-early_shared-norm_lane-mean_last2-unclamped"][0])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, m.path], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "ok " in r.stdout


# ---- on one GPU: N = 1 through TpRank (what every `--devices N` worker runs) -----------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("case", ["d2_early_comm_lane-norms_pre-agg_first2",
                                  "d1_no-early_shared-norm_lane-mean_last2-unclamped"])
def test_gpu_one_rank_laneformer_equals_unsharded(case, lane_model):  # noqa: F811
    """One H200: the unsharded lane plan, the in-process sharded plan (N = 1) and TpRank (a one-rank NCCL group,
    torch symmetric memory) give the same tokens (2 lanes: the rank's sums equal the unsharded ones bit for bit),
    and the tokens match the fp32 reference for the first steps (bf16 arena)."""
    import torch.distributed as dist
    from kie_moe.kernels.monokernel.shard import TpRank
    from kie_moe.launch import free_port
    m = lane_model(LANE_CASES[case][0])
    p = SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = list(MonokernelBackend(m, "cuda", prefill="kernel").generate(PROMPT, p, set()))
    assert list(ShardedMonokernel(m, 1, "cuda").generate(PROMPT, p, set())) == want
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        r = TpRank(m)
        for _ in range(2):                                   # a second launch re-zeroes the region
            assert list(r.generate(PROMPT, p, set())) == want
    finally:
        dist.destroy_process_group()


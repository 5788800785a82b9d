"""Laneformer through the monokernel under TRITON_INTERPRET=1 (CPU), against dense/reference.py's decoder.

Greedy tokens must equal the reference's for 8 steps, the last step's LM-head tile maxima its logits, and the K/V
rows the kernel appended its per-lane caches (lane-major heads). Cases cover delays 0, 1, 2 and past the last layer,
early comm on / off, use_comm on / off, per-lane vs replicated norm scales, pre_norm_lane_agg on / off, windows
(first n, last |n|, all but one, unclamped layers, none), tied embeddings; plus small tiles (several tasks per op,
row chunks and K steps inside a task, the pipelined loads), the in-kernel prefill with attention splits, the CLI,
and the planner on the laneformer-2b shapes. Models are small (2-4 lanes, 3-4 layers): the interpreter is slow."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from kie_moe.dense.preset import write_checkpoint
from kie_moe.dense.reference import LaneformerDecoder, greedy
from kie_moe.kernels.monokernel import lanes as LN
from kie_moe.kernels.monokernel import plan as P
from kie_moe.kernels.monokernel.runtime import MonokernelBackend
from kie_moe.models.registry import load_model
from kie_moe.sampling import SamplingParams

PROMPT = [1, 5, 17, 33, 8, 60, 2, 44, 91]   # longer than every window below
N = 8
# 2 lanes x (2 q heads, 1 kv head), head_dim 8, FFN 16 per lane, 3 layers; weights std 0.3, norm scales 1 +- 0.2
BASE = dict(model_type="laneformer", vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, num_lanes=2, broadcast_delay=2, use_comm=True,
            use_early_comm=True, replicated_rmsn_scale=False, pre_norm_lane_agg=True, lm_head_type="replicate",
            sliding_window=3, sliding_window_n_layers=2, unclamped_layers=[], rope_theta=10000.0, norm_eps=1e-5,
            max_position_embeddings=64, eos_token_id=2, bos_token_id=1, tie_word_embeddings=False)

CASES = {  # name: (config overrides, programs the tiles are sized for)
    "d2_early_comm_lane-norms_pre-agg_first2": ({}, 1),
    "d1_no-early_shared-norm_lane-mean_last2-unclamped": (dict(
        use_early_comm=False, replicated_rmsn_scale=True, pre_norm_lane_agg=False, broadcast_delay=1,
        sliding_window_n_layers=-2, unclamped_layers=[-1]), 1),
    "d2_early_no-comm_lane-norms_lane-mean_no-window": (dict(
        use_comm=False, pre_norm_lane_agg=False, sliding_window=None), 2),
    "d1_no-comm-at-all_shared-norm_pre-agg_all-but-0": (dict(
        use_comm=False, use_early_comm=False, replicated_rmsn_scale=True, broadcast_delay=1, sliding_window=4,
        sliding_window_n_layers=None, unclamped_layers=[0]), 1),
    "d0_plain-tp_lane-norms_pre-agg_last2": (dict(broadcast_delay=0, sliding_window_n_layers=-2), 1),
    "d7_past-the-end_no-early_shared-norm": (dict(broadcast_delay=7, use_early_comm=False,
                                                  replicated_rmsn_scale=True), 1),
    # 4 lanes of 2 q heads over 1 kv head, tied embeddings, per-lane final norms
    "4-lanes_tied_lane-norms_lane-mean_d2": (dict(
        num_lanes=4, num_attention_heads=8, num_key_value_heads=4, intermediate_size=48, tie_word_embeddings=True,
        pre_norm_lane_agg=False), 1),
}


@pytest.fixture(scope="module")
def lane_model(tmp_path_factory):
    made = {}

    def get(overrides: dict):
        key = json.dumps(overrides, sort_keys=True)
        if key not in made:
            d = str(tmp_path_factory.mktemp("lf"))
            write_checkpoint({**BASE, **overrides}, d, dtype=torch.float32, seed=1, init_std=0.3, norm_jitter=0.2)
            made[key] = load_model(d)
        return made[key]
    return get


def reference(m, prompt, n):
    """(greedy tokens, the last forward's logits [V], the decoder's per-lane caches [(k, v) [L, T, hk, Dh]])."""
    dec = LaneformerDecoder(m.spec, m.weights)
    toks, logits = greedy(dec, torch.tensor(prompt), n)
    return toks, logits[-1][-1], dec.cache


def check(be, m, prompt, got):
    want, last, cache = reference(m, prompt, len(got))
    assert got == want
    assert len(set(got)) >= 3, f"degenerate greedy output {got}"
    for tile, (r0, n) in enumerate(be.plan.op_rows["lm"]):
        assert float(be.pv[tile]) == pytest.approx(float(last[r0:r0 + n].max()), rel=1e-4, abs=1e-4)
    p0, p1 = len(prompt) - 1, len(prompt) - 1 + len(got)
    d = be.plan.dims
    for i, (k, v) in enumerate(cache):   # lane l's kv head j is the kernel's kv head l * hk + j
        k = k.permute(0, 2, 1, 3).reshape(d.HKV, -1, d.DH)
        v = v.permute(0, 2, 1, 3).reshape(d.HKV, -1, d.DH)
        torch.testing.assert_close(be.kv[i, 0, :, p0:p1].float(), k[:, p0:p1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(be.kv[i, 1, :, p0:p1].float(), v[:, p0:p1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_reference(case, lane_model):
    over, n_sms = CASES[case]
    m = lane_model(over)
    be = MonokernelBackend(m, "cpu", n_sms=n_sms)
    assert be.plan.dims.LANES == m.spec.num_lanes
    assert be.attn_prec == "ieee"   # the Laneformer's default attention dots (bf16x2 measured -2.4%, session 34)
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=N, ignore_eos=True), set()))
    check(be, m, PROMPT, got)


def test_small_tiles_pipelined_loads(lane_model):
    """Two lane output tasks per op (rows of D re-tiled 16 + 16), two row chunks and two K steps inside each (tiles
    shrunk to 8 rows x 8 columns; K = 16 per lane); tl.range-pipelined weight loads; x as a broadcast tile. (2 layers,
    4 steps: every extra loop iteration costs ~20 ms in the interpreter.)"""
    m = lane_model(dict(num_hidden_layers=2, broadcast_delay=1, sliding_window_n_layers=1))
    be = MonokernelBackend(m, "cpu", num_stages=2, x_bcast=True)
    pl = be.plan
    assert LN.lane_k(pl.dims, "o") == LN.lane_k(pl.dims, "down") == 16 and pl.dims.D == 32
    pl.op_rows["o"] = pl.op_rows["down"] = [(0, 16), (16, 16)]
    pl.tiles = dataclasses.replace(pl.tiles, bn={**pl.tiles.bn, "o": 8, "down": 8, "o_k": 8, "down_k": 8})
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), set()))
    check(be, m, PROMPT, got)


def test_in_kernel_prefill_and_attention_splits(lane_model):
    m = lane_model(CASES["d1_no-early_shared-norm_lane-mean_last2-unclamped"][0])
    be = MonokernelBackend(m, "cpu", prefill="kernel")
    be.n_splits_override = 2
    got = list(be.generate(PROMPT[:6], SamplingParams(max_new_tokens=4, ignore_eos=True), set()))
    assert be.last_launch["n_forced"] == 5 and be.last_launch["n_splits"] == 2
    assert got == reference(m, PROMPT[:6], 4)[0]


def test_cli_generate_monokernel(lane_model, capsys):
    """`kie generate --device cpu --backend monokernel` on a Laneformer checkpoint (TRITON_INTERPRET=1)."""
    from kie_moe import cli
    m = lane_model(CASES["d1_no-comm-at-all_shared-norm_pre-agg_all-but-0"][0])
    args = ["generate", m.path, "--device", "cpu", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
            str(N), "--ignore-eos", "--json"]
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert cli.main(args + ["--backend", "monokernel"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["backend"] == "monokernel"
    assert out["token_ids"] == reference(m, PROMPT, N)[0]


def test_plan_of_laneformer_2b():
    """The preview's shapes on 132 SMs (no weights): lane-homogeneous, balanced q|k|v and gate|up tiles covering
    every row once, o / down tiles over D, dependencies in topological order."""
    spec = P.preset_spec("laneformer-2b")
    plan = P.build_plan(spec, None, "meta", n_sms=132)
    d = plan.dims
    assert (d.LANES, d.DELAY, d.EARLY_COMM, d.USE_COMM, d.LANE_NORM, d.PRE_AGG) == (8, 2, 1, 1, 1, 1)
    qL, kL, fL = d.HQ * d.DH // 8, d.HKV * d.DH // 8, d.I_DENSE // 8
    for op, bounds, total in (("qkv", [qL] * 8 + [kL] * 16, d.NQKV), ("gateup", [fL] * 8, d.I_DENSE)):
        tiles = plan.op_rows[op]
        assert [r for r, _ in tiles] == sorted(r for r, _ in tiles) and sum(n for _, n in tiles) == total
        cuts, r = set(), 0
        for b in bounds:
            r += b
            cuts.add(r)
        assert all(not any(r0 < c < r0 + n for c in cuts) for r0, n in tiles), op   # never across lanes
        assert len(tiles) <= 2 * 132 and max(n for _, n in tiles) <= 1.1 * total / len(tiles) + 1, op
    assert len(plan.op_rows["qkv"]) == 128 and len(plan.op_rows["o"]) == 128
    tasks = P.build_tasks(plan, 1)
    seen: dict[int, int] = {}
    for i, r in enumerate(tasks.tolist()):
        assert seen.get(r[P.F_WAIT], 0) >= r[P.F_WBASE], P.describe_task(tasks, i)
        seen[r[P.F_SIG]] = seen.get(r[P.F_SIG], 0) + 1
        if r[P.F_OP] == P.OP_QKV:
            assert r[P.F_AUX] == LN.qkv_lane(d, r[P.F_ROW0]) == LN.qkv_lane(d, r[P.F_ROW0] + r[P.F_NROWS] - 1)
    ops = tasks[:, P.F_OP].tolist()
    assert P.OP_LANE_AGG not in ops and ops.count(P.OP_LANE_DOWN) == 15 * len(plan.op_rows["down"])
    assert plan.weight_bytes_per_token() == pytest.approx(2 * (spec.num_params - 15 * 2 * 8 * 4096 - 4096 - 32768 * 4096))


def test_top_k_sampling_replays_the_graph_sampler(lane_model):
    """A Laneformer plan takes the filtered sampler too (lanes.build_lane_tasks' sample tiles): each token is the
    one kernels/sampling.py draws from the reference decoder's logits with the same seed and step."""
    from kie_moe.kernels.sampling import DeviceSampler
    m = lane_model({})
    be = MonokernelBackend(m, "cpu", sample_block_v=32, k_cand=8)            # 97 ids: 4 vocab tiles
    p = SamplingParams(max_new_tokens=4, temperature=1.3, top_k=6, seed=77, ignore_eos=True)
    got = list(be.generate(PROMPT, p, set()))
    assert be.last_launch["filtered"] and be.filter_sampler().n_tiles == 4
    dec = LaneformerDecoder(m.spec, m.weights)
    logits = dec.forward(torch.tensor(PROMPT))[-1]
    for s, tok in enumerate(got):
        ds = DeviceSampler(m.spec.vocab_size, "cpu", k_cand=8, block_v=32).configure(1.3, 6, 1.0, 77, s)
        assert tok == int(ds(logits.float())[0]), f"step {s}"
        assert tok in torch.topk(logits, 6).indices.tolist()
        logits = dec.forward(torch.tensor([tok]))[-1]

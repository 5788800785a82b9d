"""The monokernel's router top-k (kernels/monokernel/ops.route) alone against kernels/moe.route_ref on the same
logits (an identity router matrix makes route_ref's logits the input): every scoring, renormalisation, correction
bias, group-limited choice, ties, E not a power of 2."""

import pytest
import torch
import triton
import triton.language as tl

from kie_moe.kernels.moe import SCORE_ID, RouterConfig, route_ref
from kie_moe.kernels.monokernel.ops import route

from ..kernels.helpers import DEV, needs_device

pytestmark = needs_device


@triton.jit
def _route_kernel(lg_ptr, sb_ptr, ids_ptr, w_ptr, scale, E: tl.constexpr, TOPK: tl.constexpr, SCORING: tl.constexpr,
                  NORM_TOPK: tl.constexpr, HAS_SBIAS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                  NG: tl.constexpr, TG: tl.constexpr, GSCORE: tl.constexpr, BLOCK_G: tl.constexpr,
                  MERGE: tl.constexpr):
    ids, w = route(lg_ptr, sb_ptr, scale, E, TOPK, SCORING, NORM_TOPK, HAS_SBIAS, BLOCK_E, BLOCK_TOPK, NG, TG,
                   GSCORE, BLOCK_G, MERGE)
    j = tl.arange(0, BLOCK_TOPK)
    tl.store(ids_ptr + j, ids, mask=j < TOPK)
    tl.store(w_ptr + j, w, mask=j < TOPK)


def _run(logits, cfg, sbias, merge=False):
    E, k = logits.numel(), cfg.top_k
    ids = torch.full((k,), -1, dtype=torch.int32, device=DEV)
    w = torch.full((k,), float("nan"), device=DEV)
    sb = sbias if sbias is not None else logits
    _route_kernel[(1,)](logits.to(DEV), sb.to(DEV), ids, w, cfg.routed_scaling_factor, E, k, SCORE_ID[cfg.scoring],
                        cfg.norm_topk_prob, sbias is not None, triton.next_power_of_2(E),
                        triton.next_power_of_2(k), cfg.n_group, cfg.topk_group, int(cfg.group_score == "top2"),
                        triton.next_power_of_2(cfg.n_group), merge, num_warps=4)
    return ids.cpu(), w.cpu()


# (E, cfg, correction bias, ties): qwen3-like softmax + renorm, mixtral top-2, sigmoid + bias + top-2-sum groups
# (DeepSeek-V3), max-scored groups (V2), gpt-oss's softmax over the top-k, an un-renormalised top-3 of 9
CASES = [
    (128, RouterConfig(8, "softmax", True), False, False),
    (8, RouterConfig(2, "softmax", True), False, True),
    (64, RouterConfig(6, "sigmoid", True, 2.5, n_group=8, topk_group=3, group_score="top2"), True, False),
    (40, RouterConfig(5, "softmax", False, 1.0, n_group=4, topk_group=2, group_score="max"), False, False),
    (32, RouterConfig(4, "softmax_topk", False), False, True),
    (9, RouterConfig(3, "softmax", False), False, True),
    (16, RouterConfig(4, "softmax", True, 2.0), False, True),    # renormalised softmax, scaled: the top-k's softmax
    (20, RouterConfig(3, "sigmoid", True), False, True),         # sigmoid without a correction bias
]


@pytest.mark.parametrize("merge", [False, True], ids=["slots", "merge"])
@pytest.mark.parametrize("E,cfg,bias,ties", CASES, ids=[f"E{c[0]}-{c[1].scoring}-k{c[1].top_k}" for c in CASES])
def test_route_matches_route_ref(E, cfg, bias, ties, merge):
    """merge: 4 slots per reduction (ops.route_lg MERGE; the correction-bias case keeps one slot per round)."""
    g = torch.Generator().manual_seed(E + cfg.top_k)
    logits = torch.randn(E, generator=g) * 2
    if ties:   # two experts tie for first place, two more elsewhere
        logits[E // 2] = logits[1] = logits.max() + 1
        logits[E - 1] = logits[0]
    sbias = torch.randn(E, generator=g) * 0.1 if bias else None
    want = route_ref(logits, torch.eye(E), cfg, correction_bias=sbias)
    ids, w = _run(logits, cfg, sbias, merge)
    # torch.topk leaves the order of ties open; the kernel's rule is the lower id first (no bias in the tie cases:
    # the choice is monotonic in the logits)
    order = sorted(want.ids.tolist(), key=lambda e: (-float(logits[e]), e)) if ties else want.ids.tolist()
    assert ids.tolist() == order
    by_id = dict(zip(want.ids.tolist(), want.weights.float().tolist()))
    torch.testing.assert_close(w, torch.tensor([by_id[e] for e in order]), rtol=1e-6, atol=1e-7)


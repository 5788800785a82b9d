"""Router and routed-expert kernels vs their torch references (Triton interpreter on CPU)."""

import pytest
import torch
import triton

from kie_moe.kernels.gemv import TileConfig, gemv, gemv_ref
from kie_moe.kernels.moe import (PendingRouting, RouterConfig, fold_router, fold_router_bias, gemv_route, moe_experts,
                                 moe_experts_ref, route, route_ref)
from kie_moe.kernels.weights import WeightHandle, dequantize, random_weight

from .helpers import DEV, FORMATS, INTERPRET, assert_close, needs_device

pytestmark = needs_device


def _t(*shape, seed=0, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEV)


# ---- router -------------------------------------------------------------------------------------------------------
ROUTERS = {
    # Qwen3-MoE / Mixtral: softmax over all experts, top-k, renormalised
    "softmax_norm": (20, RouterConfig(top_k=4), {}),
    # DeepSeek-V2 style without renormalisation, scaled
    "softmax_raw": (20, RouterConfig(top_k=3, norm_topk_prob=False, routed_scaling_factor=16.0), {}),
    # DeepSeek-V3: sigmoid, correction bias for the choice only, 4 of 6 groups by sum-of-top-2, x2.5
    "sigmoid_groups": (24, RouterConfig(top_k=5, scoring="sigmoid", n_group=6, topk_group=2,
                                        routed_scaling_factor=2.5), {"correction_bias": 1}),
    # DeepSeek-V2 group-limited greedy: softmax, groups scored by their best expert
    "softmax_groups_max": (24, RouterConfig(top_k=4, n_group=4, topk_group=3, group_score="max"), {}),
    # gpt-oss: router bias, top-k on logits, softmax over the k picked
    "softmax_topk_bias": (20, RouterConfig(top_k=4, scoring="softmax_topk"), {"router_bias": 1}),
}


def _router_extras(E: int, extra: dict, seed: int, bias_dtype=torch.bfloat16) -> dict:
    """route()'s optional tensors a ROUTERS entry names: correction bias (fp32, seed), router bias (seed + 1)."""
    kw = {}
    if "correction_bias" in extra:
        kw["correction_bias"] = _t(E, seed=seed, dtype=torch.float32, scale=0.1)
    if "router_bias" in extra:
        kw["router_bias"] = _t(E, seed=seed + 1, dtype=bias_dtype, scale=0.5)
    return kw


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("split", [1, 3])
def test_route(name, split):
    E, cfg, extra = ROUTERS[name]
    H = 160
    x, w = _t(H, seed=1), _t(E, H, seed=2, scale=0.2)
    kw = _router_extras(E, extra, seed=3)
    got = route(x, w, cfg, config=TileConfig(8, 64, split_k=split), **kw)
    want = route_ref(x, w, cfg, **kw)
    assert got.ids.dtype == torch.int32 and got.weights.dtype == torch.float32
    assert got.ids.tolist() == want.ids.tolist(), f"{name}: ids {got.ids.tolist()} vs {want.ids.tolist()}"
    assert_close(got.weights, want.weights, what=f"{name} weights")
    assert_close(got.logits, want.logits, what=f"{name} logits")


@pytest.mark.parametrize("scoring", ["softmax", "softmax_topk", "sigmoid"])
def test_route_ties_go_to_the_lower_id(scoring):
    """The documented order (torch.topk, the reference, leaves ties unspecified): equal scores rank by expert id,
    both among all experts (x = 0: every logit 0) and at the k-th place (experts 3 and 6 tie for the last slot)."""
    E, H, k = 12, 32, 4
    cfg = RouterConfig(top_k=k, scoring=scoring)
    w = torch.zeros(E, H, dtype=torch.bfloat16, device=DEV)
    assert route(torch.zeros(H, dtype=torch.bfloat16, device=DEV), w, cfg).ids.tolist() == [0, 1, 2, 3]
    x = torch.zeros(H, dtype=torch.bfloat16, device=DEV)
    x[0] = 1
    for e, v in ((9, 4.0), (1, 3.0), (6, 2.0), (3, 2.0), (0, 1.0)):
        w[e, 0] = v
    r = route(x, w, cfg)
    assert r.ids.tolist() == [9, 1, 3, 6]
    assert_close(r.weights, route_ref(x, w, cfg).weights, what=f"{scoring} weights")


def test_route_groups_exclude_best_expert():
    """Group-limited top-k must skip a strong expert whose group loses (checks the mask, not just agreement)."""
    E, H = 16, 32
    cfg = RouterConfig(top_k=2, scoring="sigmoid", n_group=4, topk_group=1)
    x = torch.zeros(H, dtype=torch.bfloat16, device=DEV)
    x[0] = 1
    w = torch.full((E, H), -4.0, dtype=torch.bfloat16, device=DEV)
    w[0, 0] = 5.0  # the single best expert, in group 0 whose second best is weak
    w[4, 0], w[5, 0] = 3.0, 2.5  # group 1: two good experts -> larger top-2 sum
    got = route(x, w, cfg)
    assert got.ids.tolist() == [4, 5]
    assert route_ref(x, w, cfg).ids.tolist() == got.ids.tolist()


@pytest.mark.parametrize("split", [1, 3])
def test_route_with_rmsnorm_and_out_buffers(split):
    """The RMSNorm scale comes from each split's sum of x^2 (row tile 0 of each split writes it)."""
    E, H = 20, 96
    cfg = RouterConfig(top_k=4)
    tiles = TileConfig(8, 32, split_k=split)
    x, w, nw = _t(H, seed=5, scale=4.0), _t(E, H, seed=6, scale=0.2), _t(H, seed=7)
    out = route(x, w, cfg, norm_weight=nw, eps=1e-5, config=tiles)
    again = route(x, w, cfg, norm_weight=nw, eps=1e-5, out=out, config=tiles)  # preallocated (CUDA-graph style)
    assert again.ids.data_ptr() == out.ids.data_ptr()
    want = route_ref(x, w, cfg, norm_weight=nw, eps=1e-5)
    assert again.ids.tolist() == want.ids.tolist()
    assert_close(again.weights, want.weights, what="normed router")


@pytest.mark.parametrize("split", [1, 3])
def test_route_hands_float_experts_the_normed_x(split):
    """xn_out: every element of the RMS-normed x (NaN-filled first: each must be written) whatever the split; float
    experts given it with norm_weight None match the reference with the norm fused; x8_out with it is refused."""
    E, I, H = 6, 37, 100   # H: not a multiple of the router's 32-column chunks
    cfg = RouterConfig(top_k=2)
    x, w, nw = _t(H, seed=8, scale=3.0), _t(E, H, seed=9, scale=0.2), _t(H, seed=10)
    xn = torch.full((H,), float("nan"), device=DEV)
    r = route(x, w, cfg, norm_weight=nw, eps=1e-5, xn_out=xn, config=TileConfig(8, 32, split_k=split))
    xf = x.float()
    assert_close(xn, xf * torch.rsqrt(xf.pow(2).mean() + 1e-5) * nw.float(), what="xn_out")
    wg, wu, wd = _experts("fp8", E, I, H, seed=11)
    y = moe_experts(xn, r.ids, r.weights, wg, wu, wd, residual=x, out=torch.empty(H, device=DEV))
    want = moe_experts_ref(x, r.ids, r.weights, wg, wu, wd, residual=x, norm_weight=nw, eps=1e-5,
                           out_dtype=torch.float32)
    assert_close(y, want, what="experts on the router's xn")
    with pytest.raises(ValueError, match="at most one of x8_out, xn_out, xh_out"):
        route(x, w, cfg, x8_out=torch.empty(8, 12, device=DEV), xn_out=xn)
    with pytest.raises(ValueError, match=r"xn_out must be a contiguous fp32 \[100\]"):
        route(x, w, cfg, xn_out=torch.empty(H, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(ValueError, match=r"route: xh_out: the xh layout needs K % 16 == 0 .* K = 100"):
        route(x, w, cfg, xh_out=torch.empty(H, dtype=torch.float16, device=DEV))   # 100: a ragged group of 8


@pytest.mark.parametrize("fmt,split", [("nvfp4", 1), ("mxfp4", 3)])
def test_route_hands_tensor_core_fp4_experts_their_xh(fmt, split, monkeypatch):
    """xh_out: the router launch writes what fp4_mma.prepare_xh would (normed x, fp16, each 8 in the order 0, 2, 1,
    3, 4, 6, 5, 7), every element (NaN-filled first) whatever the split; the tensor-core experts given it
    (moe_experts(xh=)) launch no prepare_xh of their own and give the same y as with it; bad buffers are named."""
    import kie_moe.kernels.fp4_mma as FM
    E, I, H = 5, 64, 160
    cfg = RouterConfig(top_k=2)
    x, w, nw = _t(H, seed=30, scale=3.0), _t(E, H, seed=31, scale=0.2), _t(H, seed=32)
    xh = torch.full((H,), float("nan"), dtype=torch.float16, device=DEV)
    r = route(x, w, cfg, norm_weight=nw, eps=1e-5, xh_out=xh, config=TileConfig(8, 32, split_k=split))
    want_xh = FM.prepare_xh(x, nw, 1e-5)
    assert not xh.isnan().any()
    # one fp16 ulp at most: the RMSNorm scale's sum may run in another warp order than prepare_xh's launch
    assert ((xh.float() - want_xh.float()).abs() <= want_xh.float().abs() * 2.0 ** -10).all()
    wg, wu, wd = _experts(fmt, E, I, H, seed=33)
    calls = []
    real = FM.prepare_xh
    monkeypatch.setattr(FM, "prepare_xh", lambda *a, **k: calls.append(1) or real(*a, **k))
    y = moe_experts(x, r.ids, r.weights, wg, wu, wd, residual=x, mma=True, xh=xh, out=torch.empty(H, device=DEV))
    assert calls == []
    y_own = moe_experts(x, r.ids, r.weights, wg, wu, wd, residual=x, norm_weight=nw, eps=1e-5, mma=True,
                        out=torch.empty(H, device=DEV))
    assert calls == [1]
    if torch.equal(xh, want_xh):
        assert torch.equal(y, y_own)
    assert_close(y, moe_experts_ref(x, r.ids, r.weights, wg, wu, wd, residual=x, norm_weight=nw, eps=1e-5,
                                    out_dtype=torch.float32, fp16_inputs=True), what=f"{fmt} experts on xh_out")
    with pytest.raises(ValueError, match="at most one of x8_out, xn_out, xh_out"):
        route(x, w, cfg, x8_out=torch.empty(8, H // 8, device=DEV), xh_out=xh)
    with pytest.raises(ValueError, match=r"route: xh_out must be a contiguous, 16-byte aligned fp16 \[160\]"):
        route(x, w, cfg, xh_out=torch.empty(H, device=DEV))
    with pytest.raises(ValueError, match=r"\['xh'\] apply to the tensor-core path only"):
        moe_experts(x, r.ids, r.weights, wg, wu, wd, mma=False, xh=xh)


# ---- routed experts -----------------------------------------------------------------------------------------------
def _experts(fmt, E, I, H, seed=0):
    return (random_weight(fmt, I, H, experts=E, seed=seed, device=DEV),
            random_weight(fmt, I, H, experts=E, seed=seed + 1, device=DEV),
            random_weight(fmt, H, I, experts=E, seed=seed + 2, device=DEV))


@pytest.mark.parametrize("name,fmt,split,normed", [
    ("softmax_norm", "fp8", 3, True), ("softmax_norm", "bf16", 1, False), ("softmax_raw", "fp8_block", 1, True),
    ("sigmoid_groups", "bf16", 3, True), ("softmax_groups_max", "fp8", 1, False),
    ("softmax_topk_bias", "nvfp4", 3, True), ("softmax_norm", "mxfp4", 1, True)])
def test_deferred_routing_picks_the_experts_in_the_glu_launch(name, fmt, split, normed):
    """route(defer=True) + moe_experts(select=): the router launch leaves partial logits, the experts' GLU launch
    runs the top-k (every program; program (0, 0) stores it). ids / weights / logits equal the router's own
    selection and route_ref, y equals moe_experts_ref on the reference's routing, whatever the router variant (groups,
    correction, bias, softmax over the top-k), split, fused norm (its scale taken from the router's sums) or format
    (fp4: the router also writes the experts' x8 input)."""
    E, cfg, extra = ROUTERS[name]
    H, I = 96, 64
    x, w, nw = _t(H, seed=30, scale=3.0), _t(E, H, seed=31, scale=0.2), _t(H, seed=32)
    kw = _router_extras(E, extra, seed=33)
    norm = dict(norm_weight=nw, eps=1e-5) if normed else {}
    tiles = TileConfig(8, 32, split_k=split)
    fp4 = fmt in ("nvfp4", "mxfp4")
    x8 = torch.full((8, H // 8), float("nan"), device=DEV) if fp4 and normed else None
    p = route(x, w, cfg, config=tiles, defer=True, x8_out=x8, **norm, **kw)
    assert isinstance(p, PendingRouting) and p.split == split and p.normed == normed
    for t in (p.ids, p.weights, p.logits):   # nothing selected yet: poison what the GLU launch must write
        t.fill_(-7)
    wg, wu, wd = _experts(fmt, E, I, H, seed=35)
    res = _t(H, seed=36)
    cfg_e = TileConfig(16, 32, num_warps=2)
    y = moe_experts(x, p.ids, p.weights, wg, wu, wd, residual=res, out=torch.empty(H, device=DEV), x8=x8,
                    config_up=cfg_e, config_down=cfg_e, select=p, **norm)
    want_r = route_ref(x, w, cfg, **norm, **kw)
    once = route(x, w, cfg, config=tiles, **norm, **kw)
    assert p.ids.tolist() == once.ids.tolist() == want_r.ids.tolist()
    assert_close(p.weights, want_r.weights, what=f"{name} deferred weights")
    # the same code in launches of other warp counts: the normaliser and the RMSNorm scale are summed in a fixed
    # order, so bit-equal; only a softmax over all experts (without the top-k's renormalisation) sums in tl.sum's
    assert torch.equal(p.logits, once.logits), f"{name}: deferred logits differ from the router's own"
    if cfg.scoring == "softmax" and ("correction_bias" in extra or not cfg.norm_topk_prob):
        assert_close(p.weights, once.weights, what=f"{name} deferred vs one-launch weights")
    else:
        assert torch.equal(p.weights, once.weights), (f"{name}: deferred weights {p.weights.tolist()} differ from the "
                                                      f"router's own {once.weights.tolist()}")
    want = moe_experts_ref(x, want_r.ids, want_r.weights, wg, wu, wd, residual=res, out_dtype=torch.float32, **norm)
    assert_close(y, want, what=f"{name} {fmt} experts after a deferred top-k")


@pytest.mark.parametrize("per_round", [2, 4])
def test_topk_picks_per_round(per_round, monkeypatch):
    """KIE_TOPK_PER_ROUND: 2 or 4 (the default) picks per block-wide reduction (tl.reduce over sorted lists) give the
    one-pick rounds' ids and bit-equal weights and logits for every router variant (top-3 and top-5 end on a part round;
    groups, correction bias, softmax over the top-k), in the router's tail and in the GLU launch that picks
    (defer=True); ties still go to the lower id."""
    import kie_moe.kernels.moe as M
    H = 160
    x, w_all = _t(H, seed=1), {n: _t(E, H, seed=2, scale=0.2) for n, (E, _, _) in ROUTERS.items()}
    kws = {name: _router_extras(E, extra, seed=3) for name, (E, _, extra) in ROUTERS.items()}
    tiles = TileConfig(8, 64, split_k=3)
    monkeypatch.setattr(M, "TOPK_PER_ROUND", 1)
    base = {n: route(x, w_all[n], cfg, config=tiles, **kws[n]) for n, (_, cfg, _) in ROUTERS.items()}
    monkeypatch.setattr(M, "TOPK_PER_ROUND", per_round)
    for name, (E, cfg, _) in ROUTERS.items():
        assert M._select_meta(cfg, E, 3, False)["PER_ROUND"] == min(per_round, triton.next_power_of_2(cfg.top_k))
        got = route(x, w_all[name], cfg, config=tiles, **kws[name])
        assert got.ids.tolist() == base[name].ids.tolist() == route_ref(x, w_all[name], cfg, **kws[name]).ids.tolist()
        assert torch.equal(got.weights, base[name].weights), f"{name}: {got.weights} vs {base[name].weights}"
        assert torch.equal(got.logits, base[name].logits), name
    for scoring in ("softmax", "softmax_topk", "sigmoid"):
        test_route_ties_go_to_the_lower_id(scoring)
    test_deferred_routing_picks_the_experts_in_the_glu_launch("softmax_norm", "fp8", 3, True)
    test_deferred_routing_picks_the_experts_in_the_glu_launch("sigmoid_groups", "bf16", 1, True)


@pytest.mark.parametrize("split", [1, 3])
def test_softmax_router_renormalised_over_its_picks_picks_on_the_logits(split, monkeypatch):
    """KIE_ROUTER_SOFTMAX_ON_PICKS (on): a softmax router renormalised over its top-k, without groups or a correction
    bias, picks on the logits and exponentiates the k picks only (select_score -> "softmax_topk"). Against the
    softmax over all E first (=0): the same ids and bit-equal weights and logits, in the router's tail and in the GLU
    launch that picks (defer=True), with and without the fused RMSNorm, ties included (all-zero logits)."""
    import kie_moe.kernels.moe as M
    H, I = 96, 40
    sid = M.SCORE_ID
    assert M.select_score(ROUTERS["softmax_norm"][1], False) == sid["softmax_topk"]
    for name, want in (("softmax_raw", "softmax"), ("softmax_groups_max", "softmax"), ("sigmoid_groups", "sigmoid")):
        assert M.select_score(ROUTERS[name][1], "correction_bias" in ROUTERS[name][2]) == sid[want], name
    assert M.select_score(RouterConfig(top_k=2), True) == sid["softmax"]   # a correction bias keeps the full softmax
    E, cfg = 20, RouterConfig(top_k=4)
    tiles = TileConfig(8, 32, split_k=split)
    nw = _t(H, seed=42)
    wg, wu, wd = _experts("fp8", E, I, H, seed=43)
    cases = [(_t(H, seed=40, scale=3.0), _t(E, H, seed=41, scale=0.2)),
             (torch.zeros(H, dtype=torch.bfloat16, device=DEV), _t(E, H, seed=41, scale=0.2))]   # every logit 0: ties
    cfg_e = TileConfig(16, 32, num_warps=2)

    def run(x, w, norm):
        one = route(x, w, cfg, config=tiles, **norm)
        p = route(x, w, cfg, config=tiles, defer=True, **norm)
        y = moe_experts(x, p.ids, p.weights, wg, wu, wd, out=torch.empty(H, device=DEV), config_up=cfg_e,
                        config_down=cfg_e, select=p, split=1, **norm)   # split 1: the ordered down, bit-comparable
        return one, p, y

    for x, w in cases:
        for norm in ({}, dict(norm_weight=nw, eps=1e-5)):
            monkeypatch.setattr(M, "SOFTMAX_ON_PICKS", False)
            base = run(x, w, norm)
            monkeypatch.setattr(M, "SOFTMAX_ON_PICKS", True)
            got = run(x, w, norm)
            if x.any():   # torch.topk (the reference) leaves the order of ties unspecified; ours: lower id first
                assert got[0].ids.tolist() == route_ref(x, w, cfg, **norm).ids.tolist()
            else:
                assert got[0].ids.tolist() == [0, 1, 2, 3]
            for g, b in zip(got[:2], base[:2]):
                assert g.ids.tolist() == b.ids.tolist()
                assert torch.equal(g.weights, b.weights), f"{g.weights.tolist()} vs {b.weights.tolist()}"
                assert torch.equal(g.logits, b.logits)
            assert torch.equal(got[2], base[2])


def test_deferred_routing_errors():
    E, cfg, _ = ROUTERS["softmax_norm"]
    H, I = 64, 32
    x, w, nw = _t(H, seed=40), _t(E, H, seed=41, scale=0.2), _t(H, seed=42)
    wg, wu, wd = _experts("bf16", E, I, H, seed=43)
    p = route(x, w, cfg, norm_weight=nw, eps=1e-5, defer=True)
    other = torch.zeros_like(p.ids)
    with pytest.raises(ValueError, match="ids and weights must be select.ids and select.weights"):
        moe_experts(x, other, p.weights, wg, wu, wd, select=p)
    with pytest.raises(ValueError, match="norm eps 1e-06 differs from the router's 1e-05"):
        moe_experts(x, p.ids, p.weights, wg, wu, wd, norm_weight=nw, eps=1e-6, select=p)
    with pytest.raises(ValueError, match="select= needs the CUDA-core expert launches"):
        moe_experts(x, p.ids, p.weights, *_experts("nvfp4", E, 64, H, seed=44), mma=True, select=p)
    with pytest.raises(ValueError, match="select routes over 20 experts, the stacks hold 5"):
        moe_experts(x, p.ids, p.weights, *_experts("bf16", 5, I, H, seed=45), select=p)
    with pytest.raises(ValueError, match="select must be route\\(defer=True\\)'s PendingRouting"):
        moe_experts(x, p.ids, p.weights, wg, wu, wd, select=route(x, w, cfg))


def _assert_same_gemv(y, y_gemv, a, wo, x, bias):
    """gemv_route's o_proj rows against gemv()'s: the same tile loop, so bit for bit under the interpreter. Compiled,
    the two kernels' other code lets ptxas contract and order the fp32 epilogue differently (H100: a few ulps of
    |W| |a| + |x|), so there the allowance is 8 fp32 ulps of that absolute sum."""
    if INTERPRET:
        assert torch.equal(y, y_gemv), "gemv_route's y differs from gemv's"
        return
    mag = dequantize(wo).abs() @ a.float().abs() + x.float().abs() + (bias.float().abs() if bias is not None else 0)
    err = (y.float() - y_gemv.float()).abs()
    assert (err <= 8 * 2.0 ** -24 * mag).all(), (f"gemv_route's y differs from gemv's by {(err / mag).max().item():.3g}"
                                                  " of |W| |a| + |x|")


@pytest.mark.parametrize("name,o_fmt,e_fmt,k_steps,bias", [
    ("softmax_norm", "fp8", "fp8", 1, False), ("softmax_raw", "bf16", "fp8_block", 2, True),
    ("sigmoid_groups", "fp8_block", "bf16", 1, False), ("softmax_groups_max", "fp8", "bf16", 3, False),
    ("softmax_topk_bias", "bf16", "fp8", 1, True), ("softmax_norm", "fp8", "nvfp4", 1, False),
    ("softmax_topk_bias", "bf16", "mxfp4", 2, True)])
def test_router_folded_into_the_gemv_in_front(name, o_fmt, e_fmt, k_steps, bias):
    """gemv_route (the router launch folded into o_proj's): y equals gemv's own y bit for bit, and the experts' GLU
    launch, scaling the folded logits by y's RMSNorm scale, picks route_ref's experts on y with its weights and
    logits, whatever the router variant, the o_proj format, the K ranges of the router rows (32 / 64 / 96 columns:
    5 / 3 / 2 ragged ranges over a's K = 136, 3 / 2 / 1 over the residual's N = 96) or a GEMV bias (its logit
    term folded too: fold_router_bias); y after the experts matches moe_experts_ref on that routing (fp4 experts:
    on gemv_route's x8_out, nw * y without y's scale, their gate / up sums scaled in the GLU launch). fp32
    activations and folded weights, as the interpreter's graph backend."""
    E, cfg, extra = ROUTERS[name]
    N, K, I = 96, 136, 64
    f32 = torch.float32
    wo = random_weight(o_fmt, N, K, seed=50, device=DEV)
    a, x = _t(K, seed=51, dtype=f32), _t(N, seed=52, dtype=f32, scale=3.0)
    w_r, nw = _t(E, N, seed=53, scale=0.2, dtype=f32), _t(N, seed=54, dtype=f32)
    kw = _router_extras(E, extra, seed=55, bias_dtype=f32)
    o_tiles = TileConfig(8, 32)
    o_bias = _t(N, seed=57, dtype=f32) if bias else None
    fb = dict(bias=o_bias, fold_bias=fold_router_bias(w_r, nw, o_bias)) if bias else {}
    w_f = fold_router(w_r, nw, wo)
    assert w_f.dtype == f32 and w_f.shape == (E, K)
    x8 = torch.full((8, N // 8), float("nan"), device=DEV) if e_fmt in ("nvfp4", "mxfp4") else None
    y, p = gemv_route(a, wo, x, w_f, w_r, nw, cfg, eps=1e-5, config=o_tiles, **fb, x8_out=x8,
                      router_config=TileConfig(8, 32), router_k_steps=k_steps, **kw)
    assert isinstance(p, PendingRouting) and p.rstd_x is y and p.x8 is x8
    if x8 is not None:   # nw * y in the x8 layout: x8[e, j] = (nw * y)[8 j + e]
        assert torch.equal(x8, (nw * y).reshape(N // 8, 8).t())
    assert p.split == -(-K // (32 * k_steps)) + -(-N // (32 * k_steps))
    _assert_same_gemv(y, gemv(a, wo, bias=o_bias, residual=x, config=o_tiles), a, wo, x, o_bias)
    assert_close(y, gemv_ref(a, wo, bias=o_bias, residual=x), what=f"{o_fmt} y")
    for t in (p.ids, p.weights, p.logits):   # nothing selected yet: poison what the GLU launch must write
        t.fill_(-7)
    wg, wu, wd = _experts(e_fmt, E, I, N, seed=58)
    res = _t(N, seed=59, dtype=f32)
    cfg_e = TileConfig(16, 32, num_warps=2)
    out = moe_experts(y, p.ids, p.weights, wg, wu, wd, residual=res, norm_weight=nw, eps=1e-5, x8=x8,
                      out=torch.empty(N, device=DEV), config_up=cfg_e, config_down=cfg_e, select=p)
    want_r = route_ref(y, w_r, cfg, norm_weight=nw, eps=1e-5, **kw)
    assert p.ids.tolist() == want_r.ids.tolist(), f"{name}: folded ids {p.ids.tolist()} vs {want_r.ids.tolist()}"
    assert_close(p.weights, want_r.weights, what=f"{name} folded weights")
    assert_close(p.logits, want_r.logits, what=f"{name} folded logits")
    want = moe_experts_ref(y, want_r.ids, want_r.weights, wg, wu, wd, residual=res, norm_weight=nw, eps=1e-5,
                           out_dtype=f32)
    assert_close(out, want, what=f"{name} {e_fmt} experts after the folded router")


def test_router_folded_in_bf16_moves_logits_by_its_rounding_only():
    """fold_router(dtype=bf16) (the graph backend's KIE_ROUTER_FOLD=1 on a bf16 model): each folded weight rounded
    once, so the logits differ from route_ref on y by at most rstd * |bf16(W_f) - W_f| @ |a| (plus fp32 sums); the
    fp32 fold stays within the sums' error."""
    E, cfg, _ = ROUTERS["softmax_norm"]
    N, K, I, f32 = 96, 136, 32, torch.float32
    wo = random_weight("fp8", N, K, seed=70, device=DEV)
    a, x = _t(K, seed=71), _t(N, seed=72, dtype=f32, scale=3.0)
    w_r, nw = _t(E, N, seed=73, scale=0.2), _t(N, seed=74, dtype=f32)
    wg, wu, wd = _experts("bf16", E, I, N, seed=75)
    exact = fold_router(w_r, nw, wo, torch.float32)
    for dtype in (torch.bfloat16, torch.float32):
        w_f = fold_router(w_r, nw, wo, dtype)
        assert w_f.dtype == dtype
        y, p = gemv_route(a, wo, x, w_f, w_r, nw, cfg, out=torch.empty(N, device=DEV), config=TileConfig(8, 32),
                          router_config=TileConfig(8, 32))      # y in fp32, as the graph backend's residual stream
        moe_experts(y, p.ids, p.weights, wg, wu, wd, norm_weight=nw, config_up=TileConfig(16, 32, num_warps=2),
                    config_down=TileConfig(16, 32, num_warps=2), select=p)
        want = route_ref(y, w_r, cfg, norm_weight=nw)
        rstd = torch.rsqrt(y.float().pow(2).mean() + 1e-6)
        bound = rstd * ((w_f.float() - exact).abs() @ a.float().abs()) + 1e-5 * want.logits.abs().max()
        assert ((p.logits - want.logits).abs() <= bound).all(), f"{dtype}: logits moved past the folded rounding"
        if dtype == torch.bfloat16:
            assert (w_f.float() != exact).any()    # the bound is not vacuous: bf16 did round


def test_router_fold_errors():
    E, cfg, _ = ROUTERS["softmax_norm"]
    N, K, f32 = 64, 96, torch.float32
    wo = random_weight("fp8", N, K, seed=60, device=DEV)
    a, x, nw = _t(K, seed=61, dtype=f32), _t(N, seed=62, dtype=f32), _t(N, seed=63, dtype=f32)
    w_r = _t(E, N, seed=64, dtype=f32, scale=0.2)
    w_f = fold_router(w_r, nw, wo)
    with pytest.raises(ValueError, match="fold_router: w must be a float-format \\[64, K\\] matrix"):
        fold_router(w_r, nw, random_weight("nvfp4", N, K, seed=65, device=DEV))
    with pytest.raises(ValueError, match="gemv_route: w must be one float-format matrix"):
        gemv_route(a, random_weight("mxfp4", N, K, seed=66, device=DEV), x, w_f, w_r, nw, cfg)
    with pytest.raises(ValueError, match="gemv_route: w_fold must be fold_router's float \\[20, 96\\]"):
        gemv_route(a, wo, x, w_f[:, :64].contiguous(), w_r, nw, cfg)
    with pytest.raises(ValueError, match="gemv_route: router_weight must be a float \\[E, 64\\]"):
        gemv_route(a, wo, x, w_f, w_r[:, :32].contiguous(), nw, cfg)
    with pytest.raises(ValueError, match="gemv_route: top_k 30 / n_group 1 do not fit 20 experts"):
        gemv_route(a, wo, x, w_f, w_r, nw, RouterConfig(top_k=30))
    with pytest.raises(ValueError, match="gemv_route: pass bias with fold_bias"):
        gemv_route(a, wo, x, w_f, w_r, nw, cfg, bias=x)
    with pytest.raises(ValueError, match="gemv_route: fold_bias must be fold_router_bias's fp32"):
        gemv_route(a, wo, x, w_f, w_r, nw, cfg, bias=x, fold_bias=fold_router_bias(w_r, nw, x).half())
    with pytest.raises(ValueError, match="gemv_route: router_k_steps 0"):
        gemv_route(a, wo, x, w_f, w_r, nw, cfg, router_k_steps=0)
    y, p = gemv_route(a, wo, x, w_f, w_r, nw, cfg)
    wg, wu, wd = _experts("bf16", E, 32, N, seed=67)
    with pytest.raises(ValueError, match="select= is gemv_route's: x must be its output y"):
        moe_experts(x, p.ids, p.weights, wg, wu, wd, norm_weight=nw, select=p)
    with pytest.raises(ValueError, match="nvfp4 experts after gemv_route read its x8_out: pass x8=select.x8"):
        moe_experts(y, p.ids, p.weights, *_experts("nvfp4", E, 32, N, seed=68), mma=False, select=p)
    with pytest.raises(ValueError, match="float experts after gemv_route norm y themselves: pass norm_weight"):
        moe_experts(y, p.ids, p.weights, wg, wu, wd, select=p)
    with pytest.raises(ValueError, match="gemv_route: x8_out must be a contiguous fp32 \\[8, 8\\]"):
        gemv_route(a, wo, x, w_f, w_r, nw, cfg, x8_out=torch.empty(8, 8, dtype=torch.bfloat16, device=DEV))


@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_experts(fmt):
    """Repeated ids and both ends of the expert range; slots split over 2 programs per row tile."""
    E, H = 5, 96
    I = 96 if fmt in ("nvfp4", "mxfp4") else 37  # fp4 groups need I % 32 == 0 (down's input)
    wg, wu, wd = _experts(fmt, E, I, H, seed=10)
    x = _t(H, seed=11)
    ids = torch.tensor([E - 1, 0, 2, 0], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.4, 0.3, 0.2, 0.1], device=DEV)
    res = _t(H, seed=12)
    cfg = TileConfig(16, 64, num_warps=2)
    y = moe_experts(x, ids, wts, wg, wu, wd, residual=res, out=torch.empty(H, device=DEV),
                    config_up=cfg, config_down=cfg, split=2)
    assert_close(y, moe_experts_ref(x, ids, wts, wg, wu, wd, residual=res, out_dtype=torch.float32), what=fmt)


@pytest.mark.parametrize("pair", [True, False])
@pytest.mark.parametrize("fmt,prefetch", [("bf16", True), ("fp8", False), ("fp8_block", False), ("fp8", True)])
def test_moe_experts_glu_pair(fmt, prefetch, pair):
    """Gate and up rows in one K loop (glu_pair, the default) and in two (KIE_GLU_PAIR=0): the fused RMSNorm, a ragged last K step (H = 160 in steps of 64),
    rows past I (37 in tiles of 16), with and without the one-deep weight prefetch, against the reference."""
    E, I, H = 5, 37, 160
    wg, wu, wd = _experts(fmt, E, I, H, seed=13)
    x, nw, res = _t(H, seed=14), _t(H, seed=15), _t(H, seed=16)
    ids = torch.tensor([E - 1, 0, 2, 0], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.4, 0.3, 0.2, 0.1], device=DEV)
    cfg = TileConfig(16, 64, num_warps=2, prefetch=prefetch)
    y = moe_experts(x, ids, wts, wg, wu, wd, residual=res, norm_weight=nw, out=torch.empty(H, device=DEV),
                    config_up=cfg, config_down=cfg, glu_pair=pair)
    want = moe_experts_ref(x, ids, wts, wg, wu, wd, residual=res, norm_weight=nw, out_dtype=torch.float32)
    assert_close(y, want, what=f"{fmt} glu_pair={pair}")


def test_moe_experts_glu_pair_refuses_what_it_cannot_pair():
    wts = torch.ones(2, device=DEV)
    ids = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="moe_experts: glu_pair needs float gate / up weights"):
        moe_experts(_t(96), ids, wts, *_experts("nvfp4", 4, 64, 96), glu_pair=True)
    wg, _, wd = _experts("bf16", 4, 37, 96)
    wu = random_weight("bf16", 2 * 37, 96, experts=4, seed=3, device=DEV).rows(0, None, 2)   # other row stride
    with pytest.raises(ValueError, match="row strides 96 / 192"):
        moe_experts(_t(96), ids, wts, wg, wu, wd, glu_pair=True)


def test_moe_experts_default_configs_bf16_out():
    E, I, H = 6, 37, 160
    wg, wu, wd = _experts("fp8", E, I, H, seed=20)
    x = _t(1, H, seed=21)
    ids = torch.tensor([5, 3], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.7, 0.3], device=DEV)
    y = moe_experts(x, ids, wts, wg, wu, wd)
    assert y.shape == (1, H) and y.dtype == torch.bfloat16
    assert_close(y, moe_experts_ref(x, ids, wts, wg, wu, wd, out_dtype=torch.float32), rel=8e-3, what="auto")


def test_expert_down_split_spreads_slots_up_to_one_per_program(monkeypatch):
    import kie_moe.kernels.moe as M
    monkeypatch.setattr(M, "num_sms", lambda dev: 132)
    dev = torch.device("cpu")
    # qwen3-30b-a3b (2048 / 8 rows, top-8), gpt-oss-120b (2880 / 8, top-4), DeepSeek-V3 (7168 / 8, top-8), huge H
    assert [M.expert_down_split(n, k, dev) for n, k in ((256, 8), (360, 4), (896, 8), (5000, 8), (1, 1))] == \
        [8, 4, 2, 1, 1]


def test_moe_experts_default_split_on_a_many_sm_device(monkeypatch):
    """The default down launch as on an H200 (one slot per program here: 2 programs per row tile, the last one
    reduces in slot order) gives the reference's result; on CPU num_sms is 1, so this is the path only a GPU takes."""
    import kie_moe.kernels.moe as M
    monkeypatch.setattr(M, "num_sms", lambda dev: 132)
    E, I, H = 6, 37, 160
    wg, wu, wd = _experts("fp8", E, I, H, seed=22)
    x, res = _t(H, seed=23), _t(H, seed=24)
    ids = torch.tensor([5, 0], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.6, 0.4], device=DEV)
    assert M.expert_down_split(triton.cdiv(H, M.DEFAULT_EXPERT_TILES["fp8"].block_n), 2, x.device) == 2
    y = moe_experts(x, ids, wts, wg, wu, wd, residual=res, out=torch.empty(H, device=DEV))
    assert_close(y, moe_experts_ref(x, ids, wts, wg, wu, wd, residual=res, out_dtype=torch.float32), what="split")


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_gpt_oss_block(fmt):
    """gpt-oss end to end on the device: router (bias, softmax over top-k) -> interleaved gate_up with biases,
    clamped GLU -> down with biases; ids never leave the device between the launches."""
    E, I, H, k = 6, 64, 96, 3
    if fmt == "mxfp4":  # the checkpoint's own layout: *_blocks [E, out, in/32, 16], *_scales [E, out, in/32]
        gu = random_weight("mxfp4", 2 * I, H, experts=E, seed=30, device=DEV, std=0.5)
        gate_up = WeightHandle.from_gpt_oss_mxfp4(gu.weight.reshape(E, 2 * I, H // 32, 16), gu.scale)
        dn = random_weight("mxfp4", H, I, experts=E, seed=31, device=DEV)
        down = WeightHandle.from_gpt_oss_mxfp4(dn.weight.reshape(E, H, I // 32, 16), dn.scale)
    else:
        gate_up = random_weight("bf16", 2 * I, H, experts=E, seed=30, device=DEV, std=0.5)
        down = random_weight("bf16", H, I, experts=E, seed=31, device=DEV)
    wg, wu = gate_up.rows(0, None, 2), gate_up.rows(1, None, 2)
    gu_bias, d_bias = _t(E, 2 * I, seed=32), _t(E, H, seed=33)
    x, w_r, b_r, nw = _t(H, seed=34), _t(E, H, seed=35, scale=0.3), _t(E, seed=36), _t(H, seed=37)
    cfg = RouterConfig(top_k=k, scoring="softmax_topk")
    x8 = torch.full((8, H // 8), float("nan"), device=DEV)  # the router fills it: every element must be written
    r = route(x, w_r, cfg, router_bias=b_r, norm_weight=nw, x8_out=x8, config=TileConfig(4, 32, split_k=2))
    kw = dict(act="gpt_oss", limit=7.0, gate_bias=gu_bias[:, 0::2], up_bias=gu_bias[:, 1::2], down_bias=d_bias,
              norm_weight=nw, residual=x)
    y = moe_experts(x, r.ids, r.weights, wg, wu, down, out=torch.empty(H, device=DEV),
                    x8=x8 if fmt == "mxfp4" else None, **kw)
    rr = route_ref(x, w_r, cfg, router_bias=b_r, norm_weight=nw)
    assert r.ids.tolist() == rr.ids.tolist()
    want = moe_experts_ref(x, rr.ids, rr.weights, wg, wu, down, out_dtype=torch.float32, **kw)
    assert_close(y, want, what=f"gpt-oss {fmt}")
    if fmt == "bf16":   # interleaved gate / up views share their strides: one K loop for both, biases after it
        y2 = moe_experts(x, r.ids, r.weights, wg, wu, down, out=torch.empty(H, device=DEV), glu_pair=True, **kw)
        assert_close(y2, want, what="gpt-oss bf16 glu_pair")


def test_moe_experts_errors():
    wg, wu, wd = _experts("bf16", 4, 37, 96)
    x = _t(96)
    wts = torch.ones(2, device=DEV)
    with pytest.raises(ValueError, match="ids must be a contiguous int32"):
        moe_experts(x, torch.tensor([0, 1], device=DEV), wts, wg, wu, wd)
    with pytest.raises(ValueError, match="w_down is"):
        moe_experts(x, torch.tensor([0, 1], dtype=torch.int32, device=DEV), wts, wg, wu, wu)
    with pytest.raises(ValueError, match="not an expert stack"):
        moe_experts(x, torch.tensor([0, 1], dtype=torch.int32, device=DEV), wts, wg.expert(0), wu, wd)
    with pytest.raises(ValueError, match="topk_group"):
        RouterConfig(top_k=2, n_group=2, topk_group=3)


@pytest.mark.parametrize("cfg,hf_group_score", [
    (RouterConfig(top_k=2), "max"),                                                  # Qwen3-MoE / Mixtral
    (RouterConfig(top_k=3, norm_topk_prob=False), "max"),                            # Qwen2-MoE / OLMoE
    (RouterConfig(top_k=4, scoring="sigmoid", routed_scaling_factor=2.5, n_group=4, topk_group=2,
                  group_score="top2"), "top2sum"),                                  # DeepSeek-V3
    (RouterConfig(top_k=3, norm_topk_prob=False, routed_scaling_factor=16.0, n_group=4, topk_group=2,
                  group_score="max"), "max"),                                       # DeepSeek-V2
    (RouterConfig(top_k=2, scoring="softmax_topk"), "max"),                         # gpt-oss
])
def test_route_ref_is_the_reference_decoders_routing(cfg, hf_group_score):
    """The kernels' oracle (route_ref) against the reference decoder's routing (models.reference.route, itself
    checked against HF transformers' modeling code in tests/models): same experts, same weights, every family's
    rule, over many random inputs."""
    from types import SimpleNamespace

    from kie_moe.models.reference import route as model_route
    E, K = 32, 48
    g = torch.Generator().manual_seed(11)
    moe = SimpleNamespace(top_k=cfg.top_k, scoring=cfg.scoring, norm_topk_prob=cfg.norm_topk_prob,
                          routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group,
                          topk_group=cfg.topk_group, group_score=hf_group_score)
    for _ in range(20):
        x, w = torch.randn(K, generator=g), torch.randn(E, K, generator=g) * 0.3
        bias = torch.rand(E, generator=g) * 0.1 if cfg.scoring == "sigmoid" else None
        want = route_ref(x, w, cfg, correction_bias=bias)
        ids, wts = model_route(moe, want.logits[None], bias)
        order = torch.argsort(ids[0])
        assert ids[0][order].tolist() == sorted(want.ids.tolist())
        torch.testing.assert_close(wts[0][order], want.weights[torch.argsort(want.ids)], rtol=1e-6, atol=1e-7)


def test_folded_router_with_a_ragged_norm_scale():
    """The GLU launch that picks the top-k after gemv_route: y's RMSNorm scale over N = 1100 values (two 1024-wide
    steps, the second ragged) gives route_ref's experts and moe_experts_ref's y."""
    E, cfg, _ = ROUTERS["softmax_norm"]
    N, K, I = 1100, 40, 24
    f32 = torch.float32
    wo = random_weight("fp8", N, K, seed=60, device=DEV)
    a, x = _t(K, seed=61, dtype=f32), _t(N, seed=62, dtype=f32, scale=3.0)
    w_r, nw = _t(E, N, seed=63, scale=0.2, dtype=f32), _t(N, seed=64, dtype=f32)
    y, p = gemv_route(a, wo, x, fold_router(w_r, nw, wo), w_r, nw, cfg, eps=1e-5, config=TileConfig(64, 64),
                      router_config=TileConfig(8, 256), router_k_steps=2)
    wg, wu, wd = _experts("fp8", E, I, N, seed=65)
    cfg_e = TileConfig(16, 256, num_warps=2)
    out = moe_experts(y, p.ids, p.weights, wg, wu, wd, norm_weight=nw, eps=1e-5, out=torch.empty(N, device=DEV),
                      config_up=cfg_e, config_down=cfg_e, select=p)
    want_r = route_ref(y, w_r, cfg, norm_weight=nw, eps=1e-5)
    assert p.ids.tolist() == want_r.ids.tolist(), f"ids {p.ids.tolist()} vs {want_r.ids.tolist()}"
    assert_close(p.weights, want_r.weights, what="weights")
    want = moe_experts_ref(y, want_r.ids, want_r.weights, wg, wu, wd, norm_weight=nw, eps=1e-5, out_dtype=f32)
    assert_close(out, want, what="experts")


def test_expert_launches_over_many_k_steps():
    """The fp8 expert launches and the folded o_proj over many whole K steps and a ragged tail pick route_ref's
    experts and give moe_experts_ref's y."""
    E, cfg, _ = ROUTERS["softmax_norm"]
    N, K, I = 232, 200, 168      # experts: 7 / 5 whole 32-wide steps + a ragged one; o_proj: 6 + a ragged one
    f32 = torch.float32
    wo = random_weight("fp8", N, K, seed=70, device=DEV)
    a, x = _t(K, seed=71, dtype=f32), _t(N, seed=72, dtype=f32, scale=3.0)
    w_r, nw = _t(E, N, seed=73, scale=0.2, dtype=f32), _t(N, seed=74, dtype=f32)
    y, p = gemv_route(a, wo, x, fold_router(w_r, nw, wo), w_r, nw, cfg, eps=1e-5,
                      config=TileConfig(16, 32, prefetch=False), router_config=TileConfig(8, 64))
    assert_close(y, gemv_ref(a, wo, residual=x), what="o_proj")
    wg, wu, wd = _experts("fp8", E, I, N, seed=75)
    cfg_e = TileConfig(16, 32, num_warps=2, prefetch=False)
    out = moe_experts(y, p.ids, p.weights, wg, wu, wd, norm_weight=nw, eps=1e-5, out=torch.empty(N, device=DEV),
                      config_up=cfg_e, config_down=cfg_e, select=p)
    want_r = route_ref(y, w_r, cfg, norm_weight=nw, eps=1e-5)
    assert p.ids.tolist() == want_r.ids.tolist(), f"ids {p.ids.tolist()} vs {want_r.ids.tolist()}"
    want = moe_experts_ref(y, want_r.ids, want_r.weights, wg, wu, wd, norm_weight=nw, eps=1e-5, out_dtype=f32)
    assert_close(out, want, what="experts over many K steps")


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "ordered"])
@pytest.mark.parametrize("fmt,case", [("fp8", "residual"), ("bf16", "in_place"), ("nvfp4", "no_residual"),
                                      ("fp8", "bf16_out")])
def test_expert_down_atomic(fmt, case, atomic, monkeypatch):
    """The down launch's two sums. Atomic (the default): the GLU launch sets fp32 y to the residual (or 0) and each
    down program adds its rows with an atomic. Ordered (KIE_EXPERT_DOWN_ATOMIC=0): partials summed in slot order by
    the last program. Each against the reference's y with a residual in another buffer, in y's own buffer (the
    residual updated in place), without one, with a down bias, repeated ids and 2-4 programs per row tile (one slot
    each, or two); a bf16 y takes the ordered sum either way."""
    import kie_moe.kernels.moe as M
    monkeypatch.setattr(M, "EXPERT_DOWN_ATOMIC", atomic)
    seen = []

    class Spy:   # records the down launch's ATOMIC constexpr
        def __getitem__(self, grid):
            def launch(*a, **k):
                seen.append(k["ATOMIC"])
                return real[grid](*a, **k)
            return launch
    real = M._expert_down_kernel
    monkeypatch.setattr(M, "_expert_down_kernel", Spy())
    E, H = 5, 80   # 80: nvfp4's 16-column groups over H
    I = 64 if fmt == "nvfp4" else 37
    wg, wu, wd = _experts(fmt, E, I, H, seed=80)
    x, res = _t(H, seed=81), _t(H, seed=82, dtype=torch.float32)
    ids = torch.tensor([E - 1, 0, 2, 0], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.4, 0.3, 0.2, 0.1], device=DEV)
    bd = _t(E, H, seed=83, dtype=torch.float32)
    cfg = TileConfig(16, 32, num_warps=2)
    kw = dict(config_up=cfg, config_down=cfg, down_bias=bd)
    if case == "residual":
        y = moe_experts(x, ids, wts, wg, wu, wd, residual=res, out=torch.full((H,), float("nan"), device=DEV),
                        split=4, **kw)
    elif case == "in_place":
        y = res.clone()
        assert moe_experts(x, ids, wts, wg, wu, wd, residual=y, out=y, split=2, **kw) is y
    elif case == "no_residual":
        y = moe_experts(x, ids, wts, wg, wu, wd, out=torch.full((H,), float("nan"), device=DEV), split=4, **kw)
    else:
        y = moe_experts(x, ids, wts, wg, wu, wd, residual=res, out=torch.empty(H, dtype=torch.bfloat16, device=DEV),
                        split=4, **kw)
    want = moe_experts_ref(x, ids, wts, wg, wu, wd, residual=None if case == "no_residual" else res, down_bias=bd,
                           out_dtype=torch.float32)
    assert_close(y.float(), want, rel=1e-2 if case == "bf16_out" else 1e-5, what=f"{fmt} {case}")
    assert seen == [atomic and case != "bf16_out"]

"""Real-size checks of the decode kernels on the GPU (H200): every format vs the torch reference, the MoE path at
qwen3-30b-a3b / gpt-oss-120b / DeepSeek-V3 router sizes, split-K determinism and CUDA-graph capture (proves the
route -> experts path never syncs with the host). Run on the device machine: KIE_GPU_TESTS=1 pytest -m gpu."""

import pytest
import torch

from kie_moe.kernels.gemv import (DEFAULT_TILES, TileConfig, gemv, gemv_glu, gemv_glu_ref, gemv_ref, gemv_swiglu,
                                  prepare_x8, rmsnorm_gemv, rmsnorm_gemv_ref)
from kie_moe.kernels.moe import (RouterConfig, fold_router, gemv_route, moe_experts, moe_experts_ref, route,
                                 route_ref)
from kie_moe.kernels.weights import random_weight

from .helpers import FORMATS, assert_close

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"


def _x(n, seed=0, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(n, generator=g, device=DEV) * scale).to(dtype)


# (out, in): qwen3 qkv / kv-only (split-K) / o_proj, gpt-oss qkv (K = 2880) and o_proj, llama down
SHAPES = [(5120, 2048), (512, 2048), (2048, 4096), (5120, 2880), (2880, 4096), (2048, 8192)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_gemv_real_sizes(fmt, shape):
    N, K = shape
    w = random_weight(fmt, N, K, seed=N + K, device=DEV)
    x, bias, res = _x(K, 1), _x(N, 2, torch.float32), _x(N, 3)
    y = gemv(x, w, bias=bias, residual=res, out=torch.empty(N, device=DEV))
    assert_close(y, gemv_ref(x, w, bias=bias, residual=res, out_dtype=torch.float32), rel=2e-5, what=f"{fmt} {shape}")
    nw = _x(K, 4)
    y = rmsnorm_gemv(x, nw, 1e-6, w, out=torch.empty(N, device=DEV))
    assert_close(y, rmsnorm_gemv_ref(x, nw, 1e-6, w, out_dtype=torch.float32), rel=2e-5, what=f"norm {fmt}")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])  # fp4: gemv's tensor-core dispatch (>= 32768 rows)
def test_lm_head_size(fmt):
    N, K = 151936, 2048
    w = random_weight(fmt, N, K, seed=5, device=DEV)
    x = _x(K, 6)
    assert_close(gemv(x, w, out=torch.empty(N, device=DEV)), gemv_ref(x, w, out_dtype=torch.float32), rel=2e-5,
                 what=f"lm_head {fmt}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_tile_configs(fmt):
    """Non-default launch shapes (the micro-benchmark sweeps them), with the other prefetch setting, stay correct."""
    N, K = 1000, 4096
    w = random_weight(fmt, N, K, seed=7, device=DEV)
    x = _x(K, 8)
    want = gemv_ref(x, w, out_dtype=torch.float32)
    cfg = TileConfig(32, 128 if fmt == "fp8_block" else 256, 8, prefetch=not DEFAULT_TILES[fmt].prefetch)
    assert_close(gemv(x, w, out=torch.empty(N, device=DEV), config=cfg), want, rel=2e-5, what=f"{fmt} {cfg}")


def test_split_k_deterministic_under_contention():
    """Many splits racing on the counters: every launch equals the reference and the previous launch bit for bit."""
    w = random_weight("fp8", 512, 8192, seed=9, device=DEV)
    x = _x(8192, 10)
    cfg = TileConfig(4, 256, split_k=16)
    first = gemv(x, w, out=torch.empty(512, device=DEV), config=cfg)
    assert_close(first, gemv_ref(x, w, out_dtype=torch.float32), rel=2e-5, what="split16")
    for _ in range(20):
        assert torch.equal(gemv(x, w, out=torch.empty(512, device=DEV), config=cfg), first)


@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_llama_mlp(fmt):
    I, H = 8192, 2048
    gate_up = random_weight(fmt, 2 * I, H, seed=11, device=DEV)
    wg, wu = gate_up.rows(0, I), gate_up.rows(I)
    x, nw = _x(H, 12), _x(H, 13)
    y = gemv_swiglu(x, wg, wu, norm_weight=nw, out=torch.empty(I, device=DEV))
    assert_close(y, gemv_glu_ref(x, wg, wu, norm_weight=nw, out_dtype=torch.float32), rel=2e-5, what=fmt)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3", "gpt_oss"])
def test_router_real(name):
    E, H, cfg, kw = {
        "qwen3": (128, 2048, RouterConfig(top_k=8), {}),
        "deepseek_v3": (256, 7168, RouterConfig(top_k=8, scoring="sigmoid", n_group=8, topk_group=4,
                                                routed_scaling_factor=2.5), {"correction_bias": 1}),
        "gpt_oss": (128, 2880, RouterConfig(top_k=4, scoring="softmax_topk"), {"router_bias": 1}),
    }[name]
    x, w, nw = _x(H, 14, scale=3.0), _x(E * H, 15, scale=0.05).reshape(E, H), _x(H, 16)
    if kw:
        kw = {k: _x(E, 17, torch.float32, 0.05) for k in kw}
    x8 = torch.empty(8, H // 8, device=DEV)
    got = route(x, w, cfg, norm_weight=nw, x8_out=x8, **kw)
    want = route_ref(x, w, cfg, norm_weight=nw, **kw)
    assert got.ids.tolist() == want.ids.tolist()
    assert_close(got.weights, want.weights, rel=1e-5, what=f"{name} weights")
    assert_close(x8, prepare_x8(x, nw, 1e-6), rel=1e-6, what="router x8")


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("fold_dtype", [torch.float32, torch.bfloat16])
def test_router_fold_real(name, fold_dtype):
    """gemv_route at real sizes (the graph backend's KIE_ROUTER_FOLD): y bit-equal to gemv's (the same rows-first
    tiles), then the fp8 expert GLU's select picks route_ref's experts on y; logits within fp32 sums' error (1e-6 of
    the terms' absolute sum; fp32 fold) plus, folded in bf16, the rounding's bound (rstd * |bf16(W_f) - W_f| @ |a|)."""
    E, H, Kq, cfg, kw = {
        "qwen3": (128, 2048, 4096, RouterConfig(top_k=8), {}),
        "deepseek_v3": (256, 7168, 16384, RouterConfig(top_k=8, scoring="sigmoid", n_group=8, topk_group=4,
                                                       routed_scaling_factor=2.5), {"correction_bias": 1}),
    }[name]
    wo = random_weight("fp8", H, Kq, seed=60, device=DEV)
    a, x = _x(Kq, 61), _x(H, 62, torch.float32, 3.0)
    w_r, nw = _x(E * H, 63, scale=0.05).reshape(E, H), _x(H, 64, torch.float32)
    kw = {k: _x(E, 65, torch.float32, 0.05) for k in kw}
    exact = fold_router(w_r, nw, wo, torch.float32)
    w_f = fold_router(w_r, nw, wo, fold_dtype)
    y, p = gemv_route(a, wo, x, w_f, w_r, nw, cfg, out=torch.empty(H, device=DEV), **kw)
    assert torch.equal(y, gemv(a, wo, residual=x, out=torch.empty(H, device=DEV)))
    wg, wu, wd = (random_weight("fp8", 64, H, experts=E, seed=66, device=DEV),
                  random_weight("fp8", 64, H, experts=E, seed=67, device=DEV),
                  random_weight("fp8", H, 64, experts=E, seed=68, device=DEV))
    moe_experts(y, p.ids, p.weights, wg, wu, wd, norm_weight=nw, residual=y, out=torch.empty(H, device=DEV),
                select=p)
    want = route_ref(y, w_r, cfg, norm_weight=nw, **kw)
    rstd = torch.rsqrt(y.pow(2).mean() + 1e-6)
    sums = exact.abs() @ a.float().abs() + (w_r.float() * nw).abs() @ x.abs()    # fp32 sums' size, for their error
    bound = rstd * ((w_f.float() - exact).abs() @ a.float().abs() + 1e-6 * sums)
    assert ((p.logits - want.logits).abs() <= bound).all(), f"{name}: folded logits past their bound"
    if fold_dtype == torch.float32:
        assert p.ids.tolist() == want.ids.tolist()
        assert_close(p.weights, want.weights, rel=1e-5, what=f"{name} folded weights")


@pytest.mark.parametrize("fmt", FORMATS)
def test_qwen3_moe_block(fmt):
    E, I, H, k = 128, 768, 2048, 8
    wg, wu, wd = (random_weight(fmt, I, H, experts=E, seed=20, device=DEV),
                  random_weight(fmt, I, H, experts=E, seed=21, device=DEV),
                  random_weight(fmt, H, I, experts=E, seed=22, device=DEV))
    x, nw, w_r = _x(H, 23), _x(H, 24), _x(E * H, 25, scale=0.05).reshape(E, H)
    cfg = RouterConfig(top_k=k)
    x8 = torch.empty(8, H // 8, device=DEV)
    r = route(x, w_r, cfg, norm_weight=nw, x8_out=x8)
    y = moe_experts(x, r.ids, r.weights, wg, wu, wd, norm_weight=nw, residual=x, x8=x8,
                    out=torch.empty(H, device=DEV))
    want = moe_experts_ref(x, r.ids, r.weights, wg, wu, wd, norm_weight=nw, residual=x, out_dtype=torch.float32)
    assert_close(y, want, rel=2e-5, what=f"qwen3 moe {fmt}")


@pytest.mark.parametrize("fmt", ["mxfp4", "bf16"])
def test_gpt_oss_moe_block(fmt):
    E, I, H = 128, 2880, 2880
    gate_up = random_weight(fmt, 2 * I, H, experts=E, seed=30, device=DEV, std=0.05)
    down = random_weight(fmt, H, I, experts=E, seed=31, device=DEV)
    wg, wu = gate_up.rows(0, None, 2), gate_up.rows(1, None, 2)
    b_gu, b_d = _x(E * 2 * I, 32).reshape(E, 2 * I), _x(E * H, 33).reshape(E, H)
    ids = torch.tensor([0, 127, 64, 0], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.4, 0.3, 0.2, 0.1], device=DEV)
    x = _x(H, 34)
    kw = dict(act="gpt_oss", gate_bias=b_gu[:, 0::2], up_bias=b_gu[:, 1::2], down_bias=b_d, residual=x)
    y = moe_experts(x, ids, wts, wg, wu, down, out=torch.empty(H, device=DEV), **kw)
    assert_close(y, moe_experts_ref(x, ids, wts, wg, wu, down, out_dtype=torch.float32, **kw), rel=2e-5,
                 what=f"gpt-oss {fmt}")


def test_cuda_graph_route_and_experts():
    """Capture router + fp4 experts + a split-K GEMV in one CUDA graph (capture fails on any host sync), then
    replay on new inputs."""
    E, I, H = 128, 768, 2048
    wg, wu, wd = (random_weight("nvfp4", I, H, experts=E, seed=40, device=DEV),
                  random_weight("nvfp4", I, H, experts=E, seed=41, device=DEV),
                  random_weight("nvfp4", H, I, experts=E, seed=42, device=DEV))
    wo = random_weight("fp8", 512, H, seed=43, device=DEV)
    w_r, nw = _x(E * H, 44, scale=0.05).reshape(E, H), _x(H, 45)
    cfg = RouterConfig(top_k=8)
    x = _x(H, 46)
    x8 = torch.empty(8, H // 8, device=DEV)

    def step():
        r = route(x, w_r, cfg, norm_weight=nw, x8_out=x8)
        y = moe_experts(x, r.ids, r.weights, wg, wu, wd, x8=x8, residual=x)
        return r, y, gemv(y, wo, config=TileConfig(4, 256, split_k=4))

    step()  # compile + allocate the shared counters outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r, y, z = step()
    for seed in (47, 48):
        x.copy_(_x(H, seed))
        graph.replay()
        torch.cuda.synchronize()
        rr = route_ref(x, w_r, cfg, norm_weight=nw)
        assert r.ids.tolist() == rr.ids.tolist()
        want_y = moe_experts_ref(x, rr.ids, rr.weights, wg, wu, wd, norm_weight=nw, residual=x)
        assert_close(y, want_y, rel=8e-3, what="graph moe (bf16 out)")
        assert_close(z, gemv_ref(y, wo), rel=8e-3, what="graph gemv")


def test_glu_gpt_oss_dense_interleaved():
    I, H = 2880, 2880
    gate_up = random_weight("mxfp4", 2 * I, H, seed=50, device=DEV, std=0.05)
    b = _x(2 * I, 51)
    wg, wu = gate_up.rows(0, None, 2), gate_up.rows(1, None, 2)
    x = _x(H, 52)
    kw = dict(act="gpt_oss", gate_bias=b[0::2], up_bias=b[1::2])
    assert_close(gemv_glu(x, wg, wu, out=torch.empty(I, device=DEV), **kw),
                 gemv_glu_ref(x, wg, wu, out_dtype=torch.float32, **kw), rel=2e-5, what="gpt-oss glu")

"""nvfp4 GEMV on the tensor cores (kernels/fp4_mma.py) against the torch reference (dequantize, fp32 matmul).

Under TRITON_INTERPRET=1 the portable path runs (lane = element index, fp32 FMAs, quad sums at the end); on the GPU
(KIE_GPU_TESTS=1) the same tests run the mma.sync path, and the `gpu` tests add real sizes and extreme scales."""

import pytest
import torch

from kie_moe.kernels.fp4_mma import gemv_nvfp4_mma, prepare_xh
from kie_moe.kernels.gemv import gemv_ref, rmsnorm_gemv_ref
from kie_moe.kernels.weights import WeightHandle, random_weight

from .helpers import DEV, assert_close, needs_device

pytestmark = needs_device


def _x(n, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype).to(DEV)


# Odd row counts (not multiples of 16 rows per block or of a program's rows), K with a ragged last 128-code step
# (K % 32 == 0 is the kernel's contract), K shorter than one step, K of several steps.
CASES = [(37, 160, 2, 1, 1, 2), (16, 64, 1, 1, 2, 2), (70, 224, 1, 2, 1, 4), (130, 96, 2, 2, 2, 2),
         (1, 32, 2, 1, 1, 2), (33, 608, 2, 2, 2, 2), (29, 800, 1, 1, 1, 2), (21, 1184, 1, 1, 2, 4)]


@pytest.mark.parametrize("N,K,rb,nw,depth,pieces", CASES,
                         ids=[f"{n}x{k}-rb{r}-w{w}-d{d}-p{p}" for n, k, r, w, d, p in CASES])
def test_matches_reference(N, K, rb, nw, depth, pieces):
    w = random_weight("nvfp4", N, K, seed=N * K, device=DEV)
    x, bias, res = _x(K, 1), _x(N, 2, torch.float32), _x(N, 3)
    y = gemv_nvfp4_mma(x, w, bias=bias, residual=res, out=torch.empty(N, device=DEV), row_blocks=rb, num_warps=nw,
                       depth=depth, pieces=pieces)
    assert_close(y, gemv_ref(x, w, bias=bias, residual=res, out_dtype=torch.float32), what=f"mma {N}x{K}")


DIAG = [(37, 160, 1, 8, 2, None), (70, 224, 2, 4, 4, 2), (33, 1056, 2, 2, 2, 3), (5, 96, 1, 1, 4, 1),
        (130, 608, 4, 8, 4, None)]


@pytest.mark.parametrize("N,K,nw,gpr,pieces,rounds", DIAG,
                         ids=[f"{n}x{k}-w{w}-q{g}-p{p}-r{r}" for n, k, w, g, p, r in DIAG])
def test_diag_layout_matches_reference(N, K, nw, gpr, pieces, rounds):
    """The diagonal layout: quads of a warp on different K pieces of one row pair, several tasks per warp."""
    w = random_weight("nvfp4", N, K, seed=N + K, device=DEV)
    x, bias = _x(K, 1), _x(N, 2, torch.float32)
    y = gemv_nvfp4_mma(x, w, bias=bias, out=torch.empty(N, device=DEV), num_warps=nw, layout="diag",
                       quads_per_row=gpr, pieces=pieces, rounds=rounds)
    assert_close(y, gemv_ref(x, w, bias=bias, out_dtype=torch.float32), what=f"diag {N}x{K}")


def test_rmsnorm_fused_and_bf16_out():
    N, K = 45, 192
    w = random_weight("nvfp4", N, K, seed=11, device=DEV)
    x, nw = _x(K, 4), _x(K, 5)
    y = gemv_nvfp4_mma(x, w, norm_weight=nw, eps=1e-6, out=torch.empty(N, device=DEV), num_warps=1)
    # The normed input is rounded to fp16 once (xh): exact against that, within fp16 rounding of the fp32 norm.
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.square().mean() + 1e-6) * nw.float()).half()
    assert_close(y, gemv_ref(xn, w, out_dtype=torch.float32), what="mma rmsnorm vs fp16-rounded input")
    assert_close(y, rmsnorm_gemv_ref(x, nw, 1e-6, w, out_dtype=torch.float32), rel=2e-3, what="mma rmsnorm")
    yb = gemv_nvfp4_mma(x, w, norm_weight=nw, eps=1e-6, num_warps=1)
    assert yb.dtype == torch.bfloat16 and yb.shape == (N,)
    assert_close(yb, y, rel=1e-2, what="bf16 out")


def test_row_view_with_stride():
    """A row view (gate half of a fused gate/up) keeps the parent's row stride."""
    w = random_weight("nvfp4", 96, 128, seed=2, device=DEV)
    half = w.rows(0, 48)
    x = _x(128, 6)
    y = gemv_nvfp4_mma(x, half, out=torch.empty(48, device=DEV), num_warps=1)
    assert_close(y, gemv_ref(x, half, out_dtype=torch.float32), what="row view")


def test_prepare_xh_layout():
    K = 48
    x = _x(K, 7)
    xh = prepare_xh(x).cpu()
    want = x.cpu().float().reshape(-1, 8)[:, [0, 2, 1, 3, 4, 6, 5, 7]].reshape(-1).half()
    assert torch.equal(xh, want)


def test_bad_input_is_named():
    w = random_weight("mxfp4", 32, 64, seed=1, device=DEV)
    with pytest.raises(ValueError, match="format 'mxfp4'"):
        gemv_nvfp4_mma(_x(64, 1), w)
    w = random_weight("nvfp4", 32, 64, seed=1, device=DEV)
    with pytest.raises(ValueError, match=r"shape \(48,\)"):
        gemv_nvfp4_mma(_x(48, 1), w)
    with pytest.raises(ValueError, match="xh: expected"):
        gemv_nvfp4_mma(_x(64, 1), w, xh=torch.zeros(64, dtype=torch.float32, device=DEV))
    with pytest.raises(ValueError, match="in_features 48 is not a multiple of 32"):
        gemv_nvfp4_mma(_x(48, 1), random_weight("nvfp4", 8, 48, seed=1, device=DEV))
    with pytest.raises(ValueError, match="row_blocks 3"):
        gemv_nvfp4_mma(_x(64, 1), w, row_blocks=3)


def _extreme_weight(N, K, seed):
    """Every code, and e4m3 group scales at both ends (2^-9 subnormal .. 448): the f16 scale products must stay
    exact (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    choices = torch.tensor([2.0 ** -9, 3 * 2.0 ** -9, 2.0 ** -6, 0.875, 1.0, 13.0, 240.0, 448.0])
    scale = choices[torch.randint(0, len(choices), (N, K // 16), generator=g)].to(torch.float8_e4m3fn)
    return WeightHandle("nvfp4", packed.to(DEV), scale.to(DEV), torch.tensor(448.0 * 6, device=DEV), N, K)


def test_extreme_scales_exact():
    w = _extreme_weight(48, 256, 3)
    x = _x(256, 8)
    y = gemv_nvfp4_mma(x, w, out=torch.empty(48, device=DEV), num_warps=1)
    assert_close(y, gemv_ref(x, w, out_dtype=torch.float32), what="extreme scales")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(65536, 8192), (151936, 2048), (5120, 2880), (2048, 768)],
                         ids=["big-65536x8192", "lm-head-151936x2048", "gpt-oss-qkv-5120x2880", "2048x768"])
@pytest.mark.parametrize("rb,nw,depth,pf,pieces", [(1, 4, 1, 0, 2), (1, 4, 2, 2, 2), (2, 4, 1, 0, 2), (2, 4, 1, 4, 2),
                                                   (2, 2, 2, 0, 2), (1, 4, 1, 0, 4), (1, 2, 2, 0, 4)])
def test_real_sizes_gpu(shape, rb, nw, depth, pf, pieces):
    N, K = shape
    w = random_weight("nvfp4", N, K, seed=N + K, device="cuda")
    x = _x(K, 9).cuda()
    y = gemv_nvfp4_mma(x, w, out=torch.empty(N, device="cuda"), row_blocks=rb, num_warps=nw, depth=depth,
                       l2_prefetch=pf, pieces=pieces)
    assert_close(y, gemv_ref(x, w, out_dtype=torch.float32), rel=2e-5, what=f"mma {shape}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(65536, 8192), (151936, 2048), (5120, 2880), (2048, 768)],
                         ids=["big-65536x8192", "lm-head-151936x2048", "gpt-oss-qkv-5120x2880", "2048x768"])
@pytest.mark.parametrize("gpr,nw,pieces", [(8, 4, 4), (4, 4, 4), (8, 4, 2), (2, 2, 4)])
def test_diag_real_sizes_gpu(shape, gpr, nw, pieces):
    N, K = shape
    w = random_weight("nvfp4", N, K, seed=N + K, device="cuda")
    x = _x(K, 9).cuda()
    y = gemv_nvfp4_mma(x, w, out=torch.empty(N, device="cuda"), layout="diag", quads_per_row=gpr, num_warps=nw,
                       pieces=pieces)
    assert_close(y, gemv_ref(x, w, out_dtype=torch.float32), rel=2e-5, what=f"diag {shape}")

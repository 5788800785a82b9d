"""fp8 GEMV on the tensor cores (kernels/fp8_mma.py) against the torch reference (dequantize, fp32 matmul).

The kernel rounds x to fp16 once (xh) and is otherwise exact up to fp32 summation order, so the oracle is gemv_ref on
that fp16-rounded x. Under TRITON_INTERPRET=1 the portable path runs (lane = element index, fp32 FMAs, quad sums at
the end); on the GPU the same tests run the mma.sync path, and the `gpu` tests add real sizes."""

import pytest
import torch

from kie_moe.kernels.fp4_mma import prepare_xh
from kie_moe.kernels.fp8_mma import gemv_fp8_mma
from kie_moe.kernels.gemv import gemv_ref, rmsnorm_gemv_ref
from kie_moe.kernels.weights import WeightHandle, random_weight

from .helpers import DEV, assert_close, needs_device

pytestmark = needs_device


def _x(n, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype).to(DEV)


def _ref(x, w, **kw):
    return gemv_ref(x.half().float(), w, out_dtype=torch.float32, **kw)


# Odd row counts (not multiples of a warp's 16 / 32 rows or a program's), K with a ragged last 128-byte step (K % 16
# is the contract), K shorter than one piece's quad (16 < 64), K of several steps; programs: a persistent grid
# smaller than the tiles (uneven share per program), or None (one program per tile).
# pieces 4: 256-byte steps, K ragged against them too.
CASES = [(37, 160, 2, 1, None, 2), (16, 16, 1, 1, None, 2), (70, 224, 1, 2, None, 2), (130, 96, 2, 2, 3, 2),
         (1, 48, 2, 1, None, 2), (33, 608, 2, 2, 1, 2), (19, 512, 2, 1, 2, 2), (29, 800, 1, 1, 5, 2),
         (50, 1040, 1, 2, None, 2), (37, 160, 2, 1, None, 4), (33, 608, 2, 2, 1, 4), (45, 1296, 1, 1, 2, 4)]


@pytest.mark.parametrize("N,K,rb,nw,programs,pieces", CASES,
                         ids=[f"{c[0]}x{c[1]}-rb{c[2]}-w{c[3]}-p{c[4]}-pc{c[5]}" for c in CASES])
def test_matches_reference(N, K, rb, nw, programs, pieces):
    w = random_weight("fp8", N, K, seed=N * K, device=DEV)
    x, bias, res = _x(K, 1), _x(N, 2, torch.float32), _x(N, 3)
    y = gemv_fp8_mma(x, w, bias=bias, residual=res, out=torch.empty(N, device=DEV), row_blocks=rb, num_warps=nw,
                     programs=programs, pieces=pieces)
    assert_close(y, _ref(x, w, bias=bias, residual=res), what=f"fp8 mma {N}x{K}")


def test_every_code_and_a_tensor_scale():
    """All 254 finite e4m3 codes (both signs, subnormals, +-448) in every lane position, and a per-tensor scale
    (the scale's row stride 0)."""
    N, K = 24, 256
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]                       # drop the two NaNs
    g = torch.Generator().manual_seed(5)
    wq = codes[torch.randint(0, codes.numel(), (N, K), generator=g)].view(torch.float8_e4m3fn)
    wq[0, :codes.numel()] = codes.view(torch.float8_e4m3fn)
    w = WeightHandle("fp8", wq.to(DEV), torch.full((1, 1), 0.0137, device=DEV).expand(N, 1), None, N, K)
    x = _x(K, 4) * 0.01
    y = gemv_fp8_mma(x, w, out=torch.empty(N, device=DEV), num_warps=1)
    assert_close(y, _ref(x, w), what="every e4m3 code, tensor scale")


def test_rmsnorm_fused_and_bf16_out():
    N, K = 45, 192
    w = random_weight("fp8", N, K, seed=11, device=DEV)
    x, nw = _x(K, 4), _x(K, 5)
    y = gemv_fp8_mma(x, w, norm_weight=nw, eps=1e-6, out=torch.empty(N, device=DEV), num_warps=1)
    xf = x.float()
    xn = xf * torch.rsqrt(xf.square().mean() + 1e-6) * nw.float()
    assert_close(y, _ref(xn, w), what="mma rmsnorm vs fp16-rounded input")
    assert_close(y, rmsnorm_gemv_ref(x, nw, 1e-6, w, out_dtype=torch.float32), rel=2e-3, what="mma rmsnorm")
    yb = gemv_fp8_mma(x, w, norm_weight=nw, eps=1e-6, num_warps=1)
    assert yb.dtype == torch.bfloat16 and yb.shape == (N,)
    assert_close(yb, y, rel=1e-2, what="bf16 out")


def test_row_view_with_stride():
    """A row view (gate half of a fused gate/up) keeps the parent's row stride."""
    w = random_weight("fp8", 96, 128, seed=2, device=DEV)
    half = w.rows(48, 96)
    x = _x(128, 6)
    y = gemv_fp8_mma(x, half, out=torch.empty(48, device=DEV), num_warps=1)
    assert_close(y, _ref(x, half), what="row view")


def test_prepare_xh_natural_order():
    x = _x(48, 7)
    assert torch.equal(prepare_xh(x, natural=True).cpu(), x.cpu().float().half())


def test_bad_input_is_named():
    w = random_weight("fp8", 32, 64, seed=1, device=DEV)
    with pytest.raises(ValueError, match="format 'nvfp4'"):
        gemv_fp8_mma(_x(64, 1), random_weight("nvfp4", 32, 64, seed=1, device=DEV))
    with pytest.raises(ValueError, match=r"shape \(48,\)"):
        gemv_fp8_mma(_x(48, 1), w)
    with pytest.raises(ValueError, match=r"xh \(prepare_xh\(natural=True\)'s\) must be a contiguous"):
        gemv_fp8_mma(_x(64, 1), w, xh=torch.zeros(64, dtype=torch.float32, device=DEV))
    with pytest.raises(ValueError, match="in_features 40 is not a multiple of 16"):
        gemv_fp8_mma(_x(40, 1), random_weight("fp8", 8, 40, seed=1, device=DEV))
    with pytest.raises(ValueError, match="row_blocks 3"):
        gemv_fp8_mma(_x(64, 1), w, row_blocks=3)
    with pytest.raises(ValueError, match="pieces 3"):
        gemv_fp8_mma(_x(64, 1), w, pieces=3)
    with pytest.raises(ValueError, match="programs 0"):
        gemv_fp8_mma(_x(64, 1), w, programs=0)
    with pytest.raises(ValueError, match="expert stack"):
        gemv_fp8_mma(_x(64, 1), random_weight("fp8", 8, 64, seed=1, device=DEV, experts=2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(65536, 8192), (151936, 2048), (5120, 2048), (2048, 768), (37, 160)],
                         ids=["big-65536x8192", "lm-head-151936x2048", "qwen3-qkv-5120x2048", "2048x768", "37x160"])
@pytest.mark.parametrize("rb,nw,programs,pieces", [(2, 4, None, 2), (1, 4, None, 2), (2, 8, 132, 2), (2, 8, None, 2),
                                                   (2, 4, None, 4), (2, 8, 132, 4)])
def test_real_sizes_gpu(shape, rb, nw, programs, pieces):
    N, K = shape
    w = random_weight("fp8", N, K, seed=N + K, device="cuda")
    x = _x(K, 9).cuda()
    y = gemv_fp8_mma(x, w, out=torch.empty(N, device="cuda"), row_blocks=rb, num_warps=nw, programs=programs,
                     pieces=pieces)
    assert_close(y, _ref(x, w), rel=2e-5, what=f"fp8 mma {shape}")

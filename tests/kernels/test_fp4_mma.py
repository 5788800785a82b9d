"""fp4 GEMV on the tensor cores (kernels/fp4_mma.py) against the torch reference (dequantize, fp32 matmul).

Under TRITON_INTERPRET=1 the portable path runs (lane = element index, fp32 FMAs, quad sums at the end); on the GPU
(KIE_GPU_TESTS=1) the same tests run the mma.sync path, and the `gpu` tests add real sizes."""

import pytest
import torch

from kie_moe.kernels.fp4_mma import gemv_fp4_mma, pack_for_mma, prepare_xh
from kie_moe.kernels.gemv import gemv_ref, rmsnorm_gemv_ref
from kie_moe.kernels.weights import WeightHandle, checkpoint_bytes, dequantize, mma_bytes, random_weight

from .helpers import DEV, assert_close, needs_device

pytestmark = needs_device
FP4 = ["nvfp4", "mxfp4"]


def _x(n, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype).to(DEV)


# Odd row counts (not multiples of a warp's 16 or 32 rows or of a program's), K with a ragged last 256-code step
# (K % 32 == 0 is the kernel's contract), K shorter than one step, K of several steps.
CASES = [(37, 160, 2, 1), (16, 64, 1, 1), (70, 224, 1, 2), (130, 96, 2, 2), (1, 32, 2, 1), (33, 608, 2, 2),
         (19, 512, 2, 1), (29, 800, 1, 1), (50, 1152, 1, 2)]


@pytest.mark.parametrize("packing", ["checkpoint", "mma"])
@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("N,K,rb,nw", CASES, ids=[f"{n}x{k}-rb{r}-w{w}" for n, k, r, w in CASES])
def test_matches_reference(fmt, N, K, rb, nw, packing):
    w = random_weight(fmt, N, K, seed=N * K, device=DEV)
    x, bias, res = _x(K, 1), _x(N, 2, torch.float32), _x(N, 3)
    wk = pack_for_mma(w) if packing == "mma" else w
    y = gemv_fp4_mma(x, wk, bias=bias, residual=res, out=torch.empty(N, device=DEV), row_blocks=rb, num_warps=nw)
    assert_close(y, gemv_ref(x, w, bias=bias, residual=res, out_dtype=torch.float32), what=f"{fmt} {N}x{K}")


def test_mma_packing_is_a_relabelling(monkeypatch):
    """Every byte maps to a distinct byte and back; a packed handle (packed in row chunks) dequantizes (the torch
    oracle) to the same weights, keeps its packing through row views, and only the mma kernel takes it."""
    from kie_moe.kernels import fp4_mma
    monkeypatch.setattr(fp4_mma, "_PACK_ROWS", 7)
    b = torch.arange(256, dtype=torch.uint8)
    assert len(set(mma_bytes(b).tolist())) == 256 and torch.equal(checkpoint_bytes(mma_bytes(b)), b)
    for fmt in FP4:
        w = random_weight(fmt, 40, 96, seed=3, device=DEV)
        p = pack_for_mma(w)
        assert p.packing == "mma" and pack_for_mma(p) is p and not torch.equal(p.weight, w.weight)
        assert torch.equal(dequantize(p), dequantize(w))
        assert p.rows(8, 24).packing == "mma" and torch.equal(dequantize(p.rows(8, 24)), dequantize(w.rows(8, 24)))
    from kie_moe.kernels import gemv as G
    x = _x(96, 4)
    with pytest.raises(ValueError, match="packed for the tensor-core GEMV"):
        G.gemv(x, p, out=torch.empty(40, device=DEV))                      # below MMA_MIN_ROWS: the tile path
    with pytest.raises(ValueError, match="packing 'mma' applies to nvfp4 / mxfp4 only"):
        WeightHandle("bf16", torch.zeros(4, 32, dtype=torch.bfloat16), None, None, 4, 32, "mma")
    st = pack_for_mma(random_weight("mxfp4", 9, 64, seed=1, device=DEV, experts=3))       # an expert stack too
    assert st.packing == "mma" and st.expert(2).packing == "mma"
    assert torch.equal(dequantize(st), dequantize(random_weight("mxfp4", 9, 64, seed=1, device=DEV, experts=3)))
    with pytest.raises(ValueError, match="pack_for_mma: in_features 48 is not a multiple of 32"):
        pack_for_mma(random_weight("nvfp4", 8, 48, seed=1, device=DEV, experts=2))
    with pytest.raises(ValueError, match="stack: expert 1 is in packing 'mma'"):
        WeightHandle.stack([w, pack_for_mma(w)])


@pytest.mark.parametrize("fmt", FP4)
def test_rmsnorm_fused_and_bf16_out(fmt):
    N, K = 45, 192
    w = random_weight(fmt, N, K, seed=11, device=DEV)
    x, nw = _x(K, 4), _x(K, 5)
    y = gemv_fp4_mma(x, w, norm_weight=nw, eps=1e-6, out=torch.empty(N, device=DEV), num_warps=1)
    # The normed input is rounded to fp16 once (xh): exact against that, within fp16 rounding of the fp32 norm.
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.square().mean() + 1e-6) * nw.float()).half()
    assert_close(y, gemv_ref(xn, w, out_dtype=torch.float32), what="mma rmsnorm vs fp16-rounded input")
    assert_close(y, rmsnorm_gemv_ref(x, nw, 1e-6, w, out_dtype=torch.float32), rel=2e-3, what="mma rmsnorm")
    yb = gemv_fp4_mma(x, w, norm_weight=nw, eps=1e-6, num_warps=1)
    assert yb.dtype == torch.bfloat16 and yb.shape == (N,)
    assert_close(yb, y, rel=1e-2, what="bf16 out")


def test_row_view_with_stride():
    """A row view (gate half of a fused gate/up) keeps the parent's row stride."""
    w = random_weight("nvfp4", 96, 128, seed=2, device=DEV)
    half = w.rows(0, 48)
    x = _x(128, 6)
    y = gemv_fp4_mma(x, half, out=torch.empty(48, device=DEV), num_warps=1)
    assert_close(y, gemv_ref(x, half, out_dtype=torch.float32), what="row view")


def test_prepare_xh_layout():
    K = 48
    x = _x(K, 7)
    xh = prepare_xh(x).cpu()
    want = x.cpu().float().reshape(-1, 8)[:, [0, 2, 1, 3, 4, 6, 5, 7]].reshape(-1).half()
    assert torch.equal(xh, want)


def test_bad_input_is_named():
    w = random_weight("fp8", 32, 64, seed=1, device=DEV)
    with pytest.raises(ValueError, match="format 'fp8'"):
        gemv_fp4_mma(_x(64, 1), w)
    w = random_weight("nvfp4", 32, 64, seed=1, device=DEV)
    with pytest.raises(ValueError, match=r"shape \(48,\)"):
        gemv_fp4_mma(_x(48, 1), w)
    with pytest.raises(ValueError, match=r"xh \(prepare_xh's\) must be a contiguous, 16-byte aligned fp16 \[64\]"):
        gemv_fp4_mma(_x(64, 1), w, xh=torch.zeros(64, dtype=torch.float32, device=DEV))
    with pytest.raises(ValueError, match="in_features 48 is not a multiple of 32"):
        gemv_fp4_mma(_x(48, 1), random_weight("nvfp4", 8, 48, seed=1, device=DEV))
    with pytest.raises(ValueError, match="row_blocks 3"):
        gemv_fp4_mma(_x(64, 1), w, row_blocks=3)
    with pytest.raises(ValueError, match="expert stack"):
        gemv_fp4_mma(_x(64, 1), random_weight("nvfp4", 8, 64, seed=1, device=DEV, experts=2))


def _extreme_weight(fmt, N, K, seed):
    """Every code, and group scales at both ends of the formats' ranges: e4m3 2^-9 (subnormal) .. 448; E8M0
    2^-19 .. 2^5 mixed in one row (test_mxfp4_every_scale_exact covers the rest of E8M0)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    if fmt == "nvfp4":
        choices = torch.tensor([2.0 ** -9, 3 * 2.0 ** -9, 2.0 ** -6, 0.875, 1.0, 13.0, 240.0, 448.0])
        scale = choices[torch.randint(0, len(choices), (N, K // 16), generator=g)].to(torch.float8_e4m3fn)
        return WeightHandle("nvfp4", packed.to(DEV), scale.to(DEV), torch.tensor(448.0 * 6, device=DEV), N, K)
    choices = torch.tensor([108, 109, 112, 118, 127, 129, 131, 132], dtype=torch.uint8)
    scale = choices[torch.randint(0, len(choices), (N, K // 32), generator=g)]
    return WeightHandle("mxfp4", packed.to(DEV), scale.to(DEV), None, N, K)


@pytest.mark.parametrize("fmt", FP4)
def test_extreme_scales_exact(fmt):
    w = _extreme_weight(fmt, 48, 256, 3)
    x = _x(256, 8)
    y = gemv_fp4_mma(x, w, out=torch.empty(48, device=DEV), num_warps=1)
    assert_close(y, gemv_ref(x, w, out_dtype=torch.float32), what=f"{fmt} extreme scales")


def test_mxfp4_every_scale_exact():
    """mxfp4 scales are fp32 powers of two: rows with every E8M0 scale 2^-127 .. 2^113 stay exact (each row compared
    in units of its own scale)."""
    N, K = 241, 64
    g = torch.Generator().manual_seed(4)
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    e = torch.arange(N, dtype=torch.uint8)
    w = WeightHandle("mxfp4", packed.to(DEV), e[:, None].repeat(1, K // 32).to(DEV), None, N, K)
    x = _x(K, 10)
    y = gemv_fp4_mma(x, w, out=torch.empty(N, device=DEV), num_warps=1)
    want = gemv_ref(x, w, out_dtype=torch.float32)
    unit = torch.exp2(e.double() - 127)
    assert_close(y.cpu().double() / unit, want.cpu().double() / unit, what="mxfp4, every E8M0 scale")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("shape", [(65536, 8192), (151936, 2048), (5120, 2880), (2048, 768)],
                         ids=["big-65536x8192", "lm-head-151936x2048", "gpt-oss-qkv-5120x2880", "2048x768"])
@pytest.mark.parametrize("rb,nw,packing", [(2, 4, "checkpoint"), (1, 4, "checkpoint"), (2, 8, "checkpoint"),
                                           (2, 4, "mma"), (2, 8, "mma")])
def test_real_sizes_gpu(fmt, shape, rb, nw, packing):
    N, K = shape
    w = random_weight(fmt, N, K, seed=N + K, device="cuda")
    x = _x(K, 9).cuda()
    y = gemv_fp4_mma(x, pack_for_mma(w) if packing == "mma" else w, out=torch.empty(N, device="cuda"),
                     row_blocks=rb, num_warps=nw)
    assert_close(y, gemv_ref(x, w, out_dtype=torch.float32), rel=2e-5, what=f"{fmt} {shape}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("packing", ["checkpoint", "mma"])
@pytest.mark.parametrize("N,K", [(37, 160), (33, 608)])
def test_odd_shapes_gpu(N, K, packing, fmt):
    """Rows not a multiple of 16 and K not of 256 through the mma.sync path (the interpreter runs the portable
    one)."""
    w = random_weight(fmt, N, K, seed=N * K + 1, device="cuda")
    x = _x(K, 11).cuda()
    y = gemv_fp4_mma(x, pack_for_mma(w) if packing == "mma" else w, out=torch.empty(N, device="cuda"))
    assert_close(y, gemv_ref(x, w, out_dtype=torch.float32), rel=2e-5, what=f"{fmt} {N}x{K} {packing}")


def test_gemv_dispatches_large_nvfp4(monkeypatch):
    """gemv() sends an nvfp4 / mxfp4 GEMV of >= MMA_MIN_ROWS rows without a caller x8 to the mma kernel, and nothing
    else."""
    from kie_moe.kernels import fp4_mma
    from kie_moe.kernels import gemv as G

    calls = []
    real = fp4_mma.gemv_fp4_mma

    def spy(*a, **kw):
        calls.append(a[1].fmt)
        return real(*a, **kw)

    monkeypatch.setattr(fp4_mma, "gemv_fp4_mma", spy)
    monkeypatch.setattr(G, "MMA_MIN_ROWS", 40)
    N, K = 45, 96
    x, nw, res = _x(K, 1), _x(K, 2), _x(N, 3)
    w = random_weight("nvfp4", N, K, seed=5, device=DEV)
    y = G.gemv(x, w, norm_weight=nw, residual=res, out=torch.empty(N, device=DEV))
    assert calls == ["nvfp4"]
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.square().mean() + 1e-6) * nw.float()).half()
    assert_close(y, gemv_ref(xn, w, residual=res, out_dtype=torch.float32), what="dispatched gemv")
    G.gemv(x, w, x8=G.prepare_x8(x), out=torch.empty(N, device=DEV))          # caller's x8: CUDA-core tile
    G.gemv(x, w.rows(0, 39), out=torch.empty(39, device=DEV))                 # below the row threshold
    G.gemv(x, random_weight("fp8", N, K, seed=5, device=DEV), out=torch.empty(N, device=DEV))    # not fp4
    wm = random_weight("mxfp4", N, K, seed=5, device=DEV)
    assert_close(G.gemv(x, wm, out=torch.empty(N, device=DEV)), gemv_ref(x, wm, out_dtype=torch.float32),
                 what="dispatched mxfp4 gemv")
    assert calls == ["nvfp4", "mxfp4"]
    assert_close(G.gemv(x, pack_for_mma(w), norm_weight=nw, residual=res, out=torch.empty(N, device=DEV)),
                 gemv_ref(xn, w, residual=res, out_dtype=torch.float32), what="dispatched gemv, packed")
    with pytest.raises(ValueError, match="packed for the tensor-core GEMV"):
        G.gemv(x, pack_for_mma(w), x8=G.prepare_x8(x), out=torch.empty(N, device=DEV))
    calls.clear()
    monkeypatch.setattr(G, "MMA_GEMV", False)
    G.gemv(x, w, out=torch.empty(N, device=DEV))                               # KIE_GEMV_MMA=0
    assert calls == []

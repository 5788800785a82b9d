"""GEMV kernels vs their torch references, every format, small odd shapes (Triton interpreter on CPU)."""

import pytest
import torch

from kie_moe.kernels.gemv import (TileConfig, gemv, gemv_glu, gemv_glu_ref, gemv_ref, gemv_swiglu, prepare_x8,
                                  rmsnorm_gemv, rmsnorm_gemv_ref)
from kie_moe.kernels.weights import E2M1_VALUES, WeightHandle, dequantize, random_weight

from .helpers import DEV, FORMATS, assert_close, needs_device

pytestmark = needs_device

# block_k 64: K=160 takes 3 steps with a masked tail; split_k 2 -> splits [0, 128) and [128, 160).
SMALL_SPLIT = TileConfig(16, 64, num_warps=2, split_k=2)
NO_PREFETCH = TileConfig(16, 32, num_warps=2, prefetch=False)


def _x(n, seed=0, dtype=torch.bfloat16):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEV)


# ---- formats: our torch dequantization agrees with compressed-tensors' own decompressors --------------------------
@pytest.mark.parametrize("fmt", FORMATS[1:])
def test_dequantize_matches_compressed_tensors(fmt):
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import (FloatQuantizationCompressor, MXFP4PackedCompressor,
                                                NVFP4PackedCompressor)
    from compressed_tensors.quantization import preset_name_to_scheme

    w = random_weight(fmt, 150, 288, seed=3)
    preset, comp = {"fp8": ("FP8_DYNAMIC", FloatQuantizationCompressor),
                    "fp8_block": ("FP8_BLOCK", FloatQuantizationCompressor),
                    "nvfp4": ("NVFP4A16", NVFP4PackedCompressor),
                    "mxfp4": ("MXFP4A16", MXFP4PackedCompressor)}[fmt]
    name = "weight_packed" if fmt in ("nvfp4", "mxfp4") else "weight"
    sd = {name: w.weight, "weight_scale": w.scale}
    if w.global_scale is not None:
        sd["weight_global_scale"] = w.global_scale
    theirs = comp.decompress(sd, preset_name_to_scheme(preset, ["Linear"]))["weight"]
    assert ct is not None and theirs.shape == (150, 288)
    # theirs is fp32 for fp8 / fp8-block and bf16 for the fp4 formats: ours rounded to it is the same, element by element
    assert torch.equal(dequantize(w).to(theirs.dtype), theirs), f"{fmt} vs compressed-tensors"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_e2m1_codes_through_the_kernel(fmt):
    """Row r holds code r at element 0 (low nibble) and code 15 - r at element 1 (high nibble); unit scales. The
    kernel's bit-trick decode must give the spec table [0, .5, 1, 1.5, 2, 3, 4, 6] with the sign in bit 3."""
    K = 32
    codes = torch.arange(16, dtype=torch.uint8)
    packed = torch.zeros(16, K // 2, dtype=torch.uint8)
    packed[:, 0] = codes | ((15 - codes) << 4)
    if fmt == "nvfp4":
        w = WeightHandle("nvfp4", packed.to(DEV), torch.ones(16, K // 16).to(torch.float8_e4m3fn).to(DEV),
                         torch.ones(1, device=DEV), 16, K)
    else:
        w = WeightHandle("mxfp4", packed.to(DEV), torch.full((16, 1), 127, dtype=torch.uint8, device=DEV), None, 16, K)
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    for elem, want in ((0, table), (1, table.flip(0))):
        x = torch.zeros(K, dtype=torch.float32, device=DEV)
        x[elem] = 1.0
        y = gemv(x, w, config=TileConfig(16, 32))
        assert torch.equal(y.cpu(), want), f"element {elem}: {y.tolist()}"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_e2m1_every_code_at_every_position(fmt):
    """Exact decode of all 16 codes at each of the 16 nibble positions of two u32 words (the kernel decodes the four
    bytes of a word with different shifts and byte permutes): row r holds code (r + 3i) % 16 at element i; x one-hot
    at element i reads column i back."""
    K, N = 32, 16
    r = torch.arange(N)[:, None]
    codes = ((r + 3 * torch.arange(K)[None, :]) % 16).to(torch.uint8)  # [N, K]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    if fmt == "nvfp4":
        w = WeightHandle("nvfp4", packed.to(DEV), torch.ones(N, K // 16).to(torch.float8_e4m3fn).to(DEV),
                         torch.ones(1, device=DEV), N, K)
    else:
        w = WeightHandle("mxfp4", packed.to(DEV), torch.full((N, 1), 127, dtype=torch.uint8, device=DEV), None, N, K)
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    for i in range(16):
        x = torch.zeros(K, dtype=torch.float32, device=DEV)
        x[i] = 1.0
        y = gemv(x, w, config=TileConfig(16, 32))
        assert torch.equal(y.cpu(), table[codes[:, i].long()]), f"element {i}: {y.tolist()}"


@pytest.mark.parametrize("config", [TileConfig(16, 256, num_warps=2), TileConfig(16, 512, split_k=2),
                                    TileConfig(32, 64, split_k=3, prefetch=False), TileConfig(8, 1024)],
                         ids=["bk256", "bk512-split2", "bk64-split3", "bk1024"])
def test_fp8_block_steps_across_blocks(config):
    """fp8-block with K steps wider than a 128-column block (each 16-column partial sum takes its own block's
    scale), a ragged last block (K = 600: 4 blocks + 88 columns), split-K boundaries inside blocks, and two 128-row
    blocks (N = 150) with a ragged second one."""
    N, K = 150, 600
    w = random_weight("fp8_block", N, K, seed=23, device=DEV)
    x = _x(K, 24)
    y = gemv(x, w, out=torch.empty(N, device=DEV), config=config)
    assert_close(y, gemv_ref(x, w, out_dtype=torch.float32), what=str(config))
    half = w.rows(128)  # a view starting on the second 128-row block: its scales follow
    assert_close(gemv(x, half, out=torch.empty(N - 128, device=DEV), config=config),
                 gemv_ref(x, half, out_dtype=torch.float32), what=f"rows 128: {config}")


# ---- plain GEMV ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", [None, SMALL_SPLIT, NO_PREFETCH], ids=["auto", "split2", "noprefetch"])
def test_gemv(fmt, config):
    N, K = 37, 160
    w = random_weight(fmt, N, K, seed=1, device=DEV)
    x = _x(K)
    bias = _x(N, 1, torch.float32)
    res = _x(N, 2)
    y = gemv(x, w, bias=bias, residual=res, out=torch.empty(N, device=DEV), config=config)
    assert_close(y, gemv_ref(x, w, bias=bias, residual=res, out_dtype=torch.float32), what=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_bf16_out_and_shape(fmt):
    """Default output: x's dtype and leading shape ([1, K] -> [1, N]); two 128-row blocks for fp8_block."""
    N, K = 133, 288
    w = random_weight(fmt, N, K, seed=2, device=DEV)
    x = _x(K, 3).reshape(1, K)
    y = gemv(x, w, config=TileConfig(32, 128))
    assert y.shape == (1, N) and y.dtype == torch.bfloat16
    assert_close(y, gemv_ref(x, w, out_dtype=torch.float32), rel=8e-3, what=fmt)


def test_gemv_fp16_and_auto_split_k():
    """fp16 weights and activations; a short-and-wide shape gets split-K from the heuristic on GPU."""
    N, K = 5, 1000
    w = random_weight("fp16", N, K, seed=4, device=DEV)
    x = _x(K, 4, torch.float16)
    y = gemv(x, w, out=torch.empty(N, device=DEV), config=TileConfig(4, 128, split_k=3))
    assert_close(y, gemv_ref(x, w, out_dtype=torch.float32), what="fp16 split3")
    assert_close(gemv(x, w), gemv_ref(x, w), rel=2e-3, what="fp16 auto")


def test_split_k_counters_reset():
    """Counters are left at zero: back-to-back split launches keep agreeing with the reference."""
    w = random_weight("fp8", 37, 160, seed=5, device=DEV)
    for seed in range(3):
        x = _x(160, seed)
        assert_close(gemv(x, w, out=torch.empty(37, device=DEV), config=SMALL_SPLIT),
                     gemv_ref(x, w, out_dtype=torch.float32), what=f"launch {seed}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_rmsnorm_gemv(fmt):
    N, K = 37, 96
    w = random_weight(fmt, N, K, seed=6, device=DEV)
    x = _x(K, 5) * 3
    nw = 1 + 0.1 * _x(K, 6)
    y = rmsnorm_gemv(x, nw, 1e-5, w, residual=_x(N, 7), out=torch.empty(N, device=DEV))
    want = rmsnorm_gemv_ref(x, nw, 1e-5, w, residual=_x(N, 7), out_dtype=torch.float32)
    assert_close(y, want, what=fmt)


def test_prepare_x8_and_shared_x8():
    """x8[e, j] = (x * rstd * nw)[8j + e]; a caller-made x8 is used as is (the norm then lives in it)."""
    K = 96
    x, nw = _x(K, 20), _x(K, 21)
    x8 = prepare_x8(x, nw, 1e-5)
    xn = x.float() * torch.rsqrt(x.float().pow(2).mean() + 1e-5) * nw.float()
    assert_close(x8, xn.reshape(K // 8, 8).t(), rel=1e-6, what="x8")
    w = random_weight("mxfp4", 37, K, seed=22, device=DEV)
    y = gemv(x, w, x8=x8, out=torch.empty(37, device=DEV))
    assert_close(y, rmsnorm_gemv_ref(x, nw, 1e-5, w, out_dtype=torch.float32), what="shared x8")
    with pytest.raises(ValueError, match="x8: expected"):
        gemv(x, w, x8=x8[:, :-1].contiguous())


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_glu_out_x8_feeds_an_fp4_down(fmt):
    """gemv_glu(out_x8=True) writes h in the x8 layout (fp32); an fp4 down projection reads it with x=None: equal to
    the references' glu then down, with an odd intermediate width and a split-K down."""
    N, K, H = 40, 96, 37
    wg, wu = random_weight(fmt, N, K, seed=30, device=DEV), random_weight(fmt, N, K, seed=31, device=DEV)
    wd = random_weight("nvfp4", H, N - 8, seed=32, device=DEV)      # in 32 (nvfp4 groups of 16): h's first 32 rows
    x, nw = _x(K, 33), _x(K, 34)
    h8 = gemv_glu(x, wg, wu, norm_weight=nw, eps=1e-5, out_x8=True)
    h = gemv_glu_ref(x, wg, wu, norm_weight=nw, eps=1e-5, out_dtype=torch.float32)
    assert h8.shape == (8, N // 8) and h8.dtype == torch.float32
    assert_close(h8, h.reshape(N // 8, 8).t(), what=f"{fmt} glu as x8")
    h8 = gemv_glu(x, wg.rows(0, N - 8), wu.rows(0, N - 8), norm_weight=nw, eps=1e-5, out_x8=True)
    res = _x(H, 35)
    y = gemv(None, wd, x8=h8, residual=res, out=torch.empty(H, device=DEV), config=SMALL_SPLIT)
    assert_close(y, gemv_ref(h[:N - 8], wd, residual=res, out_dtype=torch.float32), what=f"{fmt} glu -> fp4 down")
    with pytest.raises(ValueError, match="out_features % 8"):
        gemv_glu(x, wg.rows(0, 37), wu.rows(0, 37), out_x8=True)
    with pytest.raises(ValueError, match="out with out_x8"):
        gemv_glu(x, wg, wu, out_x8=True, out=torch.empty(N, device=DEV))
    with pytest.raises(ValueError, match="x is None"):
        gemv(None, random_weight("bf16", H, N, seed=1, device=DEV), x8=h8, out=torch.empty(H, device=DEV))
    with pytest.raises(ValueError, match="x8: expected"):
        gemv(None, wd, x8=torch.zeros(8, 3, device=DEV), out=torch.empty(H, device=DEV))


def test_rmsnorm_gemv_split_k():
    w = random_weight("nvfp4", 37, 160, seed=7, device=DEV)
    x, nw = _x(160, 8), _x(160, 9)
    y = rmsnorm_gemv(x, nw, 1e-6, w, out=torch.empty(37, device=DEV), config=SMALL_SPLIT)
    assert_close(y, rmsnorm_gemv_ref(x, nw, 1e-6, w, out_dtype=torch.float32), what="nvfp4 split")


# ---- fused GLU ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu(fmt):
    N, K = 37, 160
    wg, wu = random_weight(fmt, N, K, seed=8, device=DEV), random_weight(fmt, N, K, seed=9, device=DEV)
    x = _x(K, 10)
    y = gemv_swiglu(x, wg, wu, out=torch.empty(N, device=DEV), config=TileConfig(16, 64))
    assert_close(y, gemv_glu_ref(x, wg, wu, out_dtype=torch.float32), what=fmt)


@pytest.mark.parametrize("pair", [True, False])
@pytest.mark.parametrize("fmt,prefetch", [("bf16", True), ("fp16", False), ("fp8", False), ("fp8_block", True)])
def test_glu_pair(fmt, prefetch, pair):
    """Gate and up in one K loop (glu_pair, the default) and in two (KIE_GLU_PAIR=0): the fused norm, a ragged K
    tail, rows past N, both prefetch modes, out_x8."""
    N, K = 40, 160   # 40: past a 16-row tile, and a multiple of 8 for out_x8
    wg, wu = random_weight(fmt, N, K, seed=18, device=DEV), random_weight(fmt, N, K, seed=19, device=DEV)
    x, nw = _x(K, 20), _x(K, 21)
    cfg = TileConfig(16, 64, prefetch=prefetch)
    want = gemv_glu_ref(x, wg, wu, norm_weight=nw, out_dtype=torch.float32)
    y = gemv_swiglu(x, wg, wu, norm_weight=nw, out=torch.empty(N, device=DEV), config=cfg, glu_pair=pair)
    assert_close(y, want, what=f"{fmt} glu_pair={pair}")
    y8 = gemv_swiglu(x, wg, wu, norm_weight=nw, config=cfg, glu_pair=pair, out_x8=True)
    assert_close(y8.t().reshape(-1), want, what=f"{fmt} glu_pair={pair} x8")


def test_glu_pair_refuses_what_it_cannot_pair():
    x = _x(96, 22)
    with pytest.raises(ValueError, match="gemv_glu: glu_pair needs float"):
        gemv_swiglu(x, *(random_weight("nvfp4", 32, 96, seed=s, device=DEV) for s in (1, 2)), glu_pair=True)
    wg = random_weight("bf16", 32, 96, seed=3, device=DEV)
    wu = random_weight("bf16", 64, 96, seed=4, device=DEV).rows(0, None, 2)
    with pytest.raises(ValueError, match="row strides 96 / 192"):
        gemv_swiglu(x, wg, wu, glu_pair=True)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "mxfp4"])
def test_gpt_oss_glu_interleaved(fmt):
    """gpt-oss: gate = even rows, up = odd rows of one gate_up weight, biases likewise; clamp at limit."""
    I, K = 37, 96
    gate_up = random_weight(fmt, 2 * I, K, seed=11, device=DEV, std=1.0)  # large pre-activations hit the clamp
    b = _x(2 * I, 12)
    wg, wu = gate_up.rows(0, None, 2), gate_up.rows(1, None, 2)
    x = _x(K, 13)
    nw = _x(K, 14)
    kw = dict(act="gpt_oss", limit=7.0, gate_bias=b[0::2], up_bias=b[1::2], norm_weight=nw, eps=1e-5)
    want = gemv_glu_ref(x, wg, wu, out_dtype=torch.float32, **kw)
    assert_close(gemv_glu(x, wg, wu, out=torch.empty(I, device=DEV), **kw), want, what=fmt)
    pre = dequantize(wu) @ (x.float() * torch.rsqrt(x.float().pow(2).mean() + 1e-5) * nw.float()) + b[1::2].float()
    assert pre.abs().max() > 7, "test should exercise the up clamp"


def test_glu_fused_gate_up_halves():
    """A fused [2I, H] gate_up split as rows(0, I) / rows(I): views, no copies."""
    I, K = 37, 96
    gate_up = random_weight("fp8", 2 * I, K, seed=15, device=DEV)
    x = _x(K, 16)
    wg, wu = gate_up.rows(0, I), gate_up.rows(I)
    assert wg.weight.data_ptr() == gate_up.weight.data_ptr()
    assert_close(gemv_swiglu(x, wg, wu, out=torch.empty(I, device=DEV)),
                 gemv_glu_ref(x, wg, wu, out_dtype=torch.float32), what="fused halves")


# ---- handles and errors -------------------------------------------------------------------------------------------
def test_from_compressed_formats():
    out, in_ = 37, 160
    for fmt in FORMATS:
        w = random_weight(fmt, out, in_, seed=17)
        d = {"weight": w.weight} if w.scale is None else {
            ("weight_packed" if fmt in ("nvfp4", "mxfp4") else "weight"): w.weight, "weight_scale": w.scale}
        if w.global_scale is not None:
            d["weight_global_scale"] = w.global_scale
        h = WeightHandle.from_compressed(d)
        assert (h.fmt, h.out_features, h.in_features) == (fmt, out, in_)
    fp8 = random_weight("fp8", out, in_, seed=18)
    per_tensor = WeightHandle.from_compressed({"weight": fp8.weight, "weight_scale": torch.tensor([0.01])})
    assert per_tensor.fmt == "fp8" and per_tensor.scale.stride(-2) == 0
    blk = random_weight("fp8_block", out, in_, seed=19)
    assert WeightHandle.from_compressed({"weight": blk.weight, "weight_scale_inv": blk.scale}).fmt == "fp8_block"


def test_errors_name_the_tensor():
    w = random_weight("bf16", 37, 96, device=DEV)
    with pytest.raises(ValueError, match="x: shape"):
        gemv(_x(95), w)
    with pytest.raises(ValueError, match="bias"):
        gemv(_x(96), w, bias=_x(36))
    with pytest.raises(ValueError, match="weight_scale shape"):
        WeightHandle("nvfp4", torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 3).to(torch.float8_e4m3fn),
                     torch.ones(1), 4, 32)
    with pytest.raises(ValueError, match="128-row block"):
        random_weight("fp8_block", 256, 128).rows(1, None, 2)
    with pytest.raises(ValueError, match="block_n dividing"):
        gemv(_x(160), random_weight("fp8_block", 37, 160, device=DEV), config=TileConfig(256, 64))
    with pytest.raises(KeyError, match="weight_packed"):
        WeightHandle.from_compressed({"bias": torch.zeros(3)})


def test_rows_first_tiles(monkeypatch):
    """The rows-first tile rule on a 132-SM device: qwen3-30b-a3b's fp8 o_proj (2048 x 4096, default 16 x 512
    split 4) becomes 4 x 1024 without a split; a GEMV with enough row tiles (its qkv, an lm_head) keeps its tile."""
    import kie_moe.kernels.gemv as G
    monkeypatch.setattr(G, "num_sms", lambda dev: 132)
    dev, fp8 = torch.device("cpu"), G.DEFAULT_TILES["fp8"]
    assert G.rows_first(fp8, 2048, 4096, "fp8", dev) == TileConfig(4, 1024, num_warps=fp8.num_warps, prefetch=False,
                                                                   split_k=1)
    assert G.rows_first(fp8, 5120, 2048, "fp8", dev) is fp8
    assert G.rows_first(G.DEFAULT_TILES["bf16"], 151936, 2048, "bf16", dev) is G.DEFAULT_TILES["bf16"]
    small = G.rows_first(fp8, 300, 768, "fp8", dev)        # stays under 2 tiles per SM at 4 rows: split K as before
    assert (small.block_n, small.block_k, small.split_k) == (4, 256, None)


@pytest.mark.parametrize("fmt", ["fp8", "bf16", "nvfp4"])
def test_gemv_rows_first_equals_reference(fmt, monkeypatch):
    """The rows-first tiles on a many-SM device (odd N, residual, norm) give the reference's result."""
    import kie_moe.kernels.gemv as G
    monkeypatch.setattr(G, "num_sms", lambda dev: 132)
    monkeypatch.setattr(G, "ROWS_FIRST", True)
    N, K = 1100, 1536
    w = random_weight(fmt, N, K, seed=31, device=DEV)
    x, res = _x(K, 32), _x(N, 33, torch.float32)
    nw = torch.rand(K, generator=torch.Generator().manual_seed(34)).to(torch.bfloat16).to(DEV)
    assert G.rows_first(G.DEFAULT_TILES[fmt], N, K, fmt, x.device).block_n == 4
    y = gemv(x, w, residual=res, norm_weight=nw, out=torch.empty(N, device=DEV))
    assert_close(y, gemv_ref(x, w, residual=res, norm_weight=nw, out_dtype=torch.float32), what=f"rows-first {fmt}")


def test_rstd_over_ragged_steps():
    """The fused RMSNorm's scale sums x in 1024-wide steps (the whole of a short x in one): a GEMV and a GLU with
    K = 1100 (two steps, the second ragged) match the reference."""
    import kie_moe.kernels.gemv as G
    import kie_moe.kernels.tiles as T
    assert (T.rstd_block(2048), T.rstd_block(1100), T.rstd_block(96)) == (1024, 1024, 128)
    N, K = 13, 1100
    w = random_weight("fp8", N, K, seed=40, device=DEV)
    x, nw, res = _x(K, 41) * 3, 1 + 0.1 * _x(K, 42), _x(N, 43)
    y = G.rmsnorm_gemv(x, nw, 1e-5, w, residual=res, out=torch.empty(N, device=DEV), config=TileConfig(8, 256))
    assert_close(y, rmsnorm_gemv_ref(x, nw, 1e-5, w, residual=res, out_dtype=torch.float32), what="ragged-norm gemv")
    wg, wu = random_weight("bf16", N, K, seed=44, device=DEV), random_weight("bf16", N, K, seed=45, device=DEV)
    y = gemv_swiglu(x, wg, wu, norm_weight=nw, eps=1e-5, out=torch.empty(N, device=DEV), config=TileConfig(8, 256))
    assert_close(y, gemv_glu_ref(x, wg, wu, norm_weight=nw, eps=1e-5, out_dtype=torch.float32), what="ragged-norm glu")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_block"])
@pytest.mark.parametrize("K", [96, 2048, 3000])
def test_rstd_early_is_bit_equal_to_late(monkeypatch, fmt, K):
    """The normed GEMV / GLU with rstd's loads before the tile loop (tiles.rstd_early_steps > 0) give the same bits as
    with rstd computed after it; K 3000 is over the register limit and takes the late path either way."""
    from kie_moe.kernels import gemv as G
    from kie_moe.kernels import tiles
    w = random_weight(fmt, 40, K, seed=K, device=DEV)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(K, generator=g).to(DEV)
    nw = torch.randn(K, generator=g).to(DEV, torch.bfloat16)
    got = {}
    for early in (True, False):
        monkeypatch.setattr(tiles, "RSTD_EARLY", early)
        got[early] = (G.gemv(x, w, norm_weight=nw, out=torch.empty(40, device=DEV)),
                      G.gemv_glu(x, w, w, norm_weight=nw, out=torch.empty(40, device=DEV)))
    monkeypatch.setattr(tiles, "RSTD_EARLY", True)
    assert (tiles.rstd_early_steps(K, 4) > 0) == (K <= 2048)
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
    assert_close(got[True][0], G.rmsnorm_gemv_ref(x, nw, 1e-6, w, out_dtype=torch.float32), what=f"{fmt} K={K}")

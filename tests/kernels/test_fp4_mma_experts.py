"""Routed fp4 experts on the tensor cores (kernels/fp4_mma_experts.py) against moe_experts_ref: the interpreter runs
the portable loop on odd shapes; the GPU runs mma.sync at real sizes."""
import pytest
import torch

import kie_moe.kernels.moe as M
from kie_moe.kernels.gemv import counters
from kie_moe.kernels.moe import moe_experts, moe_experts_ref, use_mma_experts
from kie_moe.kernels.weights import random_weight

from .helpers import DEV, assert_close, needs_device

pytestmark = needs_device
FP4 = ["nvfp4", "mxfp4"]


def _t(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(DEV)


def _stack(fmt, E, I, H, seed, device=DEV):
    return (random_weight(fmt, I, H, experts=E, seed=seed, device=device),
            random_weight(fmt, I, H, experts=E, seed=seed + 1, device=device),
            random_weight(fmt, H, I, experts=E, seed=seed + 2, device=device))


@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("split,row_blocks,warps", [(1, 1, 1), (2, 2, 1), (4, 1, 2)])
def test_mma_experts_odd_shapes(fmt, split, row_blocks, warps):
    """H = 160 (the last 256-code step ragged), I = 96 (a warp's 16 rows past I), repeated ids and both ends of the
    expert range, slots split over up to 4 programs per row tile; the oracle rounds x and h to fp16 as the kernels
    do, and the fp32 reference bounds what that rounding costs."""
    from kie_moe.kernels.fp4_mma_experts import moe_experts_mma
    E, I, H = 5, 96, 160
    wg, wu, wd = _stack(fmt, E, I, H, seed=40)
    x, res, nw = _t(H, seed=41), _t(H, seed=42), _t(H, seed=43)
    ids = torch.tensor([E - 1, 0, 2, 0], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.4, 0.3, 0.2, 0.1], device=DEV)
    y = torch.empty(H, device=DEV)
    none = (None, 0, 0)
    moe_experts_mma(x, ids, wts, wg, wu, wd, act_id=0, limit=7.0, alpha=1.702, gate_bias=none, up_bias=none,
                    down_bias=none, residual=res, norm_weight=nw, eps=1e-6, y=y, counters=counters(y.device, 16),
                    split=split, num_warps=warps, down_row_blocks=row_blocks)
    kw = dict(residual=res, norm_weight=nw, out_dtype=torch.float32)
    assert_close(y, moe_experts_ref(x, ids, wts, wg, wu, wd, fp16_inputs=True, **kw), what=f"{fmt} vs fp16 oracle")
    assert_close(y, moe_experts_ref(x, ids, wts, wg, wu, wd, **kw), rel=3e-3, what=f"{fmt} vs fp32 reference")


@pytest.mark.parametrize("fmt", FP4)
def test_mma_experts_gpt_oss_biases_interleaved(fmt):
    """gpt-oss's layout: gate / up as every other row of one stack (a strided view), biases as strided views, the
    clamped GLU; moe_experts(mma=True) with a residual into a bf16 output."""
    E, I, H = 6, 64, 96
    gate_up = random_weight(fmt, 2 * I, H, experts=E, seed=50, device=DEV, std=0.5)
    wg, wu = gate_up.rows(0, None, 2), gate_up.rows(1, None, 2)
    wd = random_weight(fmt, H, I, experts=E, seed=51, device=DEV)
    gu_bias, d_bias = _t(E, 2 * I, seed=52), _t(E, H, seed=53)
    x, nw = _t(1, H, seed=54), _t(H, seed=55)
    ids = torch.tensor([3, 5, 0], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.5, 0.3, 0.2], device=DEV)
    kw = dict(act="gpt_oss", limit=7.0, gate_bias=gu_bias[:, 0::2], up_bias=gu_bias[:, 1::2], down_bias=d_bias,
              norm_weight=nw, residual=x)
    y = moe_experts(x, ids, wts, wg, wu, wd, mma=True, **kw)
    assert y.shape == (1, H) and y.dtype == torch.bfloat16
    want = moe_experts_ref(x, ids, wts, wg, wu, wd, out_dtype=torch.float32, fp16_inputs=True, **kw)
    assert_close(y, want, rel=8e-3, what=f"gpt-oss {fmt} (bf16 output)")
    y32 = moe_experts(x, ids, wts, wg, wu, wd, mma=True, out=torch.empty(1, H, device=DEV), **kw)
    assert_close(y32, want, what=f"gpt-oss {fmt}")


@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("split,k_split", [(1, 2), (2, 3), (3, 5)])
def test_mma_experts_down_k_split(fmt, split, k_split):
    """The down launch with its K (= I = 608: 3 steps of 256 codes, the last ragged) cut into chunks, beside slot
    groups: 2 and 3 chunks, and 5 (more chunks than steps: empty ones add zeros); its bias is added once, by chunk
    0, whatever the chunk count."""
    E, I, H = 5, 608, 96
    wg, wu, wd = _stack(fmt, E, I, H, seed=90)
    d_bias = _t(E, H, seed=91)
    x, nw = _t(H, seed=92), _t(H, seed=93)
    ids = torch.tensor([4, 1, 1], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.5, 0.3, 0.2], device=DEV)
    kw = dict(down_bias=d_bias, norm_weight=nw, residual=x)
    y = moe_experts(x, ids, wts, wg, wu, wd, mma=True, out=torch.empty(H, device=DEV), split=split,
                    down_k_split=k_split, **kw)
    want = moe_experts_ref(x, ids, wts, wg, wu, wd, out_dtype=torch.float32, fp16_inputs=True, **kw)
    assert_close(y, want, what=f"{fmt} {split} slot groups x {k_split} K chunks")


@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("ks", [2, 3])
def test_mma_experts_glu_k_split(fmt, ks):
    """The GLU launch with its K (= H = 608: 3 steps of 256 codes, the last ragged) cut into chunks whose last
    program adds the gate / up partials in order and applies the GLU: 2 and 3 chunks (more are clamped to the 3
    steps: test_glu_k_chunks_clamps_to_the_k_steps); gate / up biases added once; a repeated expert; a second call
    on the same counters gives the same y (the counters are left at zero)."""
    E, I, H = 5, 96, 608
    wg, wu, wd = _stack(fmt, E, I, H, seed=95)
    x, nw = _t(H, seed=96), _t(H, seed=97)
    ids = torch.tensor([3, 0, 3], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.5, 0.3, 0.2], device=DEV)
    kw = dict(gate_bias=_t(E, I, seed=98), up_bias=_t(E, I, seed=99), norm_weight=nw, residual=x)
    y = moe_experts(x, ids, wts, wg, wu, wd, mma=True, out=torch.empty(H, device=DEV), glu_k_split=ks, **kw)
    want = moe_experts_ref(x, ids, wts, wg, wu, wd, out_dtype=torch.float32, fp16_inputs=True, **kw)
    assert_close(y, want, what=f"{fmt} GLU in {ks} K chunks")
    again = moe_experts(x, ids, wts, wg, wu, wd, mma=True, out=torch.empty(H, device=DEV), glu_k_split=ks, **kw)
    assert torch.equal(again, y)
    with pytest.raises(ValueError, match="glu_k_split 0"):
        moe_experts(x, ids, wts, wg, wu, wd, mma=True, glu_k_split=0, **kw)


def test_glu_k_chunks_clamps_to_the_k_steps():
    """glu_k_chunks: an explicit count past K's 256-code steps is clamped to them (608: 3 steps), None takes the
    rule (1 off CUDA), a bad count is named."""
    import kie_moe.kernels.fp4_mma_experts as FE
    cpu = torch.device("cpu")
    assert [FE.glu_k_chunks(ks, 96, 608, 3, "nvfp4", cpu) for ks in (5, 3, 2, 1, None)] == [3, 3, 2, 1, 1]
    with pytest.raises(ValueError, match="glu_k_split 0"):
        FE.glu_k_chunks(0, 96, 608, 3, "mxfp4", cpu)


def test_down_launch_split_cuts_k_only_when_slots_cannot_fill_the_gpu(monkeypatch):
    """down_launch_split on a 132-SM GPU: Mixtral-8x7B's top-2 of [4096, 14336] (64 row tiles) gets K chunks of
    >= 8 steps up to ~4 programs per SM; DeepSeek-V3 (2048 codes: 8 steps), qwen3-30b-a3b and an 8-slot launch that
    already fills the GPU keep one chunk; a bad explicit value is named."""
    import kie_moe.kernels.fp4_mma_experts as FE
    monkeypatch.setattr(FE, "num_sms", lambda dev: 132)
    monkeypatch.setattr(FE, "expert_down_split", lambda n, k, dev, per_sm: max(1, min(k, per_sm * 132 // n)))
    cuda = torch.device("cuda")
    assert FE.down_launch_split(64, 2, 14336, cuda) == (1, 2, 4)       # 64 x 2 x 4 = 512 programs
    assert FE.down_launch_split(112, 8, 2048, cuda)[2] == 1             # DeepSeek-V3: 8 steps, one chunk
    assert FE.down_launch_split(32, 8, 768, cuda)[2] == 1                # qwen3-30b-a3b: 3 steps
    assert FE.down_launch_split(64, 10, 4096, cuda) == (2, 5, 1)        # 320 programs, 16 steps: < 2 chunks' worth
    assert FE.down_launch_split(64, 2, 14336, cuda, split=1, k_split=3) == (2, 1, 3)
    with pytest.raises(ValueError, match="down_k_split 0"):
        FE.down_launch_split(64, 2, 14336, cuda, k_split=0)


def test_glu_k_chunks_where_one_chunk_leaves_a_mostly_empty_last_wave(monkeypatch):
    """auto_glu_k_split on a 132-SM GPU (session 21's H100 rows): 3 chunks for Mixtral-8x7B nvfp4 (448 programs on
    396 slots: 1.13 waves) and mxfp4 4096 x 4096 top-11 (704 on 528: 1.33), 1 for nvfp4 4096 top-10 (1.62 waves),
    launches under one wave (DeepSeek-V3, Mixtral mxfp4) and on the CPU; 2 where 2 chunks waste less than 3."""
    import kie_moe.kernels.fp4_mma_experts as FE
    monkeypatch.setattr(FE, "num_sms", lambda dev: 132)
    ks = lambda I, H, k, fmt, dev=torch.device("cuda"): FE.auto_glu_k_split(I, H, k, fmt, dev)  # noqa: E731
    assert (ks(14336, 4096, 2, "nvfp4"), ks(4096, 4096, 11, "mxfp4")) == (3, 3)
    assert (ks(4096, 4096, 10, "nvfp4"), ks(2048, 7168, 8, "nvfp4"), ks(2048, 7168, 8, "mxfp4"),
            ks(14336, 4096, 2, "mxfp4")) == (1, 1, 1, 1)
    assert ks(14336, 4096, 2, "nvfp4", torch.device("cpu")) == 1
    assert ks(4096, 4096, 9, "mxfp4") == 3                      # 576 on 528: 2 chunks 1.38 of waste, 3 chunks 1.22
    assert ks(4224, 4096, 9, "nvfp4") == 2                      # 594 on 396 (1.5 waves): 2 chunks fill 3 waves
    assert ks(14336, 256, 2, "nvfp4") == 1                      # K = 256: one 256-code step, nothing to cut
    # packed nvfp4 (packing "mma": 128 registers, 4 programs per SM): Mixtral's 448 programs fit one wave of 528
    assert FE.auto_glu_k_split(14336, 4096, 2, "nvfp4", torch.device("cuda"), packed=True) == 1


def test_down_row_blocks_two_where_programs_would_loop_over_slots(monkeypatch):
    """auto_down_row_blocks on a 132-SM GPU (session 20's H100 rows): RB 2 where RB 1 gives each program >= 2 slots
    (4096 x 4096 top-10 / top-11, DeepSeek-V3 top-8), RB 1 where every program already has one slot (gpt-oss-120b,
    qwen3-30b-a3b, Mixtral's top-2 with K chunks); an explicit slot split counts."""
    import kie_moe.kernels.fp4_mma_experts as FE
    monkeypatch.setattr(FE, "num_sms", lambda dev: 132)
    monkeypatch.setattr(FE, "expert_down_split", lambda n, k, dev, per_sm: max(1, min(k, per_sm * 132 // n)))
    cuda = torch.device("cuda")
    rb = lambda H, k, I, **kw: FE.auto_down_row_blocks(H, k, I, cuda, **kw)  # noqa: E731
    assert (rb(4096, 10, 4096), rb(4096, 11, 4096), rb(7168, 8, 2048)) == (2, 2, 2)
    assert (rb(2880, 4, 2880), rb(2048, 8, 768), rb(4096, 2, 14336)) == (1, 1, 1)
    assert rb(2048, 8, 768, split=2) == 2                 # 4 slots per program asked for


def test_moe_experts_takes_the_tensor_cores_by_active_bytes(monkeypatch):
    """use_mma_experts: fp4 stacks at >= MMA_EXPERT_MIN_BYTES[fmt] of active experts; never a float format, never
    below the threshold, never a format without one; and moe_experts' default then gives the tensor-core path's
    numbers."""
    E, I, H = 4, 64, 96
    wg, wu, wd = _stack("nvfp4", E, I, H, seed=60)
    per_expert = (wg.nbytes + wu.nbytes + wd.nbytes) // E
    monkeypatch.setattr(M, "MMA_EXPERT_MIN_BYTES", {"nvfp4": 2 * per_expert})
    assert not use_mma_experts(wg, wu, wd, 1) and use_mma_experts(wg, wu, wd, 2)
    assert not use_mma_experts(*_stack("mxfp4", E, I, H, seed=61), 4)
    assert not use_mma_experts(*_stack("fp8", E, I, H, seed=61), 4)
    x = _t(H, seed=62)
    ids = torch.tensor([1, 3], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.6, 0.4], device=DEV)
    y = moe_experts(x, ids, wts, wg, wu, wd, out=torch.empty(H, device=DEV))
    want = moe_experts_ref(x, ids, wts, wg, wu, wd, out_dtype=torch.float32, fp16_inputs=True)
    assert_close(y, want, what="auto -> mma")
    # an explicit tile config keeps the CUDA-core path (fp32 h): it matches the fp32 reference instead
    from kie_moe.kernels.gemv import TileConfig
    y2 = moe_experts(x, ids, wts, wg, wu, wd, out=torch.empty(H, device=DEV), config_up=TileConfig(16, 64))
    assert_close(y2, moe_experts_ref(x, ids, wts, wg, wu, wd, out_dtype=torch.float32), what="tiles")


@pytest.mark.parametrize("fmt", FP4)
def test_mma_experts_read_packed_stacks(fmt):
    """Stacks in packing "mma" (pack_for_mma, the graph backend's KIE_PACK_EXPERTS): the same e2m1 values decoded
    another way, so both launches give the checkpoint stacks' output bit for bit (odd shapes: H = 288 is two
    256-code steps, the last ragged, cut into 2 GLU K chunks; I = 96; repeated ids); the CUDA-core path refuses
    packed stacks by name."""
    from kie_moe.kernels.fp4_mma import pack_for_mma
    E, I, H = 5, 96, 288
    wg, wu, wd = _stack(fmt, E, I, H, seed=60)
    x, nw = _t(H, seed=61), _t(H, seed=62)
    ids = torch.tensor([E - 1, 0, 0], dtype=torch.int32, device=DEV)
    wts = torch.tensor([0.5, 0.3, 0.2], device=DEV)
    kw = dict(mma=True, norm_weight=nw, residual=x, glu_k_split=2)
    want = moe_experts(x, ids, wts, wg, wu, wd, out=torch.empty(H, device=DEV), **kw)
    packed = [pack_for_mma(w) for w in (wg, wu, wd)]
    got = moe_experts(x, ids, wts, *packed, out=torch.empty(H, device=DEV), **kw)
    assert torch.equal(got, want), f"{fmt}: packed stacks differ by {(got - want).abs().max().item()}"
    with pytest.raises(ValueError, match="packed for the tensor-core GEMV"):
        moe_experts(x, ids, wts, *packed, mma=False, norm_weight=nw)


def test_mma_experts_refuses_what_it_cannot_read():
    E, I, H = 4, 64, 96
    x = _t(H, seed=70)
    ids = torch.tensor([1], dtype=torch.int32, device=DEV)
    wts = torch.tensor([1.0], device=DEV)
    with pytest.raises(ValueError, match="w_gate: weight format 'fp8'"):
        moe_experts(x, ids, wts, *_stack("fp8", E, I, H, seed=71), mma=True)
    with pytest.raises(ValueError, match="w_gate: in_features 80 is not a multiple of 32"):
        moe_experts(_t(80, seed=72), ids, wts, *_stack("nvfp4", E, I, 80, seed=73), mma=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("E,k,I,H", [(20, 10, 4096, 4096), (16, 8, 2048, 7168), (8, 4, 2880, 2880), (8, 8, 768, 2048),
                                     (8, 2, 14336, 4096)],
                         ids=["big-4096", "deepseek-v3", "gpt-oss-120b", "qwen3-30b-a3b", "mixtral-8x7b-k-split"])
def test_mma_experts_real_sizes_gpu(fmt, E, k, I, H):
    wg, wu, wd = _stack(fmt, E, I, H, seed=80, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(81)
    x = torch.randn(H, device="cuda", generator=g).bfloat16()
    nw = torch.rand(H, device="cuda", generator=g) + 0.5
    ids = torch.randperm(E, device="cuda", generator=g)[:k].to(torch.int32)
    wts = torch.softmax(torch.randn(k, device="cuda", generator=g), -1)
    y = moe_experts(x, ids, wts, wg, wu, wd, mma=True, norm_weight=nw, residual=x, out=torch.empty(H, device="cuda"))
    want = moe_experts_ref(x, ids, wts, wg, wu, wd, norm_weight=nw, residual=x, out_dtype=torch.float32,
                           fp16_inputs=True)
    # rel 1e-4: h is rounded to fp16 from fp32 sums taken in another order than the reference's, so now and then an
    # h element lands one fp16 ulp (2^-10 relative) away, moving y by |w_down * ulp(h) * weight|: measured up to
    # 2.8e-5 of max|y| (H100, gpt-oss-120b mxfp4, session 18); a wrong scale, expert or row moves it by > 1e-3.
    assert_close(y, want, rel=1e-4, what=f"{fmt} E{E} top-{k} {I}x{H}")
    # packing "mma": the same values decoded another way, so bit-equal at the same GLU K chunks (the auto rule may
    # cut K differently for packed stacks, which fit more programs per SM: another fp32 summation order)
    from kie_moe.kernels.fp4_mma import pack_for_mma
    from kie_moe.kernels.fp4_mma_experts import glu_k_chunks
    ks = glu_k_chunks(None, I, H, k, fmt, x.device, packed=True)
    kw = dict(mma=True, norm_weight=nw, residual=x, glu_k_split=ks)
    yc = moe_experts(x, ids, wts, wg, wu, wd, out=torch.empty(H, device="cuda"), **kw)
    yp = moe_experts(x, ids, wts, *(pack_for_mma(w) for w in (wg, wu, wd)), out=torch.empty(H, device="cuda"), **kw)
    assert torch.equal(yp, yc), f"{fmt} E{E} top-{k} {I}x{H}: packed stacks differ by {(yp - yc).abs().max().item()}"
    assert_close(yp, want, rel=1e-4, what=f"{fmt} E{E} top-{k} {I}x{H} packed, {ks} K chunks")

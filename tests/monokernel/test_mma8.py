"""The monokernel's fp8 tensor-core task (kernels/monokernel/mma8.py) alone, one task per program, against the
torch oracle y = f * (W . fp16(x')) (+ b) (+ res), x' = x * nw * rstd(x) (NORM) or x: tasks of fewer 16-row blocks
than warps (K split over the warps, summed through the scratch), of more (several rounds), ragged row counts and K
(steps past K). Under TRITON_INTERPRET=1 the portable loop runs; on the GPU the mma.sync one. The same tasks over
nvfp4 / mxfp4 codes (WK 3 / 4: fp4_mma's loop) against weights.dequantize's weights."""

import pytest
import torch
import triton
import triton.language as tl

from kie_moe.kernels.monokernel import plan as P
from kie_moe.kernels.monokernel.mma8 import mma8_down_task, mma8_first, mma8_glu_task, mma8_task, scratch_words
from kie_moe.kernels.weights import dequantize, mma_bytes, random_weight

from ..kernels.helpers import DEV, assert_close, needs_device

pytestmark = needs_device


@triton.jit
def _tasks(w_ptr, s_ptr, f_ptr, x_ptr, nw_ptr, b_ptr, y_ptr, res_ptr, scr_ptr, rows_per_task, N, eps,
           K: tl.constexpr, SCR: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
           NW: tl.constexpr, BLOCK_X: tl.constexpr, W16: tl.constexpr, RP: tl.constexpr = False):
    pid = tl.program_id(0)
    r0 = pid * rows_per_task
    r_end = tl.minimum(r0 + rows_per_task, N)
    wq = w_ptr.to(tl.pointer_type(tl.uint32))
    first = mma8_first(wq, K, r0, r_end, NW, W16, s_ptr)
    mma8_task(first, wq, f_ptr, K, r0, r_end, x_ptr, nw_ptr, eps, b_ptr, y_ptr, res_ptr, scr_ptr + pid * SCR, NORM,
              HAS_BIAS, HAS_RES, NW, BLOCK_X, W16 != 1 and W16 != 2, W16, sq=s_ptr, RP=RP)


# weight formats: e4m3 codes with row factors, bf16 / fp16 pairs (W16 1 / 2: x as hi + lo, no factors), e2m1 codes
# with group scales (3 nvfp4: row factors 2^14 / global scale; 4 mxfp4: factors of one)
W16 = {"fp8": 0, "bf16": 1, "fp16": 2, "nvfp4": 3, "mxfp4": 4, "nvfp4-mma": 3, "mxfp4-mma": 4}
FP4 = ("nvfp4", "mxfp4", "nvfp4-mma", "mxfp4-mma")   # "-mma": the codes in packing "mma" (the task's RP)
# fp32 sums in another order; 16-bit weights' products carry more bits into them than e4m3's
REL = {"fp8": 1e-5, "bf16": 3e-5, "fp16": 3e-5, **{f: 1e-5 for f in FP4}}


def _weight(fmt, N, K, seed):
    """(handle, its u32-viewable storage, row factors: the fp8 scales, nvfp4's 2^14 / global scale, or ones; the
    fp4 group scales as bytes, else a dummy)."""
    w = random_weight(fmt.removesuffix("-mma"), N, K, seed=seed, device=DEV)
    f = torch.ones(N, device=DEV)
    if fmt == "fp8":
        f = w.scale.reshape(-1).float().contiguous()
    elif fmt.startswith("nvfp4"):
        f = torch.full((N,), 16384.0 / float(w.global_scale), device=DEV)
    s = w.scale.view(torch.uint8) if fmt in FP4 else f
    codes = w.weight.view(torch.uint8) if fmt == "fp8" else w.weight
    return w, mma_bytes(codes) if fmt.endswith("-mma") else codes, f, s


def _dot_ref(w, f, xin, fmt):
    """W . x' times the row factors as the task's sums mean it (fp4: the dequantized weights, factors included)."""
    return dequantize(w) @ xin if fmt in FP4 else (w.weight.float() @ xin) * f


def _inputs(N, K, seed, fmt, nw, tasks):
    """A task test's x [K] (x 3), norm weight [K] bf16, two [N] vectors (bias / residual or the GLU's biases) and a
    NaN-filled scratch of `tasks` programs."""
    g = torch.Generator().manual_seed(seed)
    x, nw_ = (torch.randn(K, generator=g) * 3).to(DEV), torch.randn(K, generator=g).to(DEV, torch.bfloat16)
    b0, b1 = torch.randn(N, generator=g).to(DEV), torch.randn(N, generator=g).to(DEV)
    scr_words = scratch_words(K, nw, fmt in ("bf16", "fp16"))
    return x, nw_, b0, b1, torch.full((tasks * scr_words,), float("nan"), device=DEV), scr_words


def _xin(x, fmt):
    """x as the mma sees it: fp16-rounded (fp8 tasks) or hi + lo (16-bit tasks, ~16 bits kept)."""
    if fmt in ("fp8",) + FP4:
        return x.half().float()
    dt = torch.bfloat16 if fmt == "bf16" else torch.float16
    hi = x.to(dt).float()
    return hi + (x - hi).to(dt).float()


# (rows, K, rows per task, warps): 1 block on 4 warps (K in 4 ranges), 2 blocks on 4, 3 blocks on 2 warps (2
# rounds), 9 blocks on 4 (3 rounds), ragged K (208: 2 steps of 128 B, the second past K for some ranges), K shorter
# than a step, one warp
CASES = [(5, 256, 5, 4), (37, 208, 20, 4), (40, 96, 40, 2), (130, 1040, 130, 4), (19, 16, 19, 1), (50, 512, 16, 8)]
# fp4 (K % 32 == 0; a step is 256 codes): 2 steps on 4 warps' K ranges (2 of them past K), a ragged step (224: the
# second piece past K), 1056 codes (4 steps and one piece) in 3 rounds, one group of 32, 8 warps on 3 blocks
CASES4 = [(5, 512, 5, 4), (37, 224, 20, 4), (130, 1056, 130, 4), (19, 32, 19, 1), (50, 768, 16, 8)]
TASK_CASES = ([(fmt, *c) for fmt in ("fp8", "bf16", "fp16") for c in CASES] + [(f, *c) for f in FP4[:2] for c in CASES4]
              + [(f, *c) for f in FP4[2:] for c in (CASES4[1], CASES4[4])])
TASK_IDS = [f"{c[0]}-{c[1]}x{c[2]}-t{c[3]}-w{c[4]}" for c in TASK_CASES]


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("fmt,N,K,rpt,nw", TASK_CASES, ids=TASK_IDS)
def test_mma8_task_matches_torch(N, K, rpt, nw, norm, fmt):
    w, wbuf, f, s = _weight(fmt, N, K, N + K)
    tasks = triton.cdiv(N, rpt)
    x, nw_, b, res, scr, scr_words = _inputs(N, K, K, fmt, nw, tasks)
    y = torch.full((N,), float("nan"), device=DEV)
    _tasks[(tasks,)](wbuf, s, f, x, nw_, b, y, res, scr, rpt, N, 1e-6, K, scr_words, norm, True, True, nw,
                     min(1024, triton.next_power_of_2(K)), W16[fmt], fmt.endswith("-mma"), num_warps=nw)
    xf = x.float()
    xn = xf * torch.rsqrt(xf.square().mean() + 1e-6) * nw_.float() if norm else xf
    want = _dot_ref(w, f, _xin(xn, fmt), fmt) + b + res
    assert_close(y, want, REL[fmt], what=f"mma8 {fmt} {N}x{K} rows/task {rpt} warps {nw} norm {norm}")


MK_CASES = [("qwen2_moe", ("attn", "exp")), ("llama", ("attn", "mlp")), ("qwen3_moe_norm", ("attn", "exp")),
            ("gpt_oss", ("attn", "exp")), ("qwen3", ("attn",)), ("qwen3_moe_norm", ("exp",))]


@pytest.mark.parametrize("case,kinds", MK_CASES, ids=[f"{c}-{'+'.join(k)}" for c, k in MK_CASES])
def test_monokernel_fp8_tasks_on_the_tensor_cores(case, kinds, tiny_model, monkeypatch):
    """KIE_MONO_FP8_MMA=1: the monokernel's fp8 q|k|v (with qwen2's biases), o_proj and routed-expert gate / up
    (gpt-oss: its biases and clamped GLU) tasks run mma8, the dense MLP's (llama) and the experts' down task too where
    the widths allow (qwen2_moe: I_MOE 32 and a shared expert of 48), and decode the reference's greedy tokens;
    logits and K/V within fp16's rounding of the tasks' input (2^-11 relative, so a looser bound than the exact
    path's 1e-4). An fp32 arena on the GPU too (its default arena is bf16)."""
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend
    from kie_moe.sampling import SamplingParams

    from .test_formats import PROMPT, DequantStore, quantize_model
    from .test_monokernel import check_against_reference
    monkeypatch.setenv("KIE_MONO_FP8_MMA", "1")
    m = tiny_model(case)
    q = quantize_model(m, "fp8", kinds)
    be = MonokernelBackend(m, DEV, quantized=q.get, num_stages=2, wdtype=torch.float32)
    d = be.plan.dims
    assert be.mma8 and (d.FMT_ATTN == 1) == ("attn" in kinds) and (d.FMT_EXP == 1) == ("exp" in kinds)
    assert be.mma_down == (case == "qwen2_moe") and not be.mma16  # (qwen2_moe: the only expert widths of 16 k)
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), set()))

    class M:
        spec = m.spec
        weights = DequantStore(m.weights, q)
    check_against_reference(be, M, PROMPT, got, tol=5e-3)
    if case == "qwen2_moe":   # the inputs staged in blocks of the kernel's BLOCK_X (K > BLOCK_X: the blocked passes)
        monkeypatch.setenv("KIE_MMA8_STAGE", "loop")
        lp = MonokernelBackend(m, DEV, quantized=q.get, num_stages=2, wdtype=torch.float32)
        assert be.stage_block >= 64 and lp.stage_block == 0
        assert list(lp.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), set())) == got
        monkeypatch.setenv("KIE_MMA8_STAGE", "twice")
        with pytest.raises(ValueError, match="KIE_MMA8_STAGE='twice'"):
            MonokernelBackend(m, DEV, quantized=q.get, num_stages=2)
        monkeypatch.delenv("KIE_MMA8_STAGE")
    monkeypatch.setenv("KIE_MONO_FP8_MMA_DOWN", "0")
    off = MonokernelBackend(m, DEV, quantized=q.get, num_stages=2)
    assert off.mma8 and not off.mma_down
    monkeypatch.setenv("KIE_MONO_FP8_MMA", "0")
    assert not MonokernelBackend(m, DEV, quantized=q.get, num_stages=2).mma8


# (case, scheme, kinds): nvfp4 attention and experts with a shared expert whose width (48) keeps the down task on
# the CUDA cores (qwen2_moe: qkv biases, the shared expert's gate). test_formats runs the default (tensor-core) path
# on olmoe's nvfp4 experts with their down task and llama's mxfp4 attention and dense MLP.
FP4_CASES = [("qwen2_moe", "nvfp4", ("attn", "exp"))]


@pytest.mark.parametrize("case,scheme,kinds", FP4_CASES, ids=[f"{c}-{s}" for c, s, _ in FP4_CASES])
def test_monokernel_fp4_tasks_on_the_tensor_cores(case, scheme, kinds, tiny_model, monkeypatch):
    """KIE_MONO_FP4_MMA (default on): the monokernel's nvfp4 / mxfp4 tasks run mma8's WK 3 / 4 (fp4_mma's loop over
    the qarena's codes and scales) and decode the reference's greedy tokens on the dequantized weights, within fp16's
    rounding of the tasks' input; with the flag off the CUDA-core tasks give the same tokens."""
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend
    from kie_moe.sampling import SamplingParams

    from .test_formats import PROMPT, DequantStore, quantize_model
    from .test_monokernel import check_against_reference
    m = tiny_model(case)
    q = quantize_model(m, scheme, kinds)

    class M:
        spec = m.spec
        weights = DequantStore(m.weights, q)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KIE_MONO_FP4_MMA", flag)
        be = MonokernelBackend(m, DEV, quantized=q.get, num_stages=0, wdtype=torch.float32)
        runs[flag] = be, list(be.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), set()))
        check_against_reference(be, M, PROMPT, runs[flag][1])
    (be, got), (off, want) = runs["1"], runs["0"]
    assert be.mma4 and be.mma_any and not be.mma8 and not be.mma_down and not off.mma4 and not off.mma_any
    assert got == want
    # the codes only tensor-core tasks read are stored in packing "mma" (qwen2_moe: not the shared expert's, whose
    # gate / up stream on the CUDA cores, nor the down rows, whose task stays there: I_SH 48); with the flag off none
    packed = be.plan.qarena.packed
    assert packed and all(P.qkind(n) in kinds and ".shared." not in n and not (".experts." in n and
                                                                                n.endswith(".down"))
                          for n in packed)
    assert len(packed) == sum(1 for n in q if ".shared." not in n and not (".experts." in n and n.endswith(".down")))
    assert not off.plan.qarena.packed
    with pytest.raises(ValueError, match="packed for another set of tensor-core tasks"):   # flag now "0"
        MonokernelBackend(m, DEV, plan=be.plan)
    for name in q:   # the plan's dequantized view reads packed codes back
        torch.testing.assert_close(be.plan.view(name).cpu(), q[name].dequantize(), rtol=1e-6, atol=1e-7)


# (case, kinds quantized to fp8 or ()): a bf16 arena's attention and dense MLP (llama), its experts with the down
# task (qwen2_moe: I_MOE 32, a shared expert of 48), experts whose down stays on the CUDA cores (gpt-oss: biases, the
# clamped GLU; I_MOE 40), fp8 attention beside bf16 experts under both flags (qwen3_moe_norm)
W16_CASES = [("llama", ()), ("qwen2_moe", ()), ("gpt_oss", ()), ("qwen3_moe_norm", ("attn",))]


@pytest.mark.parametrize("case,kinds", W16_CASES, ids=[f"{c}-{'+'.join(k) or 'bf16'}" for c, k in W16_CASES])
def test_monokernel_bf16_tasks_on_the_tensor_cores(case, kinds, tiny_model, monkeypatch):
    """KIE_MONO_W16_MMA=1 on a bf16 arena: the float weights' tasks run the W16 loop (x as hi + lo) and give the
    CUDA-core path's greedy tokens on the same arena, its last LM-head partials within 1e-3 and its K/V within bf16's
    rounding; and the reference decoder's tokens and bounds (the bf16 arena's, 2e-2) where that path meets them
    (gpt-oss's bf16 arena leaves the reference's tokens at step 2 with either loop)."""
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend
    from kie_moe.sampling import SamplingParams

    from .test_formats import PROMPT, DequantStore, quantize_model
    from .test_monokernel import check_against_reference
    monkeypatch.setenv("KIE_MONO_FP8_MMA", "1" if kinds else "0")
    m = tiny_model(case, torch.bfloat16)      # bf16 weights: the reference upcasts the arena's own values
    q = quantize_model(m, "fp8", kinds) if kinds else {}
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KIE_MONO_W16_MMA", flag)
        be = MonokernelBackend(m, DEV, quantized=q.get, num_stages=2, wdtype=torch.bfloat16)
        toks = list(be.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), set()))
        runs[flag] = be, toks
    (be, got), (off, want) = runs["1"], runs["0"]
    assert be.mma16 == 1 and off.mma16 == 0 and be.mma8 == bool(kinds) and be.mma_down == (case == "qwen2_moe")
    assert got == want
    torch.testing.assert_close(be.pv.cpu(), off.pv.cpu(), rtol=1e-3, atol=1e-3)
    kv, kv_off = be.kv.float().cpu(), off.kv.float().cpu()
    torch.testing.assert_close(kv, kv_off, rtol=2e-2, atol=2e-2 * float(kv_off.abs().max()))
    if case != "gpt_oss":
        class M:
            spec = m.spec
            weights = DequantStore(m.weights, q) if kinds else m.weights
        check_against_reference(be, M, PROMPT, got, tol=2e-2)


@triton.jit
def _glu_tasks(wg_ptr, wu_ptr, sg_ptr, su_ptr, fg_ptr, fu_ptr, x_ptr, nw_ptr, bg_ptr, bu_ptr, h_ptr, scr_ptr,
               rows_per_task, N, eps, limit, alpha, K: tl.constexpr, SCR: tl.constexpr, HAS_BIAS: tl.constexpr,
               ACT: tl.constexpr, NW: tl.constexpr, BLOCK_X: tl.constexpr, W16: tl.constexpr, RP: tl.constexpr = False):
    pid = tl.program_id(0)
    r0 = pid * rows_per_task
    r_end = tl.minimum(r0 + rows_per_task, N)
    mma8_glu_task(wg_ptr.to(tl.pointer_type(tl.uint32)), wu_ptr.to(tl.pointer_type(tl.uint32)), fg_ptr, fu_ptr, K,
                  r0, r_end, x_ptr, nw_ptr, eps, bg_ptr, bu_ptr, h_ptr, limit, alpha, scr_ptr + pid * SCR, HAS_BIAS,
                  ACT, NW, BLOCK_X, W16 != 1 and W16 != 2, W16, sg=sg_ptr, su=su_ptr, RP=RP)


@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("fmt,N,K,rpt,nw", TASK_CASES, ids=TASK_IDS)
def test_mma8_glu_task_matches_torch(N, K, rpt, nw, act, fmt):
    """The routed experts' gate / up task: glu(fg (Wg . x') + bg, fu (Wu . x') + bu), act 0 silu, 1 gpt-oss's
    clamped GLU (limit 0.7: some values clamped)."""
    (wg, wgb, fg, sg), (wu, wub, fu, su) = (_weight(fmt, N, K, N + K + i) for i in (0, 1))
    tasks = triton.cdiv(N, rpt)
    x, nw_, bg, bu, scr, scr_words = _inputs(N, K, K + 1, fmt, nw, tasks)
    h = torch.full((N,), float("nan"), device=DEV)
    _glu_tasks[(tasks,)](wgb, wub, sg, su, fg, fu, x, nw_, bg, bu, h, scr, rpt, N, 1e-6, 0.7, 1.702, K, scr_words,
                         True, act, nw, min(1024, triton.next_power_of_2(K)), W16[fmt], fmt.endswith("-mma"),
                         num_warps=nw)
    xf = x.float()
    xn = _xin(xf * torch.rsqrt(xf.square().mean() + 1e-6) * nw_.float(), fmt)
    gv = _dot_ref(wg, fg, xn, fmt) + bg
    uv = _dot_ref(wu, fu, xn, fmt) + bu
    if act == 0:
        want = torch.nn.functional.silu(gv) * uv
    else:
        gc, uc = gv.clamp(max=0.7), uv.clamp(-0.7, 0.7)
        want = (uc + 1) * gc * torch.sigmoid(1.702 * gc)
    assert_close(h, want, REL[fmt], what=f"mma8 glu {fmt} {N}x{K} rows/task {rpt} warps {nw} act {act}")


@triton.jit
def _down_tasks(w_ptr, f_ptr, b_ptr, h_ptr, ids_ptr, wts_ptr, sg_ptr, s_ptr, x_ptr, scr_ptr, ed_w, sd_w, ed_f, sd_f,
                eds, sds, rows_per_task, D: tl.constexpr, I_MOE: tl.constexpr, I_SH: tl.constexpr,
                TOPK: tl.constexpr, SCR: tl.constexpr, HAS_EBIAS: tl.constexpr, HAS_SH_GATE: tl.constexpr,
                NW: tl.constexpr, BLOCK_X: tl.constexpr, W16: tl.constexpr, RP: tl.constexpr = False):
    pid = tl.program_id(0)
    r0 = pid * rows_per_task
    r_end = tl.minimum(r0 + rows_per_task, D)
    mma8_down_task(w_ptr.to(tl.pointer_type(tl.uint32)), ed_w, sd_w, f_ptr, ed_f, sd_f, b_ptr, r0, r_end, h_ptr,
                   ids_ptr, wts_ptr, sg_ptr, x_ptr, scr_ptr + pid * SCR, D, I_MOE, I_SH, TOPK, HAS_EBIAS,
                   HAS_SH_GATE, NW, BLOCK_X, W16 != 1 and W16 != 2, W16, sq=s_ptr, eds=eds, sds=sds, RP=RP)


# (D rows, I_MOE, I_SH, top-k, rows per task, warps): 3 blocks on 4 warps with a shared expert of 1.5 chunks; one
# block on 8 warps with 3 segments (5 warps idle); 2 blocks of 20-row tasks on 4 warps (2 warps per block, 2
# segments each); 3 blocks on 2 warps (2 rounds), a shared expert of 3 chunks and a 16-wide one; one warp, top-1
DOWN_CASES = [(37, 32, 48, 2, 37, 4), (16, 64, 0, 3, 16, 8), (50, 16, 0, 4, 20, 4), (33, 48, 160, 5, 33, 2),
              (8, 32, 32, 1, 8, 1)]
# fp4 (widths multiples of 32): a shared expert of 2 chunks, of 2.5 (a 32-wide last chunk), none; top-1 on one warp
DOWN_CASES4 = [(37, 32, 64, 2, 37, 4), (16, 64, 0, 3, 16, 8), (50, 32, 0, 4, 20, 4), (33, 64, 160, 5, 33, 2),
               (8, 32, 32, 1, 8, 1)]
DOWN_ALL = ([(f, *c) for f in ("fp8", "bf16", "fp16") for c in DOWN_CASES] + [(f, *c) for f in FP4[:2] for c in DOWN_CASES4]
            + [(f, *c) for f in FP4[2:] for c in DOWN_CASES4[:1]])


@pytest.mark.parametrize("bias,gate", [(True, True), (False, False)])
@pytest.mark.parametrize("fmt,D,I,ISH,TOPK,rpt,nw", DOWN_ALL,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}+{c[3]}-k{c[4]}-t{c[5]}-w{c[6]}" for c in DOWN_ALL])
def test_mma8_down_task_matches_torch(D, I, ISH, TOPK, rpt, nw, bias, gate, fmt):
    """The routed experts' down task (plus the shared expert): x + sum_j f_e (W_e . x'(w_j h_j)) + w_j b_e +
    f_sh (W_sh . x'(sg h_sh)) (x': the mma's rounding, _xin; f: fp8's row scales, 1 for 16-bit weights); expert ids
    repeated and at both ends of the range; the weights at offsets inside one arena as the monokernel lays them out
    (qarena's u8 buffers for fp8 / fp4, codes and scales, the float arena for bf16 / fp16)."""
    E = 6
    ids = torch.tensor([5, 0, 5, 3, 0][:TOPK], dtype=torch.int32)
    g = torch.Generator().manual_seed(D * I + TOPK)
    we = random_weight(fmt.removesuffix("-mma"), E * D, I, seed=D + I, device="cpu")
    ws = random_weight(fmt.removesuffix("-mma"), D, max(ISH, 32), seed=D + I + 1, device="cpu")
    # offsets in elements (bytes for fp8 / fp4 codes), 128-byte aligned as the arenas' are
    al = 128 // we.weight.element_size()
    nwe, nws = we.weight.numel(), ws.weight.numel()
    ed_w, sd_w = al, al + nwe + 2 * al
    arena = torch.zeros(sd_w + nws + al, dtype=we.weight.dtype)
    pk = mma_bytes if fmt.endswith("-mma") else (lambda t: t)
    arena[ed_w:ed_w + nwe] = pk(we.weight).reshape(-1)
    arena[sd_w:sd_w + nws] = pk(ws.weight).reshape(-1)
    ed_f, sd_f = 7, 7 + E * D + 3
    f = torch.randn(sd_f + D + 5, generator=g) if fmt == "fp8" else torch.ones(sd_f + D + 5)
    if fmt == "fp8":
        f[ed_f:ed_f + E * D] = we.scale.reshape(-1).float()
        f[sd_f:sd_f + D] = ws.scale.reshape(-1).float()
        arena = arena.view(torch.uint8)
    eds, sds, sarena = 0, 0, torch.zeros(16, dtype=torch.uint8)
    if fmt in FP4:   # the group scales in a qs8-like buffer (bytes, 128-aligned); nvfp4's factors 2^14 / global
        nse, nss = we.scale.numel(), ws.scale.numel()
        eds, sds = 256, 256 + nse + 128
        sarena = torch.zeros(sds + nss + 128, dtype=torch.uint8)
        sarena[eds:eds + nse] = we.scale.view(torch.uint8).reshape(-1)
        sarena[sds:sds + nss] = ws.scale.view(torch.uint8).reshape(-1)
        if fmt.startswith("nvfp4"):
            f[ed_f:ed_f + E * D] = 16384.0 / float(we.global_scale)
            f[sd_f:sd_f + D] = 16384.0 / float(ws.global_scale)
    wde, wds = dequantize(we), dequantize(ws)
    if fmt not in FP4:   # (the factors applied below, as the task applies them)
        wde, wds = we.weight.float(), ws.weight.float()
    b = torch.randn(E * D, generator=g).to(torch.bfloat16)
    h = torch.randn(TOPK * I + ISH, generator=g) * 2
    wts = torch.rand(TOPK, generator=g)
    sg = torch.tensor([0.7])
    x = torch.randn(D, generator=g)
    want = x.clone()
    for j in range(TOPK):
        e = int(ids[j])
        hj = _xin(h[j * I:(j + 1) * I] * wts[j], fmt)
        want += wde[e * D:(e + 1) * D] @ hj * (1.0 if fmt in FP4 else f[ed_f + e * D:ed_f + (e + 1) * D])
        if bias:
            want += wts[j] * b[e * D:(e + 1) * D].float()
    if ISH:
        hs = _xin(h[TOPK * I:] * (sg[0] if gate else 1.0), fmt)
        want += wds @ hs * (1.0 if fmt in FP4 else f[sd_f:sd_f + D])
    tasks = triton.cdiv(D, rpt)
    scr_words = scratch_words(TOPK * I + ISH, nw, fmt in ("bf16", "fp16"))
    scr = torch.full((tasks * scr_words,), float("nan"), device=DEV)
    xd = x.to(DEV)
    dev = [t.to(DEV) for t in (arena, f, b, h, ids, wts, sg, sarena)]
    _down_tasks[(tasks,)](*dev, xd, scr, ed_w, sd_w, ed_f, sd_f, eds, sds, rpt, D, I, ISH, TOPK, scr_words, bias, gate,
                          nw,
                          min(128, triton.next_power_of_2(TOPK * I + ISH)), W16[fmt], fmt.endswith("-mma"), num_warps=nw)
    assert_close(xd, want, REL[fmt], what=f"mma8 down {fmt} D {D} I {I}+{ISH} top-{TOPK} rows/task {rpt} warps {nw}")

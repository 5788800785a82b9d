"""The monokernel's fp8 tensor-core task (kernels/monokernel/mma8.py) alone, one task per program, against the
torch oracle y = f * (W . fp16(x')) (+ b) (+ res), x' = x * nw * rstd(x) (NORM) or x: tasks of fewer 16-row blocks
than warps (K split over the warps, summed through the scratch), of more (several rounds), ragged row counts and K
(steps past K). Under TRITON_INTERPRET=1 the portable loop runs; on the GPU the mma.sync one."""

import pytest
import torch
import triton
import triton.language as tl

from kie_moe.kernels.monokernel.mma8 import mma8_first, mma8_glu_task, mma8_task, scratch_words
from kie_moe.kernels.weights import random_weight

from ..kernels.helpers import DEV, assert_close, needs_device

pytestmark = needs_device


@triton.jit
def _tasks(w_ptr, f_ptr, x_ptr, nw_ptr, b_ptr, y_ptr, res_ptr, scr_ptr, rows_per_task, N, eps, K: tl.constexpr,
           SCR: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NW: tl.constexpr,
           BLOCK_X: tl.constexpr):
    pid = tl.program_id(0)
    r0 = pid * rows_per_task
    r_end = tl.minimum(r0 + rows_per_task, N)
    wq = w_ptr.to(tl.pointer_type(tl.uint32))
    first = mma8_first(wq, K, r0, r_end, NW)
    mma8_task(first, wq, f_ptr, K, r0, r_end, x_ptr, nw_ptr, eps, b_ptr, y_ptr, res_ptr, scr_ptr + pid * SCR, NORM,
              HAS_BIAS, HAS_RES, NW, BLOCK_X)


# (rows, K, rows per task, warps): 1 block on 4 warps (K in 4 ranges), 2 blocks on 4, 3 blocks on 2 warps (2
# rounds), 9 blocks on 4 (3 rounds), ragged K (208: 2 steps of 128 B, the second past K for some ranges), K shorter
# than a step, one warp
CASES = [(5, 256, 5, 4), (37, 208, 20, 4), (40, 96, 40, 2), (130, 1040, 130, 4), (19, 16, 19, 1), (50, 512, 16, 8)]


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("N,K,rpt,nw", CASES, ids=[f"{c[0]}x{c[1]}-t{c[2]}-w{c[3]}" for c in CASES])
def test_mma8_task_matches_torch(N, K, rpt, nw, norm):
    w = random_weight("fp8", N, K, seed=N + K, device=DEV)
    g = torch.Generator().manual_seed(K)
    x, nw_ = (torch.randn(K, generator=g) * 3).to(DEV), torch.randn(K, generator=g).to(DEV, torch.bfloat16)
    f = w.scale.reshape(-1).float().contiguous()
    b, res = torch.randn(N, generator=g).to(DEV), torch.randn(N, generator=g).to(DEV)
    tasks = triton.cdiv(N, rpt)
    scr_words = scratch_words(K, nw)
    scr = torch.full((tasks * scr_words,), float("nan"), device=DEV)
    y = torch.full((N,), float("nan"), device=DEV)
    _tasks[(tasks,)](w.weight.view(torch.uint8), f, x, nw_, b, y, res, scr, rpt, N, 1e-6, K, scr_words, norm, True,
                     True, nw, min(1024, triton.next_power_of_2(K)), num_warps=nw)
    xf = x.float()
    xn = xf * torch.rsqrt(xf.square().mean() + 1e-6) * nw_.float() if norm else xf
    want = (w.weight.float() @ xn.half().float()) * f + b + res
    assert_close(y, want, what=f"mma8 {N}x{K} rows/task {rpt} warps {nw} norm {norm}")


MK_CASES = [("qwen2_moe", ("attn", "exp")), ("llama", ("attn",)), ("qwen3_moe_norm", ("attn", "exp")),
            ("gpt_oss", ("attn", "exp")), ("qwen3", ("attn",)), ("qwen3_moe_norm", ("exp",))]


@pytest.mark.parametrize("case,kinds", MK_CASES, ids=[f"{c}-{'+'.join(k)}" for c, k in MK_CASES])
def test_monokernel_fp8_tasks_on_the_tensor_cores(case, kinds, tiny_model, monkeypatch):
    """KIE_MONO_FP8_MMA=1: the monokernel's fp8 q|k|v (with qwen2's biases), o_proj and routed-expert gate / up
    (gpt-oss: its biases and clamped GLU) tasks run mma8 and decode the reference's greedy tokens; logits and K/V
    within fp16's rounding of the tasks' input (2^-11 relative, so a looser bound than the exact path's 1e-4)."""
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend
    from kie_moe.sampling import SamplingParams

    from .test_formats import PROMPT, DequantStore, quantize_model
    from .test_monokernel import check_against_reference
    monkeypatch.setenv("KIE_MONO_FP8_MMA", "1")
    m = tiny_model(case)
    q = quantize_model(m, "fp8", kinds)
    be = MonokernelBackend(m, "cpu", quantized=q.get, num_stages=2)
    d = be.plan.dims
    assert be.mma8 and (d.FMT_ATTN == 1) == ("attn" in kinds) and (d.FMT_EXP == 1) == ("exp" in kinds)
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), set()))

    class M:
        spec = m.spec
        weights = DequantStore(m.weights, q)
    check_against_reference(be, M, PROMPT, got, tol=5e-3)
    monkeypatch.setenv("KIE_MONO_FP8_MMA", "0")
    assert not MonokernelBackend(m, "cpu", quantized=q.get, num_stages=2).mma8


@triton.jit
def _glu_tasks(wg_ptr, wu_ptr, fg_ptr, fu_ptr, x_ptr, nw_ptr, bg_ptr, bu_ptr, h_ptr, scr_ptr, rows_per_task, N, eps,
               limit, alpha, K: tl.constexpr, SCR: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
               NW: tl.constexpr, BLOCK_X: tl.constexpr):
    pid = tl.program_id(0)
    r0 = pid * rows_per_task
    r_end = tl.minimum(r0 + rows_per_task, N)
    mma8_glu_task(wg_ptr.to(tl.pointer_type(tl.uint32)), wu_ptr.to(tl.pointer_type(tl.uint32)), fg_ptr, fu_ptr, K,
                  r0, r_end, x_ptr, nw_ptr, eps, bg_ptr, bu_ptr, h_ptr, limit, alpha, scr_ptr + pid * SCR, HAS_BIAS,
                  ACT, NW, BLOCK_X)


@pytest.mark.parametrize("act", [0, 1])
@pytest.mark.parametrize("N,K,rpt,nw", CASES, ids=[f"{c[0]}x{c[1]}-t{c[2]}-w{c[3]}" for c in CASES])
def test_mma8_glu_task_matches_torch(N, K, rpt, nw, act):
    """The routed experts' gate / up task: glu(fg (Wg . x') + bg, fu (Wu . x') + bu), act 0 silu, 1 gpt-oss's
    clamped GLU (limit 0.7: some values clamped)."""
    wg, wu = (random_weight("fp8", N, K, seed=N + K + i, device=DEV) for i in (0, 1))
    g = torch.Generator().manual_seed(K + 1)
    x, nw_ = (torch.randn(K, generator=g) * 3).to(DEV), torch.randn(K, generator=g).to(DEV, torch.bfloat16)
    fg, fu = (w.scale.reshape(-1).float().contiguous() for w in (wg, wu))
    bg, bu = torch.randn(N, generator=g).to(DEV), torch.randn(N, generator=g).to(DEV)
    tasks = triton.cdiv(N, rpt)
    scr_words = scratch_words(K, nw)
    scr = torch.full((tasks * scr_words,), float("nan"), device=DEV)
    h = torch.full((N,), float("nan"), device=DEV)
    _glu_tasks[(tasks,)](wg.weight.view(torch.uint8), wu.weight.view(torch.uint8), fg, fu, x, nw_, bg, bu, h, scr,
                         rpt, N, 1e-6, 0.7, 1.702, K, scr_words, True, act, nw, min(1024, triton.next_power_of_2(K)),
                         num_warps=nw)
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.square().mean() + 1e-6) * nw_.float()).half().float()
    gv = (wg.weight.float() @ xn) * fg + bg
    uv = (wu.weight.float() @ xn) * fu + bu
    if act == 0:
        want = torch.nn.functional.silu(gv) * uv
    else:
        gc, uc = gv.clamp(max=0.7), uv.clamp(-0.7, 0.7)
        want = (uc + 1) * gc * torch.sigmoid(1.702 * gc)
    assert_close(h, want, what=f"mma8 glu {N}x{K} rows/task {rpt} warps {nw} act {act}")

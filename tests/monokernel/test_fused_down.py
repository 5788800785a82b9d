"""KIE_FUSE_DOWN=1 (plan.fused_down): a routed expert's down projection inside its gate / up tasks, under the
interpreter. The device function against torch on odd and 16-aligned column slices, float and e4m3 weights; whole
decodes against the reference decoder (dense and MoE layers mixed, expert biases, fp8 experts) over two launches,
so a router accumulator left stale between steps (the parity rows the fused plan zeroes) changes the routing."""
import pytest
import torch
import triton
import triton.language as tl

from kie_moe.kernels.monokernel import plan as P
from kie_moe.kernels.monokernel.fused_down import expert_down_cols
from kie_moe.kernels.monokernel.runtime import MonokernelBackend

from .test_formats import DequantStore, quantize_model
from .test_monokernel import reference_over_two_launches_then_refused


@triton.jit
def _cols_kernel(w_ptr, f_ptr, b_ptr, h_ptr, wt, c0, nc, y_ptr, add_bias, D: tl.constexpr, I_MOE: tl.constexpr,
                 HAS_F: tl.constexpr, HAS_B: tl.constexpr, AL: tl.constexpr, BLOCK_D: tl.constexpr,
                 NS: tl.constexpr):
    expert_down_cols(w_ptr, f_ptr, b_ptr, h_ptr, wt, c0, nc, y_ptr, add_bias, D, I_MOE, HAS_F, HAS_B, AL, BLOCK_D,
                     NS)


@pytest.mark.parametrize("ns", [0, 3])   # tiles double-buffered in registers / Triton's pipeline
@pytest.mark.parametrize("D,I,c0,nc,al,e4m3,has_f,has_b,add_bias", [
    (37, 29, 5, 11, False, False, False, False, False),   # odd everything: masked rows and columns
    (40, 48, 16, 32, True, False, False, True, True),     # aligned slice, the bias added (the slot's first task)
    (40, 48, 16, 32, True, False, False, True, False),    # ... and not (every other task of the slot)
    (33, 64, 48, 16, True, True, True, False, False),     # e4m3 codes with row factors (fp8 experts)
    (33, 50, 3, 19, False, True, True, True, True),
])
def test_expert_down_cols_matches_torch(D, I, c0, nc, al, e4m3, has_f, has_b, add_bias, ns):
    """Row blocks of 16 (several per D) and 16-column chunks (the last one partial where not aligned)."""
    g = torch.Generator().manual_seed(D * 100 + I)
    w = torch.randn(D, I, generator=g)
    if e4m3:
        w = w.to(torch.float8_e4m3fn)
    f = torch.rand(D, generator=g) + 0.5
    b = torch.randn(D, generator=g)
    h = torch.randn(I, generator=g)
    y0 = torch.randn(D, generator=g)
    wt = 0.37
    y = y0.clone()
    _cols_kernel[(1,)](w, f, b, h, wt, c0, nc, y, int(add_bias), D, I, has_f, has_b, al, 16, ns)
    want = w.float()[:, c0:c0 + nc] @ h[c0:c0 + nc]
    if has_f:
        want = want * f
    if has_b and add_bias:
        want = want + b
    torch.testing.assert_close(y, y0 + wt * want, rtol=1e-5, atol=1e-5)


FUSED = [  # (tiny checkpoint, n_sms, Linear kinds quantized to fp8)
    ("qwen3_moe_mixed", 3, ()),        # dense + MoE layers, un-normalised top-3 of 9
    ("gpt_oss", 2, ()),                # expert biases (the slot's first task adds them), clamped GLU, router bias
    ("mixtral_window", 1, ()),         # one program: every task in claim order
    ("olmoe", 2, ("attn", "exp")),     # fp8 experts: e4m3 down codes with row factors
]


@pytest.mark.parametrize("case,n_sms,kinds", FUSED, ids=[c for c, _, _ in FUSED])
def test_fused_down_matches_reference(case, n_sms, kinds, tiny_model, monkeypatch):
    m = tiny_model(case)
    monkeypatch.setenv("KIE_FUSE_DOWN", "1")
    q = quantize_model(m, "fp8", kinds) if kinds else {}
    be = MonokernelBackend(m, "cpu", n_sms=n_sms, min_task_bytes=64, quantized=q.get if q else None)
    t = be.tasks(1)
    assert be.fuse_down and be.route_in_o and not (t[:, P.F_OP] == P.OP_EXP_DOWN).any()
    assert (t[:, P.F_OP] == P.OP_EXP_UP).any() and be.x.numel() == 2 * be.plan.dims.D

    class M:   # the reference's weights: the codes dequantized where the kernel streams codes
        spec = m.spec
        weights = DequantStore(m.weights, q)
    reference_over_two_launches_then_refused(be, M if q else m, 5, monkeypatch, "KIE_FUSE_DOWN", "yes")


def test_fused_down_only_where_it_applies(tiny_model, monkeypatch):
    """A shared expert (qwen2_moe) or the router tasks (KIE_ROUTE_IN_O=0) keep the down tasks; build_tasks refuses
    the fused table without the router inside o_proj."""
    monkeypatch.setenv("KIE_FUSE_DOWN", "1")
    be = MonokernelBackend(tiny_model("qwen2_moe"), "cpu")
    assert not be.fuse_down and (be.tasks(1)[:, P.F_OP] == P.OP_EXP_DOWN).any()
    monkeypatch.setenv("KIE_ROUTE_IN_O", "0")
    be = MonokernelBackend(tiny_model("olmoe"), "cpu")
    assert not be.fuse_down and (be.tasks(1)[:, P.F_OP] == P.OP_EXP_DOWN).any()
    with pytest.raises(ValueError, match="KIE_FUSE_DOWN"):
        P.build_tasks(be.plan, rin_o=False, fuse_dn=True)

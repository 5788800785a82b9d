"""q/k/v GEMV + RoPE + append + attention in one launch (kernels/qkv_attention.py) vs the two launches it replaces
(gemv + attention.rope_gqa_decode) and the PyTorch references (Triton interpreter on CPU)."""

import pytest
import torch

from kie_moe.kernels.attention import gqa_decode_ref, rope_gqa_decode
from kie_moe.kernels.gemv import TileConfig, gemv, gemv_ref
from kie_moe.kernels.qkv_attention import qkv_attention_unfit, qkv_rope_gqa_decode
from kie_moe.kernels.rope import rope_append_ref, rope_tables
from kie_moe.kernels.weights import random_weight
from kie_moe.models.spec import RopeSpec

from .helpers import DEV, assert_close, needs_device

pytestmark = needs_device

Hq, Hkv, Dh, K, MAX_LEN = 6, 2, 16, 72, 32   # REP 3; q/k/v rows (6 + 4) x 16 = 160; K ragged against 32-wide steps
TILES = TileConfig(8, 32, num_warps=2)         # 8-row tiles: 2 per head, 10 per kv head


def pos_t(p):
    return torch.tensor([p], dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("fmt,style,norm,bias,window,sinks,x8", [
    ("bf16", "half", None, False, None, False, False),
    ("fp8", "half", "head", False, None, False, False),     # Qwen3-MoE: fp8 q/k/v, per-head q/k norm
    ("fp8_block", "pair", None, True, 5, False, False),     # q/k/v bias (Qwen2), adjacent pairs, sliding window
    ("bf16", "half", None, True, 7, True, True),             # gpt-oss: bias, window, sinks; fp4 o_proj's x8 out
])
def test_one_launch_equals_the_gemv_and_the_fused_attention(fmt, style, norm, bias, window, sinks, x8):
    """Step after step (pos 0..9, the cache filling): the same q/k/v rows, attention output and cache rows as
    gemv + rope_gqa_decode, bit for bit (the same tile and task code), and the PyTorch references' (gemv_ref,
    rope_append_ref, gqa_decode_ref) within float tolerance. The per-head counters end at zero."""
    g = torch.Generator().manual_seed(5)
    w = random_weight(fmt, (Hq + 2 * Hkv) * Dh, K, seed=6, device=DEV)
    cos, sin = rope_tables(RopeSpec(theta=500.0, rotary_dim=Dh, style=style), MAX_LEN, DEV)
    nw = (torch.rand(K, generator=g) + 0.5).to(DEV)
    b = torch.randn((Hq + 2 * Hkv) * Dh, generator=g).to(DEV) if bias else None
    qn, kn = ((torch.rand(Dh, generator=g) + 0.5).to(DEV) for _ in range(2))
    snk = torch.randn(Hq, generator=g).to(DEV) if sinks else None
    rkw = dict(style=style, qk_norm=norm, q_norm=qn, k_norm=kn, eps=1e-5)   # one eps: the input's and q/k's norms
    akw = dict(softmax_scale=Dh ** -0.5, window=window, sinks=snk)
    kc, vc, kc2, vc2, kcr, vcr = (torch.zeros(MAX_LEN, Hkv, Dh, device=DEV) for _ in range(6))
    nq, nkv = Hq * Dh, Hkv * Dh
    assert qkv_attention_unfit(w, Hq, kc, window, norm, TILES) is None
    for pos in range(10):
        x = torch.randn(K, generator=g).to(DEV)
        o, qkv = qkv_rope_gqa_decode(x, w, kc, vc, pos_t(pos), cos, sin, q_heads=Hq, bias=b, norm_weight=nw,
                                     out_x8=x8, config=TILES, **rkw, **akw)
        y = gemv(x, w, bias=b, norm_weight=nw, eps=1e-5, config=TILES)
        q, k, v = y[:nq].view(Hq, Dh), y[nq:nq + nkv].view(Hkv, Dh), y[nq + nkv:].view(Hkv, Dh)
        want = rope_gqa_decode(q, k, v, kc2, vc2, pos_t(pos), cos, sin, num_splits=1, out_x8=x8, **rkw, **akw)
        assert torch.equal(qkv, y), f"q/k/v rows differ at pos {pos}"
        assert torch.equal(o, want), f"attention output differs at pos {pos}"
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2), f"cache rows differ at pos {pos}"
        yr = gemv_ref(x, w, bias=b, norm_weight=nw, eps=1e-5)
        assert_close(qkv, yr, what=f"{fmt} q/k/v pos {pos}")
        qr, _ = rope_append_ref(yr[:nq].view(Hq, Dh), yr[nq:nq + nkv].view(Hkv, Dh), yr[nq + nkv:].view(Hkv, Dh),
                                kcr, vcr, pos, cos, sin, **rkw)
        ref = gqa_decode_ref(qr, kcr, vcr, pos, **akw)
        got = o.t().reshape(Hq, Dh) if x8 else o   # x8[e, j] = o[8 j + e]
        assert_close(got, ref, what=f"{fmt} attention vs reference pos {pos}")
    from kie_moe.kernels.gemv import counters
    assert not counters(torch.device(DEV), Hkv)[:Hkv].any()


def test_what_one_launch_cannot_take_is_named():
    """qkv_attention_unfit names why (the graph then keeps the two launches); qkv_rope_gqa_decode raises it."""
    w = random_weight("bf16", (Hq + 2 * Hkv) * Dh, K, seed=6, device=DEV)
    kc = torch.zeros(MAX_LEN, Hkv, Dh, device=DEV)
    assert "float formats" in qkv_attention_unfit(random_weight("nvfp4", 160, 64, device=DEV), Hq, kc, None, None)
    assert "not (6 + 2 x 2) x 16" in qkv_attention_unfit(w.rows(0, 144), Hq, kc, None, None)
    assert "not a multiple of the GEMV's 32-row tiles" in qkv_attention_unfit(w, Hq, kc, None, None,
                                                                               TileConfig(32, 32))
    assert "full-projection" in qkv_attention_unfit(w, Hq, kc, None, "full")
    cos, sin = rope_tables(RopeSpec(theta=500.0, rotary_dim=Dh), MAX_LEN, DEV)
    with pytest.raises(ValueError, match="qkv_rope_gqa_decode: .*full-projection"):
        qkv_rope_gqa_decode(torch.zeros(K, device=DEV), w, kc, kc.clone(), pos_t(0), cos, sin, q_heads=Hq,
                            softmax_scale=1.0, qk_norm="full", config=TILES)

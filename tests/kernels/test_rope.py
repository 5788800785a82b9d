"""Fused norm + RoPE + KV append (kernels/rope.py) against its torch reference, which follows models/reference.py.

Small odd shapes (Dh 24, 6 q / 2 kv heads, partial rotary 16); bf16 results must be bit-identical to the
reference (same rounding points), fp32 within a few ulp.
"""
import os

import pytest
import torch

from kie_moe.kernels.rope import mla_rope_append, mla_rope_append_ref, rope_append, rope_append_ref, rope_tables
from kie_moe.models.spec import RopeSpec

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="no interpreter, no GPU")

Hq, Hkv, Dh, MAX_LEN = 6, 2, 24, 40


def close(got, want, dtype, what):
    tol = 0.0 if (dtype == torch.bfloat16 and INTERPRET) else (2e-6 if dtype == torch.float32 else 1e-2)
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(1.0, want.float().abs().max().item()), f"{what}: max error {err:.3g}"


def pos_t(p):
    return torch.tensor([p], dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["half", "pair"])
@pytest.mark.parametrize("norm,rot,clip", [(None, 24, None), ("head", 16, None), ("full", 24, 1.5), (None, 16, 0.7)])
def test_rope_append_matches_reference(dtype, style, norm, rot, clip):
    g = torch.Generator().manual_seed(hash((str(dtype), style, norm, rot)) % 1000)
    rope = RopeSpec(theta=500.0, rotary_dim=rot, style=style)
    cos, sin = rope_tables(rope, MAX_LEN, DEV)
    q, k, v = (torch.randn(h, Dh, generator=g).to(DEV, dtype) for h in (Hq, Hkv, Hkv))
    nq, nk = (Dh, Dh) if norm == "head" else (Hq * Dh, Hkv * Dh)
    q_norm = (torch.rand(nq, generator=g) + 0.5).to(DEV, dtype)
    k_norm = (torch.rand(nk, generator=g) + 0.5).to(DEV, dtype)
    for pos in (0, 7, 33):
        kc = torch.zeros(MAX_LEN, Hkv, Dh, dtype=dtype, device=DEV)
        vc, kc_ref, vc_ref = torch.zeros_like(kc), torch.zeros_like(kc), torch.zeros_like(kc)
        want_q, want_k = rope_append_ref(q, k, v, kc_ref, vc_ref, pos, cos, sin, style=style, qk_norm=norm,
                                         q_norm=q_norm, k_norm=k_norm, clip_qkv=clip)
        q1, k1, v1 = q.clone(), k.clone(), v.clone()
        rope_append(q1, k1, v1, kc, vc, pos_t(pos), cos, sin, style=style, qk_norm=norm, q_norm=q_norm,
                    k_norm=k_norm, clip_qkv=clip)
        close(q1, want_q, dtype, f"q pos={pos}")
        close(k1, want_k, dtype, f"k pos={pos}")
        close(kc, kc_ref, dtype, f"k_cache pos={pos}")
        close(vc, vc_ref, dtype, f"v_cache pos={pos}")


def test_rope_append_yarn_several_heads_per_program_and_out_of_range_position():
    rope = RopeSpec(theta=10000.0, rotary_dim=Dh, style="half", scaling="yarn", factor=4.0, original_max_position=16)
    cos, sin = rope_tables(rope, MAX_LEN, DEV)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(h, Dh, generator=g).to(DEV) for h in (Hq, Hkv, Hkv))
    kc, vc = torch.zeros(MAX_LEN, Hkv, Dh, device=DEV), torch.zeros(MAX_LEN, Hkv, Dh, device=DEV)
    want_q, want_k = rope_append_ref(q, k, v, kc.clone(), vc.clone(), 29, cos, sin)
    q1, k1, v1 = q.clone(), k.clone(), v.clone()
    rope_append(q1, k1, v1, kc, vc, pos_t(29), cos, sin, kv_per_prog=2)
    close(q1, want_q, torch.float32, "q")
    close(kc[29], want_k, torch.float32, "k_cache")
    # a cache too short for the position: nothing is written (the engine bounds generation length)
    small_k, small_v = torch.zeros(8, Hkv, Dh, device=DEV), torch.zeros(8, Hkv, Dh, device=DEV)
    rope_append(q.clone(), k.clone(), v.clone(), small_k, small_v, pos_t(29), cos, sin)
    assert small_k.abs().sum() == 0 and small_v.abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style,norm", [("pair", True), ("half", False)])
def test_mla_rope_append_matches_reference(dtype, style, norm):
    H, nope, rd, r = 5, 12, 8, 20
    rope = RopeSpec(theta=10000.0, rotary_dim=rd, style=style, scaling="yarn", factor=8.0, original_max_position=8,
                    mscale=1.0, mscale_all_dim=0.707)
    cos, sin = rope_tables(rope, MAX_LEN, DEV)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(H, nope + rd, generator=g).to(DEV, dtype)
    kv = torch.randn(r + rd, generator=g).to(DEV, dtype)
    w = (torch.rand(r, generator=g) + 0.5).to(DEV, dtype) if norm else None
    for pos in (0, 33):
        cache = torch.zeros(MAX_LEN, r + rd, dtype=dtype, device=DEV)
        cache_ref = cache.clone()
        want_q = mla_rope_append_ref(q, kv, cache_ref, pos, cos, sin, nope=nope, style=style, kv_norm=w)
        q1 = q.clone()
        mla_rope_append(q1, kv, cache, pos_t(pos), cos, sin, nope=nope, style=style, kv_norm=w, block_h=2)
        close(q1, want_q, dtype, f"q pos={pos}")
        close(cache, cache_ref, dtype, f"cache pos={pos}")


def test_rope_append_rejects_bad_inputs():
    cos, sin = rope_tables(RopeSpec(rotary_dim=Dh), MAX_LEN, DEV)
    q, k, v = torch.zeros(Hq, Dh, device=DEV), torch.zeros(Hkv, Dh, device=DEV), torch.zeros(Hkv, Dh, device=DEV)
    kc = torch.zeros(MAX_LEN, Hkv, Dh, device=DEV)
    with pytest.raises(ValueError, match="pos"):
        rope_append(q, k, v, kc, kc.clone(), torch.tensor([3], device=DEV), cos, sin)          # int64 position
    with pytest.raises(ValueError, match="k_cache"):
        rope_append(q, k, v, kc[:, :1], kc.clone(), pos_t(3), cos, sin)
    with pytest.raises(ValueError, match="q_norm"):
        rope_append(q, k, v, kc, kc.clone(), pos_t(3), cos, sin, qk_norm="head")
    with pytest.raises(ValueError, match="style"):
        rope_append(q, k, v, kc, kc.clone(), pos_t(3), cos, sin, style="complex")
    with pytest.raises(ValueError, match="kv_b|cache"):
        mla_rope_append(torch.zeros(4, 20, device=DEV), torch.zeros(28, device=DEV), torch.zeros(8, 27, device=DEV),
                        pos_t(0), *rope_tables(RopeSpec(rotary_dim=8), 8, DEV), nope=12)


# ---- rope_append + gqa_decode as one launch (attention.rope_gqa_decode) --------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style,norm,rot,clip,window,sinks,splits", [
    ("half", None, 24, None, None, False, 1),
    ("half", "head", 16, None, None, False, 3),    # Qwen3: per-head q/k norm, partial rotation, splits
    ("pair", None, 16, 0.7, 9, False, 2),          # clip, sliding window
    ("half", None, 24, None, 5, True, 4),          # gpt-oss: window + sinks, more splits than keys at pos 0
])
def test_rope_gqa_decode_equals_the_two_launches(dtype, style, norm, rot, clip, window, sinks, splits):
    """Against rope_append + gqa_decode (same rounding): equal outputs and cache rows, step after step, with the
    q / k buffers left as they were; and against the PyTorch references (rope_append_ref + gqa_decode_ref)."""
    from kie_moe.kernels.attention import gqa_decode, gqa_decode_ref, rope_gqa_decode
    g = torch.Generator().manual_seed(11)
    rope = RopeSpec(theta=500.0, rotary_dim=rot, style=style)
    cos, sin = rope_tables(rope, MAX_LEN, DEV)
    q_norm = (torch.rand(Dh, generator=g) + 0.5).to(DEV, dtype)
    k_norm = (torch.rand(Dh, generator=g) + 0.5).to(DEV, dtype)
    snk = torch.randn(Hq, generator=g).to(DEV, torch.float32) if sinks else None
    kw = dict(style=style, qk_norm=norm, q_norm=q_norm, k_norm=k_norm, clip_qkv=clip)
    akw = dict(softmax_scale=Dh ** -0.5, window=window, sinks=snk, num_splits=splits)
    kc, vc = (torch.zeros(MAX_LEN, Hkv, Dh, dtype=dtype, device=DEV) for _ in range(2))
    kc2, vc2, kc_ref, vc_ref = (torch.zeros_like(kc) for _ in range(4))
    for pos in range(0, 12):
        q, k, v = (torch.randn(h, Dh, generator=g).to(DEV, dtype) for h in (Hq, Hkv, Hkv))
        q0, k0, v0 = q.clone(), k.clone(), v.clone()
        got = rope_gqa_decode(q, k, v, kc, vc, pos_t(pos), cos, sin, **kw, **akw)
        assert torch.equal(q, q0) and torch.equal(k, k0) and torch.equal(v, v0)   # buffers untouched
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        rope_append(q2, k2, v2, kc2, vc2, pos_t(pos), cos, sin, **kw)
        want = gqa_decode(q2, kc2, vc2, pos_t(pos), **akw)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2), f"cache rows differ at pos {pos}"
        close(got, want, dtype if dtype == torch.float32 else torch.float32, f"out pos={pos}")
        qr, _ = rope_append_ref(q.clone(), k.clone(), v.clone(), kc_ref, vc_ref, pos, cos, sin, **kw)
        ref = gqa_decode_ref(qr, kc_ref, vc_ref, pos, softmax_scale=Dh ** -0.5, window=window, sinks=snk)
        close(got, ref, dtype, f"out vs reference pos={pos}")


def test_rope_gqa_decode_refuses_a_full_projection_norm():
    from kie_moe.kernels.attention import rope_gqa_decode
    cos, sin = rope_tables(RopeSpec(theta=500.0, rotary_dim=Dh), MAX_LEN, DEV)
    q, k, v = torch.zeros(Hq, Dh, device=DEV), torch.zeros(Hkv, Dh, device=DEV), torch.zeros(Hkv, Dh, device=DEV)
    kc = torch.zeros(MAX_LEN, Hkv, Dh, device=DEV)
    with pytest.raises(ValueError, match="full"):
        rope_gqa_decode(q, k, v, kc, kc.clone(), pos_t(0), cos, sin, softmax_scale=1.0, qk_norm="full",
                        q_norm=torch.ones(Hq * Dh, device=DEV), k_norm=torch.ones(Hkv * Dh, device=DEV))

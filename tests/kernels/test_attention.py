"""Decode attention (kernels/attention.py) against torch references and against models/reference.ReferenceDecoder.

CPU under TRITON_INTERPRET=1 with small odd shapes: Dh 24, 6 q / 2 kv heads, contexts 1, 7, 33, windows shorter
and longer than the context, sinks, several split counts (including more splits than key blocks); MLA with
r 20, rope 8, nope 12, v 10. The end-to-end cases run one decode step of a real attention layer (projections by
torch, then rope_append + attention kernels) and compare with the reference decoder's own _gqa / _mla.
"""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from kie_moe.kernels.attention import gqa_decode, gqa_decode_ref, mla_decode, mla_decode_ref
from kie_moe.kernels.rope import mla_rope_append, rope_append, rope_tables
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.models.spec import AttentionSpec, LayerSpec, MLPSpec, ModelSpec, RopeSpec

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
pytestmark = [pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="no interpreter, no GPU"),
              # the interpreter's range() over device-loaded bounds (numpy 2.2; see DESIGN.md §7)
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")]

Hq, Hkv, Dh, MAX_LEN = 6, 2, 24, 40


def assert_close(got, want, dtype, what=""):
    """fp32: fp32 sums in another order; bf16: one bf16 rounding of the output (+ bf16 P @ V on the GPU)."""
    rel = 2e-5 if dtype == torch.float32 else 2e-2
    got, want = got.float().cpu(), want.float().cpu()
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    assert err <= rel, f"{what}: max error {err:.3g} x max|ref| > {rel}"


def pos_t(p):
    return torch.tensor([p], dtype=torch.int32, device=DEV)


# ---- GQA against the cache-level reference ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,sinks", [(None, False), (None, True), (5, True), (40, False), (1, False)])
@pytest.mark.parametrize("splits", [1, 3])
def test_gqa_decode_matches_reference(dtype, window, sinks, splits):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(Hq, Dh, generator=g).to(DEV, dtype)
    kc = torch.randn(MAX_LEN, Hkv, Dh, generator=g).to(DEV, dtype)
    vc = torch.randn(MAX_LEN, Hkv, Dh, generator=g).to(DEV, dtype)
    sk = (torch.randn(Hq, generator=g) * 2).to(DEV, dtype) if sinks else None
    for length in (1, 7, 33):
        got = gqa_decode(q, kc, vc, pos_t(length - 1), softmax_scale=Dh ** -0.5, window=window, sinks=sk,
                         num_splits=splits, block_n=16)
        want = gqa_decode_ref(q, kc, vc, length - 1, softmax_scale=Dh ** -0.5, window=window, sinks=sk)
        assert got.dtype == dtype and got.shape == (Hq, Dh)
        assert_close(got, want, dtype, f"len={length} window={window} sinks={sinks} splits={splits}")


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_out_x8_is_the_output_in_the_x8_layout(fused, splits):
    """out_x8=True (what an fp4 o_proj reads): fp32 [8, Hq*Dh/8] holding the flat output at x8[e, j] = o[8j + e],
    equal to the plain launch's output, from the split launch (1 split) and from the combine (3), with and
    without the fused RoPE + append; out of the wrong shape is refused by name."""
    from kie_moe.kernels.attention import rope_gqa_decode
    from kie_moe.kernels.gemv import prepare_x8
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(h, Dh, generator=g).to(DEV) for h in (Hq, Hkv, Hkv))
    kc0, vc0 = (torch.randn(MAX_LEN, Hkv, Dh, generator=g).to(DEV) for _ in range(2))
    caches = [kc0, vc0, kc0.clone(), vc0.clone()]     # each run appends into its own copy
    cos, sin = rope_tables(RopeSpec(theta=10000.0, rotary_dim=Dh), MAX_LEN, DEV)
    sk = torch.randn(Hq, generator=g).to(DEV)
    kw = dict(softmax_scale=Dh ** -0.5, sinks=sk, num_splits=splits, block_n=16)
    outs = []
    for x8, (kc, vc) in ((False, caches[:2]), (True, caches[2:])):
        if fused:
            o = rope_gqa_decode(q, k, v, kc, vc, pos_t(20), cos, sin, out_x8=x8, **kw)
        else:
            o = gqa_decode(q, kc, vc, pos_t(20), out_x8=x8, **kw)
        outs.append(o)
    assert outs[1].shape == (8, Hq * Dh // 8) and outs[1].dtype == torch.float32
    assert torch.equal(outs[1], prepare_x8(outs[0].reshape(-1)))
    with pytest.raises(ValueError, match="with out_x8 a contiguous fp32"):
        gqa_decode(q, caches[0], caches[1], pos_t(3), out_x8=True, out=torch.empty(Hq, Dh, device=DEV), **kw)


def test_gqa_decode_many_splits_default_splits_and_mha():
    """More splits than key blocks (most splits empty), the launcher's default, and Hq == Hkv (REP 1)."""
    g = torch.Generator().manual_seed(12)
    q = torch.randn(Hq, Dh, generator=g).to(DEV)
    kc, vc = (torch.randn(MAX_LEN, Hkv, Dh, generator=g).to(DEV) for _ in range(2))
    for splits in (7, None):
        for length in (2, 33):
            got = gqa_decode(q, kc, vc, pos_t(length - 1), softmax_scale=0.3, num_splits=splits, block_n=16)
            assert_close(got, gqa_decode_ref(q, kc, vc, length - 1, softmax_scale=0.3), torch.float32,
                         f"splits={splits} len={length}")
    kc3, vc3 = (torch.randn(MAX_LEN, 3, 20, generator=g).to(DEV) for _ in range(2))
    q3 = torch.randn(3, 20, generator=g).to(DEV)
    out = torch.empty(3, 20, device=DEV)
    got = gqa_decode(q3, kc3, vc3, pos_t(20), softmax_scale=0.2, window=9, num_splits=2, block_n=16, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(got, gqa_decode_ref(q3, kc3, vc3, 20, softmax_scale=0.2, window=9), torch.float32, "mha")


def test_head_major_cache_view():
    """Strides are honoured: a head-major [Hkv, max_len, Dh] cache (the monokernel's) works as a permuted view."""
    g = torch.Generator().manual_seed(14)
    k_hm, v_hm = (torch.randn(Hkv, MAX_LEN, Dh, generator=g).to(DEV) for _ in range(2))
    kc, vc = k_hm.permute(1, 0, 2), v_hm.permute(1, 0, 2)                  # [max_len, Hkv, Dh] views
    q, k, v = (torch.randn(h, Dh, generator=g).to(DEV) for h in (Hq, Hkv, Hkv))
    cos, sin = rope_tables(RopeSpec(rotary_dim=Dh), MAX_LEN, DEV)
    rope_append(q, k, v, kc, vc, pos_t(20), cos, sin)
    assert torch.equal(k_hm[:, 20], k) and torch.equal(v_hm[:, 20], v)
    got = gqa_decode(q, kc, vc, pos_t(20), softmax_scale=0.2, num_splits=2, block_n=16)
    want = gqa_decode_ref(q, kc.contiguous(), vc.contiguous(), 20, softmax_scale=0.2)
    assert_close(got, want, torch.float32, "head-major")


def test_gqa_decode_rejects_bad_inputs():
    q = torch.zeros(Hq, Dh, device=DEV)
    kc = torch.zeros(MAX_LEN, Hkv, Dh, device=DEV)
    with pytest.raises(ValueError, match="pos"):
        gqa_decode(q, kc, kc, torch.tensor([3], device=DEV), softmax_scale=1.0)
    with pytest.raises(ValueError, match="k_cache"):
        gqa_decode(q, torch.zeros(MAX_LEN, 4, Dh, device=DEV), kc, pos_t(3), softmax_scale=1.0)
    with pytest.raises(ValueError, match="v_cache"):
        gqa_decode(q, kc, kc[:5], pos_t(3), softmax_scale=1.0)
    with pytest.raises(ValueError, match="sinks"):
        gqa_decode(q, kc, kc, pos_t(3), softmax_scale=1.0, sinks=torch.zeros(Hkv, device=DEV))
    with pytest.raises(ValueError, match="window"):
        gqa_decode(q, kc, kc, pos_t(3), softmax_scale=1.0, window=0)


# ---- MLA against the non-absorbed reference ----------------------------------------------------------------------

H, NOPE, ROPE_D, R, V = 5, 12, 8, 20, 10


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,splits", [(None, 1), (None, 3), (6, 2)])
def test_mla_decode_matches_reference(dtype, window, splits):
    g = torch.Generator().manual_seed(13)
    q = torch.randn(H, NOPE + ROPE_D, generator=g).to(DEV, dtype)
    cache = torch.randn(MAX_LEN, R + ROPE_D, generator=g).to(DEV, dtype)
    kv_b = (torch.randn(H * (NOPE + V), R, generator=g) * 0.3).to(DEV, dtype)
    scale = (NOPE + ROPE_D) ** -0.5
    for length in (1, 7, 33):
        got = mla_decode(q, cache, kv_b, pos_t(length - 1), nope=NOPE, v_head_dim=V, softmax_scale=scale,
                         window=window, num_splits=splits, block_n=16, block_h=4)
        want = mla_decode_ref(q, cache, kv_b, length - 1, nope=NOPE, v_head_dim=V, softmax_scale=scale, window=window)
        assert got.shape == (H, V) and got.dtype == dtype
        assert_close(got, want, dtype, f"len={length} window={window} splits={splits}")


def test_mla_decode_rejects_bad_kv_b():
    with pytest.raises(ValueError, match="kv_b"):
        mla_decode(torch.zeros(H, NOPE + ROPE_D, device=DEV), torch.zeros(MAX_LEN, R + ROPE_D, device=DEV),
                   torch.zeros(H * NOPE, R, device=DEV), pos_t(0), nope=NOPE, v_head_dim=V, softmax_scale=1.0)


# ---- one decode step of a real layer, against ReferenceDecoder ---------------------------------------------------

class _Weights:
    def __init__(self, d):
        self.d = d

    def names(self):
        return list(self.d)

    def get(self, n):
        return self.d[n]


def _decoder(attn: AttentionSpec, window, weights: dict, D: int, dtype) -> tuple[ReferenceDecoder, LayerSpec]:
    lay = LayerSpec(attn=attn, mlp=MLPSpec(intermediate_size=8), sliding_window=window)
    spec = ModelSpec(family="test", vocab_size=8, hidden_size=D, layers=(lay,), norm_eps=1e-6, max_position=64)
    weights = dict(weights, embed=torch.zeros(8, D))
    return ReferenceDecoder(spec, _Weights(weights), DEV, dtype), lay


GQA_CASES = {
    # name: (AttentionSpec extras, window)
    "qwen3": (dict(qk_norm="head", rope=RopeSpec(theta=1e6, rotary_dim=Dh, style="half")), None),
    "gpt_oss": (dict(qkv_bias=True, o_bias=True, sinks=True,
                     rope=RopeSpec(theta=15e4, rotary_dim=Dh, style="half", scaling="yarn", factor=8.0,
                                   original_max_position=16, beta_fast=32.0, beta_slow=1.0)), 5),
    "olmoe": (dict(qk_norm="full", clip_qkv=1.0, rope=RopeSpec(theta=1e4, rotary_dim=Dh)), None),
    "partial_pair": (dict(rope=RopeSpec(theta=1e4, rotary_dim=16, style="pair")), 40),
}


@pytest.mark.parametrize("case", sorted(GQA_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_layer_step_matches_reference_decoder(case, dtype):
    extra, window = GQA_CASES[case]
    D, P = 32, 12                                          # hidden size, prompt length before the decode step
    a = AttentionSpec(kind="gqa", num_heads=Hq, num_kv_heads=Hkv, head_dim=Dh, softmax_scale=Dh ** -0.5, **extra)
    g = torch.Generator().manual_seed(len(case))
    w = {"layers.0.attn.q": torch.randn(Hq * Dh, D, generator=g) * 0.2,
         "layers.0.attn.k": torch.randn(Hkv * Dh, D, generator=g) * 0.2,
         "layers.0.attn.v": torch.randn(Hkv * Dh, D, generator=g) * 0.2,
         "layers.0.attn.o": torch.randn(D, Hq * Dh, generator=g) * 0.2}
    if a.qkv_bias:
        for n, size in (("q", Hq * Dh), ("k", Hkv * Dh), ("v", Hkv * Dh)):
            w[f"layers.0.attn.{n}_bias"] = torch.randn(size, generator=g) * 0.1
    if a.o_bias:
        w["layers.0.attn.o_bias"] = torch.randn(D, generator=g) * 0.1
    if a.qk_norm:
        nq, nk = (Dh, Dh) if a.qk_norm == "head" else (Hq * Dh, Hkv * Dh)
        w["layers.0.attn.q_norm"] = torch.rand(nq, generator=g) + 0.5
        w["layers.0.attn.k_norm"] = torch.rand(nk, generator=g) + 0.5
    if a.sinks:
        w["layers.0.attn.sinks"] = torch.randn(Hq, generator=g)
    dec, lay = _decoder(a, window, w, D, dtype)
    x = torch.randn(P + 1, D, generator=g).to(DEV, dtype)
    dec._gqa(0, lay, x[:P], 0)                                              # prefill fills the reference cache
    k_prev, v_prev = (t.clone() for t in dec.cache[0])
    want = dec._gqa(0, lay, x[P:], P)                                      # the decode step: [1, D]

    p = lambda n: dec.p(0, n)                                              # noqa: E731  (weights in `dtype`)
    q = F.linear(x[P:], p("attn.q"), p("attn.q_bias")).view(Hq, Dh).contiguous()
    k = F.linear(x[P:], p("attn.k"), p("attn.k_bias")).view(Hkv, Dh).contiguous()
    v = F.linear(x[P:], p("attn.v"), p("attn.v_bias")).view(Hkv, Dh).contiguous()
    kc = torch.zeros(MAX_LEN, Hkv, Dh, dtype=dtype, device=DEV)
    vc = torch.zeros_like(kc)
    kc[:P], vc[:P] = k_prev, v_prev
    cos, sin = rope_tables(a.rope, MAX_LEN, DEV)
    pos = pos_t(P)
    rope_append(q, k, v, kc, vc, pos, cos, sin, style=a.rope.style, qk_norm=a.qk_norm, q_norm=p("attn.q_norm"),
                k_norm=p("attn.k_norm"), eps=1e-6, clip_qkv=a.clip_qkv)
    o = gqa_decode(q, kc, vc, pos, softmax_scale=a.softmax_scale, window=window, sinks=p("attn.sinks"),
                   num_splits=2, block_n=16)
    got = F.linear(o.view(1, -1), p("attn.o"), p("attn.o_bias"))
    assert_close(kc[:P + 1], dec.cache[0][0], dtype, f"{case}: k cache")
    assert_close(got, want, dtype, f"{case}: attention output")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_layer_step_matches_reference_decoder(dtype):
    D, P = 32, 9
    rope = RopeSpec(theta=1e4, rotary_dim=ROPE_D, style="pair", scaling="yarn", factor=4.0, original_max_position=8,
                    mscale=1.0, mscale_all_dim=1.0)
    scale = (NOPE + ROPE_D) ** -0.5 * (0.1 * math.log(4.0) + 1.0) ** 2
    a = AttentionSpec(kind="mla", num_heads=H, num_kv_heads=H, head_dim=NOPE + ROPE_D, rope=rope, softmax_scale=scale,
                      kv_lora_rank=R, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE_D, v_head_dim=V)
    g = torch.Generator().manual_seed(21)
    w = {"layers.0.attn.q": torch.randn(H * (NOPE + ROPE_D), D, generator=g) * 0.2,
         "layers.0.attn.kv_a": torch.randn(R + ROPE_D, D, generator=g) * 0.2,
         "layers.0.attn.kv_a_norm": torch.rand(R, generator=g) + 0.5,
         "layers.0.attn.kv_b": torch.randn(H * (NOPE + V), R, generator=g) * 0.2,
         "layers.0.attn.o": torch.randn(D, H * V, generator=g) * 0.2}
    dec, lay = _decoder(a, None, w, D, dtype)
    x = torch.randn(P + 1, D, generator=g).to(DEV, dtype)
    dec._mla(0, lay, x[:P], 0)
    lat_prev, kpe_prev = (t.clone() for t in dec.cache[0])
    want = dec._mla(0, lay, x[P:], P)

    p = lambda n: dec.p(0, n)                                              # noqa: E731
    q = F.linear(x[P:], p("attn.q")).view(H, NOPE + ROPE_D).contiguous()
    kv = F.linear(x[P:], p("attn.kv_a"))[0].contiguous()                   # [R + rope]
    cache = torch.zeros(MAX_LEN, R + ROPE_D, dtype=dtype, device=DEV)
    cache[:P, :R], cache[:P, R:] = lat_prev, kpe_prev
    cos, sin = rope_tables(rope, MAX_LEN, DEV)
    pos = pos_t(P)
    mla_rope_append(q, kv, cache, pos, cos, sin, nope=NOPE, style="pair", kv_norm=p("attn.kv_a_norm"), eps=1e-6)
    o = mla_decode(q, cache, p("attn.kv_b"), pos, nope=NOPE, v_head_dim=V, softmax_scale=scale, num_splits=2,
                   block_n=16)
    got = F.linear(o.view(1, -1), p("attn.o"))
    assert_close(cache[:P + 1, :R], dec.cache[0][0], dtype, "latent cache")
    assert_close(cache[:P + 1, R:], dec.cache[0][1], dtype, "k_pe cache")
    assert_close(got, want, dtype, "mla output")


# ---- real sizes, on the device machine ---------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("Hq_,Hkv_,Dh_,window,sinks", [(32, 4, 128, None, False), (64, 8, 64, 128, True),
                                                       (64, 8, 64, None, True)])
def test_gqa_decode_real_shapes_gpu(Hq_, Hkv_, Dh_, window, sinks):
    g = torch.Generator(device="cuda").manual_seed(0)
    L = 8192
    q = torch.randn(Hq_, Dh_, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = torch.randn(L, Hkv_, Dh_, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(L, Hkv_, Dh_, device="cuda", dtype=torch.bfloat16, generator=g)
    sk = torch.randn(Hq_, device="cuda", generator=g) if sinks else None
    for length in (1, 77, 4099, L):
        got = gqa_decode(q, kc, vc, pos_t(length - 1), softmax_scale=Dh_ ** -0.5, window=window, sinks=sk)
        want = gqa_decode_ref(q.float(), kc.float(), vc.float(), length - 1, softmax_scale=Dh_ ** -0.5,
                              window=window, sinks=sk)
        assert_close(got, want, torch.bfloat16, f"len={length}")


@pytest.mark.gpu
def test_mla_decode_real_shapes_gpu():
    g = torch.Generator(device="cuda").manual_seed(0)
    H_, nope, rd, r, v, L = 128, 128, 64, 512, 128, 4096
    q = torch.randn(H_, nope + rd, device="cuda", dtype=torch.bfloat16, generator=g)
    cache = torch.randn(L, r + rd, device="cuda", dtype=torch.bfloat16, generator=g)
    kv_b = torch.randn(H_ * (nope + v), r, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    for length in (1, 1000, L):
        got = mla_decode(q, cache, kv_b, pos_t(length - 1), nope=nope, v_head_dim=v, softmax_scale=0.1)
        want = mla_decode_ref(q.float(), cache.float(), kv_b.float(), length - 1, nope=nope, v_head_dim=v,
                              softmax_scale=0.1)
        assert_close(got, want, torch.bfloat16, f"len={length}")

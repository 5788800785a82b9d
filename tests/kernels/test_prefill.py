"""kernels/prefill.py against the reference decoder (the oracle): the KV cache every layer leaves behind and the
last position's logits, on the tiny variant of every preset family and on HF tiny checkpoints with the odd
features (shared-expert gate, dense sliding window, clip_qkv), with prompts longer than the chunk and than the
sliding windows; through the graph backend's handles and the monokernel plan's buffers in every weight format;
grouped_mm and the per-expert loop; expert groups when the scratch is small; the Triton fp8 dequantization."""
import pytest
import torch

from kie_moe.kernels.prefill import Prefill, StoreWeights
from kie_moe.kernels.prefill_weights import dequant_fp8_rows, dequant_into
from kie_moe.kernels.weights import dequantize, random_weight
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.models.registry import LoadedModel, load_model
from kie_moe.models.synth import synth_weights_on_device
from kie_moe.synthetic import QuantizingStore
from tests.models.hf_tiny import make_checkpoint

PRESETS = ["qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "olmoe-1b-7b", "gpt-oss-20b", "gpt-oss-120b",
           "deepseek-v2-lite", "deepseek-v3", "llama-3.2-1b"]
HF_CASES = ["qwen3", "qwen2_moe", "mixtral_window", "olmoe"]
S, CHUNK = 40, 16            # 3 chunks, the last one ragged; longer than every test window (4..7)
TOL = dict(rtol=1e-4, atol=1e-4)
HAS_GROUPED = hasattr(torch, "_grouped_mm")


def prompt(spec, n=S, seed=1):
    return torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def caches_for(spec, T, dtype=torch.float32):
    out = []
    for lay in spec.layers:
        a = lay.attn
        if a.kind == "gqa":
            out.append((torch.zeros(T, a.num_kv_heads, a.head_dim, dtype=dtype),
                        torch.zeros(T, a.num_kv_heads, a.head_dim, dtype=dtype)))
        else:
            out.append(torch.zeros(T, a.kv_lora_rank + a.qk_rope_head_dim, dtype=dtype))
    return out


def reference(spec, store, ids):
    ref = ReferenceDecoder(spec, store)
    return ref.forward(ids)[-1], ref.cache


def assert_caches(spec, got, want, n, **tol):
    tol = tol or TOL
    for i, (g, w) in enumerate(zip(got, want)):
        if spec.layers[i].attn.kind == "mla":          # (latent, k_pe) rows
            torch.testing.assert_close(g[:n].float(), torch.cat(w, -1), **tol, msg=f"layer {i} MLA cache")
        else:
            torch.testing.assert_close(g[0][:n].float(), w[0], **tol, msg=f"layer {i} K")
            torch.testing.assert_close(g[1][:n].float(), w[1], **tol, msg=f"layer {i} V")


@pytest.fixture(scope="module")
def preset_model():
    made = {}

    def get(name):
        if name not in made:
            made[name] = synth_weights_on_device(name, "cpu", torch.float32, tiny=True)
        return made[name]
    return get


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    made = {}

    def get(case):
        if case not in made:
            d = tmp_path_factory.mktemp(f"prefill_{case}")
            make_checkpoint(case, str(d))
            made[case] = load_model(str(d))
        return made[case]
    return get


@pytest.mark.parametrize("grouped", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAS_GROUPED, reason="torch._grouped_mm missing"))], ids=["loop", "grouped_mm"])
@pytest.mark.parametrize("name", PRESETS)
def test_tiny_presets_match_reference(name, grouped, preset_model):
    spec, store = preset_model(name)
    ids = prompt(spec)
    want_logits, want_cache = reference(spec, store, ids)
    pf = Prefill(spec, StoreWeights(store), "cpu", torch.float32, chunk=CHUNK, grouped=grouped,
                 moe_chunk=CHUNK if grouped else None)          # grouped: MoE in chunks too
    caches = caches_for(spec, 64)
    logits = pf(ids, caches, logits=True)
    assert_caches(spec, caches, want_cache, S)
    torch.testing.assert_close(logits, want_logits, **TOL)
    if any(lay.moe is not None for lay in spec.layers):
        assert pf.stats["moe_path"] == ("grouped_mm" if grouped else "loop")


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_checkpoints_match_reference(case, hf_model):
    m = hf_model(case)
    ids = prompt(m.spec)
    want_logits, want_cache = reference(m.spec, m.weights, ids)
    caches = caches_for(m.spec, S)
    logits = Prefill(m.spec, StoreWeights(m.weights), "cpu", chunk=CHUNK)(ids, caches, logits=True)
    assert_caches(m.spec, caches, want_cache, S)
    torch.testing.assert_close(logits, want_logits, **TOL)


def test_single_chunk_and_single_token(preset_model):
    spec, store = preset_model("gpt-oss-20b")
    for n in (1, 5):
        ids = prompt(spec, n)
        want_logits, want_cache = reference(spec, store, ids)
        caches = caches_for(spec, 8)
        logits = Prefill(spec, StoreWeights(store), "cpu")(ids, caches, logits=True)
        assert_caches(spec, caches, want_cache, n)
        torch.testing.assert_close(logits, want_logits, **TOL)
    assert Prefill(spec, StoreWeights(store), "cpu")([], caches_for(spec, 8), logits=True) is None


def test_bf16_compute_stays_close(preset_model):
    """bf16 activations (what the GPU runs): same answer within bf16 noise, i.e. no further from the fp32 reference
    than twice the reference decoder's own bf16 run is (measured here: 0.78x of it)."""
    spec, store = preset_model("qwen3-30b-a3b")
    ids = prompt(spec)
    want_logits, _ = reference(spec, store, ids)
    bf16_ref = ReferenceDecoder(spec, store, "cpu", torch.bfloat16).forward(ids)[-1].float()
    noise = float((bf16_ref - want_logits).abs().max())
    caches = caches_for(spec, S, torch.bfloat16)
    logits = Prefill(spec, StoreWeights(store), "cpu", torch.bfloat16, chunk=CHUNK)(ids, caches, logits=True)
    assert logits.dtype == torch.float32
    err = float((logits - want_logits).abs().max())
    assert 0 < noise and err <= 2 * noise, (err, noise)


# ---- through the backends' own buffers ------------------------------------------------------------------------------

SCHEMES = ["bf16", "fp8", "fp8-block", "nvfp4", "mxfp4"]


def quantized_model(m, scheme):
    return m if scheme == "bf16" else LoadedModel(m.path, m.config, m.spec, QuantizingStore(m.weights, scheme))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", ["olmoe", "qwen2_moe"])
def test_graph_backend_buffers_every_format(case, scheme, hf_model):
    """GraphBackend.prefill (its HandleStore: codes + scales as loaded) == the reference over the same weights
    dequantized; a small scratch forces several expert groups per layer."""
    from kie_moe.kernels.graph import GraphBackend
    m = quantized_model(hf_model(case), scheme)
    be = GraphBackend(m, torch.device("cpu"))
    ids = prompt(m.spec)
    want_logits, want_cache = reference(m.spec, m.weights, ids)
    be.prefill(ids.tolist())
    assert_caches(m.spec, be.caches, want_cache, S)
    pf = Prefill.for_graph(be, chunk=CHUNK, scratch_bytes=4096)
    caches = caches_for(m.spec, S)
    torch.testing.assert_close(pf(ids, caches, logits=True), want_logits, **TOL)
    assert_caches(m.spec, caches, want_cache, S)
    if scheme != "bf16":
        assert pf.stats["expert_groups"] > 1


@pytest.mark.parametrize("case", ["gpt_oss", "deepseek_v3", "deepseek_v2", "qwen3"])
def test_graph_backend_buffers_families(case, hf_model):
    from kie_moe.kernels.graph import GraphBackend
    m = hf_model(case)
    be = GraphBackend(m, torch.device("cpu"))
    ids = prompt(m.spec)
    _, want_cache = reference(m.spec, m.weights, ids)
    be.prefill(ids.tolist())
    assert_caches(m.spec, be.caches, want_cache, S)


MONO = [("qwen2_moe", "bf16"), ("gpt_oss", "bf16"), ("deepseek_v2", "bf16"), ("qwen2_moe", "fp8"),
        ("qwen3_moe_norm", "fp8-block"), ("olmoe", "nvfp4"), ("olmoe", "mxfp4")]


@pytest.mark.parametrize("case,scheme", MONO, ids=[f"{c}-{s}" for c, s in MONO])
def test_monokernel_plan_buffers(case, scheme, hf_model):
    """MonokernelBackend.prefill (its arena and packed qarena, read in place) fills kv [L, 2, Hkv, T, Dh] (MLA:
    [L, T, r + rd]) with the reference's cache."""
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend
    m = quantized_model(hf_model(case), scheme)
    kw = {} if scheme == "bf16" else dict(quantized=m.weights.quantized_tensor)
    be = MonokernelBackend(m, "cpu", num_stages=0, **kw)
    assert be.prefill_mode == "torch"
    if scheme != "bf16":
        assert be.plan.qarena is not None
    ids = prompt(m.spec)
    want_logits, want_cache = reference(m.spec, m.weights, ids)
    be._ensure_kv(S + 1)
    be.prefill(ids.tolist())
    if be.dims.MLA:
        got = [be.kv[i] for i in range(m.spec.num_layers)]
    else:
        got = [(be.kv[i, 0].transpose(0, 1), be.kv[i, 1].transpose(0, 1)) for i in range(m.spec.num_layers)]
    assert_caches(m.spec, got, want_cache, S)
    logits = Prefill.for_plan(be.plan, chunk=CHUNK)(ids, caches_for(m.spec, S), logits=True)
    torch.testing.assert_close(logits, want_logits, **TOL)


# ---- dequantization ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "nvfp4", "mxfp4"])
def test_dequant_into_matches_the_oracle(fmt, monkeypatch):
    """dequant_into in bounded slices (shrunk here so that both paths cut: an expert stack one expert per slice, a
    300-row weight in 128-row slices with a ragged tail) equals one dequantize of the whole."""
    import kie_moe.kernels.prefill_weights as PW
    monkeypatch.setattr(PW, "_SLICE_ELEMS", 8192)
    h = random_weight(fmt, 131, 96, experts=3, seed=2)
    out = torch.empty(3, 131, 96)
    torch.testing.assert_close(dequant_into(h, out), dequantize(h), rtol=0, atol=0)
    one = random_weight(fmt, 300, 64, seed=3)
    torch.testing.assert_close(dequant_into(one, torch.empty(300, 64)), dequantize(one), rtol=0, atol=0)


def test_triton_fp8_rows_into_a_strided_half():
    """The GPU's one-pass fp8 dequantization (run by the interpreter): odd shapes, an expert stack, written into
    the up half of a fused [G, 2I, D] scratch, computed in fp32 like the oracle and rounded once (the GPU rounds
    to nearest even; the interpreter truncates, so bf16 is checked to one ulp, fp32 exactly)."""
    h = random_weight("fp8", 37, 70, experts=3, seed=4)
    fused = torch.zeros(3, 74, 70, dtype=torch.bfloat16)
    dequant_fp8_rows(h, fused[:, 37:])
    want = dequantize(h)
    torch.testing.assert_close(fused[:, 37:].float(), want, rtol=2 ** -7, atol=0)
    assert fused[:, :37].abs().sum() == 0
    torch.testing.assert_close(dequant_fp8_rows(h, torch.empty(3, 37, 70)), want, rtol=0, atol=0)
    one = random_weight("fp8", 19, 300, seed=5)
    torch.testing.assert_close(dequant_fp8_rows(one, torch.empty(19, 300)), dequantize(one), rtol=0, atol=0)


def test_grouped_mm_failure_falls_back_to_the_loop(preset_model, monkeypatch):
    """A torch build or device without the grouped GEMM kernel: warn once, loop over experts, same answer."""
    spec, store = preset_model("qwen3-30b-a3b")
    ids = prompt(spec)
    want_logits, want_cache = reference(spec, store, ids)

    def broken(*a, **k):
        raise RuntimeError("grouped gemm is not supported here")
    monkeypatch.setattr(torch, "_grouped_mm", broken, raising=False)
    pf = Prefill(spec, StoreWeights(store), "cpu", chunk=CHUNK, grouped=True)
    caches = caches_for(spec, S)
    with pytest.warns(UserWarning, match="looping over experts"):
        logits = pf(ids, caches, logits=True)
    assert not pf.grouped and pf.stats["moe_path"] == "loop" and "not supported" in pf.stats["grouped_mm_error"]
    assert_caches(spec, caches, want_cache, S)
    torch.testing.assert_close(logits, want_logits, **TOL)

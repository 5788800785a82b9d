"""The graph backend's decode step (the same launches it captures on the GPU) run eagerly through Triton's
interpreter: greedy tokens equal the reference decoder's on tiny checkpoints of several families."""
import pytest
import torch

from kie_moe.kernels.graph import GraphBackend
from kie_moe.kernels.weights import dequantize
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.models.registry import load_model
from kie_moe.models.spec import canonical
from kie_moe.sampling import SamplingParams
from tests.models.hf_tiny import make_checkpoint

STEPS = 3   # greedy steps per decode run: each step feeds the last token back; the interpreter's cost per step


def ref_greedy(m, prompt, n):
    """The reference decoder's n greedy tokens and the logits that chose the last one (what be.logits holds)."""
    dec = ReferenceDecoder(m.spec, m.weights)
    logits = dec.forward(torch.tensor(prompt))[-1]
    out = []
    for i in range(n):
        t = int(torch.argmax(logits))
        out.append(t)
        if i + 1 < n:
            logits = dec.forward(torch.tensor([t]))[-1]
    return out, logits.float()


def assert_logits_close(got, want, rel=1e-4):
    """Both fp32 (the interpreter runs the step in fp32): equal up to reassociation, relative to the largest logit;
    a wrong bias, scale or window moves logits far more than that even where the argmax survives."""
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * want.abs().max())


def assert_greedy_matches_reference(case, tmp_path):
    """The graph backend on a tiny `case` checkpoint (CPU, interpreter): the reference decoder's STEPS greedy tokens
    and last logits."""
    make_checkpoint(case, str(tmp_path))
    m = load_model(str(tmp_path))
    prompt = list(range(7, 15))
    want, want_logits = ref_greedy(m, prompt, STEPS)
    be = GraphBackend(m, torch.device("cpu"))
    got = list(be.generate(prompt, SamplingParams(max_new_tokens=STEPS, ignore_eos=True), set()))
    assert got == want
    assert_logits_close(be.logits.float(), want_logits)


@pytest.mark.parametrize("case", ["qwen2_moe", "gpt_oss", "deepseek_v3"])
def test_graph_backend_greedy_matches_reference(case, tmp_path):
    assert_greedy_matches_reference(case, tmp_path)


@pytest.mark.parametrize("case", ["qwen2_moe", "gpt_oss"])
def test_router_xn_and_glu_pair_in_the_decode_step(case, tmp_path, monkeypatch):
    """KIE_ROUTER_XN (off by default) + KIE_GLU_PAIR (the default): the float experts read the router's normed x and
    stream gate / up in one loop, a float shared expert too (Qwen2-MoE: with its sigmoid gate, which keeps its own
    norm; gpt-oss: biases, interleaved gate / up, sinks); greedy tokens and last logits of the reference decoder."""
    import kie_moe.kernels.gemv as GV
    import kie_moe.kernels.graph as G
    import kie_moe.kernels.moe as M
    monkeypatch.setattr(G, "ROUTER_XN", True)
    monkeypatch.setattr(GV, "GLU_PAIR", True)
    seen = []
    route = M.route
    monkeypatch.setattr(G, "route", lambda *a, **k: seen.append(k.get("xn_out") is not None) or route(*a, **k))
    assert_greedy_matches_reference(case, tmp_path)
    assert seen and all(seen)


PROMPT = list(range(7, 15))


def _tiny(case, fmt, tmp_path, experts_only=False):
    """A tiny `case` checkpoint, quantized on load to scheme `fmt` (None: as saved); experts_only: the routed
    experts only (gpt-oss's released layout: float attention, mxfp4 experts)."""
    make_checkpoint(case, str(tmp_path))
    m = load_model(str(tmp_path))
    if fmt is None:
        return m
    from kie_moe.models.registry import LoadedModel
    from kie_moe.synthetic import QuantizingStore

    class ExpertsOnly(QuantizingStore):
        def _quantize(self, n, w):
            return super()._quantize(n, w) if ".moe.experts." in n else None
    return LoadedModel(m.path, m.config, m.spec, (ExpertsOnly if experts_only else QuantizingStore)(m.weights, fmt))


def _greedy(m):
    """The graph backend's STEPS greedy tokens from PROMPT (CPU, interpreter) and the logits behind the last."""
    be = GraphBackend(m, torch.device("cpu"))
    return (list(be.generate(PROMPT, SamplingParams(max_new_tokens=STEPS, ignore_eos=True), set())),
            be.logits.float().clone())


@pytest.mark.parametrize("case,fmt", [("qwen3_moe_mixed", None), ("deepseek_v3", None), ("gpt_oss", None),
                                      ("qwen2_moe", "nvfp4")])
def test_top_k_picked_in_the_expert_launch_in_the_decode_step(case, fmt, tmp_path, monkeypatch):
    """KIE_SELECT_IN_EXPERTS (on by default): the router launch leaves partial logits and the experts' GLU launch
    picks the top-k (route(defer=True), moe_experts(select=)) in every MoE layer: the same tokens and last logits as
    the one-launch router, and the reference decoder's greedy tokens (DeepSeek-V3: sigmoid, groups, correction bias,
    MLA; gpt-oss: router bias, softmax over the top-k; Qwen2-MoE nvfp4: the fp4 experts' x8 from the same router
    launch, a shared expert)."""
    import kie_moe.kernels.graph as G
    m = _tiny(case, fmt, tmp_path)
    seen = []
    experts = G.moe_experts
    monkeypatch.setattr(G, "moe_experts", lambda *a, **k: seen.append(k.get("select") is not None) or experts(*a, **k))
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(G, "SELECT_IN_EXPERTS", on)
        seen.clear()
        runs[on] = _greedy(m)
        assert seen and all(s == on for s in seen)
    want, want_logits = ref_greedy(m, PROMPT, STEPS)
    assert runs[True][0] == runs[False][0] == want
    assert_logits_close(runs[True][1], runs[False][1], rel=1e-6)
    assert_logits_close(runs[True][1], want_logits)


@pytest.mark.parametrize("case,fmt,experts_only", [
    ("qwen3_moe_norm", "fp8", False), ("deepseek_v3", None, False), ("qwen2_moe", "fp8-block", False),
    ("gpt_oss", "mxfp4", True), ("qwen3_moe_norm", "nvfp4", True)])
def test_router_folded_into_o_proj_in_the_decode_step(case, fmt, experts_only, tmp_path, monkeypatch):
    """KIE_ROUTER_FOLD (on by default; 0 keeps the router launch): o_proj's launch writes the router's partial logits
    (moe.gemv_route) and the experts' GLU launch scales them and picks the top-k: the reference decoder's greedy
    tokens, and last logits equal to the router launch's path up to reassociation (Qwen3-MoE fp8 o_proj and experts,
    renormalised top-k; DeepSeek-V3 MLA o_proj, sigmoid groups, correction bias; Qwen2-MoE fp8-block experts (the
    tiny o_proj falls back to per-row fp8) and a shared expert with its gate; fp4 experts behind float attention,
    o_proj's launch writing their x8 unscaled: gpt-oss mxfp4 (o_proj's bias and its logit term, a router bias,
    softmax over the top-k, sinks), Qwen3-MoE nvfp4)."""
    import kie_moe.kernels.graph as G
    m = _tiny(case, fmt, tmp_path, experts_only)
    seen = []
    fold = G.gemv_route
    monkeypatch.setattr(G, "gemv_route", lambda *a, **k: seen.append(1) or fold(*a, **k))
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(G, "ROUTER_FOLD", "1" if on else "0")
        seen.clear()
        runs[on] = _greedy(m)
        moe_layers = sum(lay.moe is not None for lay in m.spec.layers)
        assert len(seen) == (STEPS * moe_layers if on else 0)
    want, want_logits = ref_greedy(m, PROMPT, STEPS)
    assert runs[True][0] == runs[False][0] == want
    assert_logits_close(runs[True][1], runs[False][1], rel=1e-5)
    assert_logits_close(runs[True][1], want_logits)


@pytest.mark.parametrize("case,fmt", [("gpt_oss", "mxfp4"), ("qwen3_moe_norm", "nvfp4")])
def test_router_fold_keeps_the_router_launch_where_it_cannot_fold(case, fmt, tmp_path, monkeypatch):
    """KIE_ROUTER_FOLD on, but fp4 experts (and fp4 o_proj) read the router's x8: no layer folds, so the step keeps
    its router launches. A value the switch does not know is named."""
    import kie_moe.kernels.graph as G
    from kie_moe.models.errors import InputError
    m = _tiny(case, fmt, tmp_path)
    monkeypatch.setattr(G, "ROUTER_FOLD", "1")
    be = GraphBackend(m, torch.device("cpu"))
    moe = [L for L in be.layers if L["spec"].moe is not None]
    assert moe and not any("router_fold" in L for L in moe)
    monkeypatch.setattr(G, "ROUTER_FOLD", "yes")
    with pytest.raises(InputError, match="KIE_ROUTER_FOLD='yes': expected 0, 1 or fp32"):
        GraphBackend(m, torch.device("cpu"))


@pytest.mark.parametrize("case", ["qwen3", "gpt_oss"])
def test_fused_rope_attention_step_equals_the_two_launches(case, tmp_path, monkeypatch):
    """KIE_FUSED_ROPE_ATTN's path (attention.rope_gqa_decode) in the whole decode step: the same tokens and the
    same last-step logits as rope_append + gqa_decode, and the reference decoder's greedy tokens (Qwen3: per-head
    q/k norm; gpt-oss: sinks and sliding windows)."""
    import kie_moe.kernels.graph as G
    make_checkpoint(case, str(tmp_path))
    m = load_model(str(tmp_path))
    prompt = list(range(7, 15))
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(G, "FUSED_ROPE_ATTN", fused)
        be = GraphBackend(m, torch.device("cpu"))
        runs[fused] = (list(be.generate(prompt, SamplingParams(max_new_tokens=STEPS, ignore_eos=True), set())),
                       be.logits.float().clone())
    want, want_logits = ref_greedy(m, prompt, STEPS)
    assert runs[True][0] == runs[False][0] == want
    assert torch.equal(runs[True][1], runs[False][1])
    assert_logits_close(runs[True][1], want_logits)


@pytest.mark.parametrize("case", ["qwen3_moe_mixed", "llama"])
def test_step_tail_in_one_launch_equals_the_torch_tail(case, tmp_path, monkeypatch):
    """KIE_GRAPH_STEP_TAIL (sampling.next_step_inputs + the host ring): the same greedy tokens and last-step logits
    as the torch tail it replaces, over two requests on one backend (the second starts from generate's own
    embedding of its last prompt token), and the reference decoder's tokens."""
    import kie_moe.kernels.graph as G
    make_checkpoint(case, str(tmp_path))
    m = load_model(str(tmp_path))
    prompts = [list(range(7, 15)), list(range(30, 35))]
    runs = {}
    for tail in (False, True):
        monkeypatch.setattr(G, "STEP_TAIL", tail)
        be = GraphBackend(m, torch.device("cpu"))
        runs[tail] = [(list(be.generate(pr, SamplingParams(max_new_tokens=STEPS, ignore_eos=True), set())),
                       be.logits.float().clone()) for pr in prompts]
    for (toks, logits), (toks0, logits0), pr in zip(runs[True], runs[False], prompts):
        assert toks == toks0 == ref_greedy(m, pr, STEPS)[0]
        assert torch.equal(logits, logits0)


@pytest.mark.parametrize("fmt", ["nvfp4"])  # mxfp4's packed path: tests/kernels/test_fp4_mma.py
def test_quantized_lm_head_packed_for_the_tensor_cores(fmt, tmp_path, monkeypatch):
    """A quantized lm_head big enough for gemv()'s tensor-core dispatch (threshold lowered to the tiny vocab) is
    re-laid once (packing "mma"): greedy tokens equal the reference decoder's on the same (dequantized) weights,
    and the last logits are those of the CUDA-core tile on the checkpoint bytes (KIE_GEMV_MMA=0) within the mma
    path's one fp16 rounding of the normed input (fp4_mma's xh: 2^-11 relative)."""
    import kie_moe.kernels.gemv as GV
    from kie_moe.models.registry import LoadedModel
    from kie_moe.synthetic import QuantizingStore
    make_checkpoint("qwen3", str(tmp_path))
    m0 = load_model(str(tmp_path))
    m = LoadedModel(m0.path, m0.config, m0.spec, QuantizingStore(m0.weights, fmt, lm_head=True))
    monkeypatch.setattr(GV, "MMA_MIN_ROWS", 64)
    prompt = list(range(7, 15))
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(GV, "MMA_GEMV", on)
        be = GraphBackend(m, torch.device("cpu"))
        assert be.lm_head.fmt == fmt and be.lm_head.packing == ("mma" if on else "checkpoint")
        runs[on] = (list(be.generate(prompt, SamplingParams(max_new_tokens=STEPS, ignore_eos=True), set())),
                    be.logits.float().clone())
    want, want_logits = ref_greedy(m, prompt, STEPS)
    assert runs[True][0] == runs[False][0] == want
    assert_logits_close(runs[False][1], want_logits)
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=0, atol=2e-3 * runs[False][1].abs().max())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_routed_experts_on_the_tensor_cores_in_the_decode_step(device, tmp_path, monkeypatch):
    """Experts big enough for moe.MMA_EXPERT_MIN_BYTES (lowered to the tiny model) run fp4_mma_experts inside the
    step, beside the x8 the router hands over (unused there): the reference decoder's greedy tokens, and last logits
    within the tensor-core path's fp16 rounding of the normed x and of h (2^-11 relative each). On the GPU: the
    same inside the captured CUDA graph (PDL on), the step in fp32 as the parity tests run it."""
    import kie_moe.kernels.fp4_mma_experts as FE
    import kie_moe.kernels.moe as M
    from kie_moe.models.registry import LoadedModel
    from kie_moe.synthetic import QuantizingStore
    make_checkpoint("qwen2_moe", str(tmp_path))
    m0 = load_model(str(tmp_path))
    m = LoadedModel(m0.path, m0.config, m0.spec, QuantizingStore(m0.weights, "nvfp4"))
    monkeypatch.setattr(M, "MMA_EXPERT_MIN_BYTES", {"nvfp4": 0})
    launched = []
    mma = FE.moe_experts_mma
    monkeypatch.setattr(FE, "moe_experts_mma", lambda *a, **k: launched.append(1) or mma(*a, **k))
    prompt = list(range(7, 15))
    be = GraphBackend(m, torch.device(device), dtype=torch.float32)
    got = list(be.generate(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True), set()))
    n_moe = sum(lay.moe is not None for lay in be.spec.layers)
    # a step per generated token, every MoE layer (CUDA: step 0 eagerly, then once more into the graph it replays)
    assert n_moe > 0 and len(launched) == (3 if device == "cpu" else 2) * n_moe
    want, want_logits = ref_greedy(m, prompt, 3)
    assert got == want
    assert_logits_close(be.logits.float().cpu(), want_logits, rel=2e-3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_router_hands_the_tensor_core_experts_their_xh(device, tmp_path, monkeypatch):
    """KIE_ROUTER_XH: with the experts on the tensor cores and no fp4 shared expert (qwen3-moe), the router launch
    writes their fp16 xh (route(xh_out=)) and no prepare_xh runs in the step; the reference decoder's greedy tokens
    and last logits within the tensor-core path's fp16 rounding, as without it. KIE_PACK_EXPERTS: those experts are
    held in packing "mma" (stacks and each expert's view; the prefill dequantizes them), the same weights as the
    checkpoint bytes a backend without it holds."""
    import kie_moe.kernels.fp4_mma as FM
    import kie_moe.kernels.graph as G
    import kie_moe.kernels.moe as M
    from kie_moe.models.registry import LoadedModel
    from kie_moe.synthetic import QuantizingStore
    from tests.models import hf_tiny
    mt, over = hf_tiny.CASES["qwen3_moe_norm"]   # experts 32 wide: rows the tensor-core loop reads (in % 32 == 0)
    monkeypatch.setitem(hf_tiny.CASES, "qwen3_moe_i32", (mt, {**over, "moe_intermediate_size": 32}))
    make_checkpoint("qwen3_moe_i32", str(tmp_path))
    m0 = load_model(str(tmp_path))
    m = LoadedModel(m0.path, m0.config, m0.spec, QuantizingStore(m0.weights, "nvfp4"))
    monkeypatch.setattr(M, "MMA_EXPERT_MIN_BYTES", {"nvfp4": 0})
    monkeypatch.setattr(G, "ROUTER_XH", True)
    monkeypatch.setattr(G, "PACK_EXPERTS", False)
    plain = GraphBackend(m, torch.device(device), dtype=torch.float32)
    monkeypatch.setattr(G, "PACK_EXPERTS", True)
    made = []
    real = FM.prepare_xh
    monkeypatch.setattr(FM, "prepare_xh", lambda *a, **k: made.append(1) or real(*a, **k))
    prompt = list(range(7, 15))
    be = GraphBackend(m, torch.device(device), dtype=torch.float32)
    assert be.xh is not None
    moe = [i for i, lay in enumerate(m.spec.layers) if lay.moe is not None]
    for i in moe:
        for part in ("gate", "up", "down"):
            st, old = be.layers[i]["e_" + part], plain.layers[i]["e_" + part]
            assert (st.packing, old.packing) == ("mma", "checkpoint")
            assert st is be.W.h[canonical(i, f"moe.{part}_stack")]
            assert be.W.h[canonical(i, f"moe.experts.1.{part}")].packing == "mma"
            assert torch.equal(dequantize(st), dequantize(old)) and not torch.equal(st.weight, old.weight)
    del plain
    got = list(be.generate(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True), set()))
    assert made == []
    want, want_logits = ref_greedy(m, prompt, 3)
    assert got == want
    assert_logits_close(be.logits.float().cpu(), want_logits, rel=2e-3)


def _parts(fmt, sizes, K, shared_global=True, device="cpu"):
    import dataclasses

    from kie_moe.kernels.weights import random_weight
    hs = [random_weight(fmt, n, K, seed=7 + i, device=device) for i, n in enumerate(sizes)]
    if fmt == "nvfp4" and shared_global:
        hs = [dataclasses.replace(h, global_scale=hs[0].global_scale) for h in hs]
    return hs


@pytest.mark.parametrize("fmt,sizes,K", [("bf16", (40, 24, 24), 64), ("fp8", (40, 24, 24), 64),
                                         ("fp8_block", (256, 128, 128), 192), ("nvfp4", (40, 24, 24), 96),
                                         ("mxfp4", (40, 8, 8), 96)])
def test_fused_qkv_is_the_parts_concatenated(fmt, sizes, K, device="cpu"):
    """_fuse_rows: the fused handle dequantizes to the parts' rows exactly, and its one GEMV (norm and bias fused)
    gives the three reference GEMVs."""
    from kie_moe.kernels.gemv import gemv, gemv_ref
    from kie_moe.kernels.graph import _fuse_rows
    from kie_moe.kernels.weights import dequantize
    from tests.kernels.helpers import assert_close
    hs = _parts(fmt, sizes, K, device=device)
    g = torch.Generator().manual_seed(3)
    biases = [torch.randn(n, generator=g).to(device) for n in sizes]
    h, b = _fuse_rows(hs, biases)
    assert h is not None and h.fmt == fmt and h.out_features == sum(sizes)
    assert torch.equal(dequantize(h), torch.cat([dequantize(p) for p in hs]))
    x, nw = torch.randn(K, generator=g).to(device), (torch.rand(K, generator=g) + 0.5).to(device)
    y = gemv(x, h, bias=b, norm_weight=nw, eps=1e-6)
    want = torch.cat([gemv_ref(x, p, bias=bb, norm_weight=nw, eps=1e-6, out_dtype=torch.float32)
                      for p, bb in zip(hs, biases)])
    assert_close(y, want, what=f"fused q/k/v {fmt}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_block", "nvfp4", "mxfp4"])
def test_fused_qkv_at_qwen3_size_cuda(fmt):
    """The same at qwen3-30b-a3b's q/k/v ([4096 + 512 + 512] x 2048) on the GPU: the tiny checkpoints of the decode
    tests never fuse fp8_block (parts under 128 rows)."""
    test_fused_qkv_is_the_parts_concatenated(fmt, (4096, 512, 512), 2048, device="cuda")


def test_fused_qkv_refusals(monkeypatch):
    """Parts that cannot be concatenated stay three launches: nvfp4 with different global scales, fp8_block parts
    that are not whole 128-row scale blocks, mixed formats; KIE_FUSE_QKV=0 keeps only float and fp8 fused."""
    import kie_moe.kernels.graph as G
    none = [None, None, None]
    assert G._fuse_rows(_parts("nvfp4", (40, 24, 24), 96, shared_global=False), none) == (None, None)
    assert G._fuse_rows(_parts("fp8_block", (256, 64, 64), 128), none) == (None, None)
    assert G._fuse_rows(_parts("nvfp4", (32,), 64) + _parts("mxfp4", (32, 32), 64), none) == (None, None)
    monkeypatch.setattr(G, "FUSE_QKV", False)
    assert G._fuse_rows(_parts("mxfp4", (40, 8, 8), 96), none) == (None, None)
    assert G._fuse_rows(_parts("fp8", (40, 24, 24), 64), none)[0] is not None


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_qkv_fused_in_the_decode_step(fmt, tmp_path, monkeypatch):
    """A tiny Qwen3 quantized in memory (QuantizingStore: nvfp4 partners share one global scale, as kie convert
    writes them): the step runs q/k/v as one fused launch; the greedy tokens equal the reference decoder's, and
    those of three launches sharing one x8 (parts that cannot fuse) and of three launches with an x8 each
    (KIE_FUSE_QKV=0); last logits equal within fp32 reassociation."""
    import kie_moe.kernels.graph as G
    from kie_moe.models.registry import LoadedModel
    from kie_moe.synthetic import QuantizingStore
    make_checkpoint("qwen3", str(tmp_path))
    m0 = load_model(str(tmp_path))
    m = LoadedModel(m0.path, m0.config, m0.spec, QuantizingStore(m0.weights, fmt))
    prompt = list(range(7, 15))
    fuse_rows, prepare_x8 = G._fuse_rows, G.prepare_x8
    shared = []
    monkeypatch.setattr(G, "prepare_x8", lambda *a, **k: shared.append(1) or prepare_x8(*a, **k))
    runs = {}
    for mode in ("fused", "shared x8", "x8 each"):
        monkeypatch.setattr(G, "FUSE_QKV", mode != "x8 each")
        monkeypatch.setattr(G, "_fuse_rows", (lambda hs, bs: (None, None)) if mode == "shared x8" else fuse_rows)
        shared.clear()
        be = GraphBackend(m, torch.device("cpu"))
        assert all((L["qkv"] is not None) == (mode == "fused") for L in be.layers)
        assert all(L["qkv"].fmt == fmt for L in be.layers if mode == "fused")
        if mode == "fused":   # the parts (what the prefill reads) are row views of the fused copy, not a second one
            from kie_moe.models.spec import canonical
            for i, L in enumerate(be.layers):
                for n in ("q", "k", "v"):
                    part = be.W.h[canonical(i, f"attn.{n}")]
                    assert part.weight.untyped_storage().data_ptr() == L["qkv"].weight.untyped_storage().data_ptr()
        runs[mode] = (list(be.generate(prompt, SamplingParams(max_new_tokens=STEPS, ignore_eos=True), set())),
                      be.logits.float().clone())
        assert len(shared) == (STEPS * len(be.layers) if mode == "shared x8" else 0), mode   # one x8 per layer
    want = runs["x8 each"]
    ref_tokens, ref_logits = ref_greedy(m, prompt, STEPS)
    assert runs["fused"][0] == runs["shared x8"][0] == want[0] == ref_tokens
    assert_logits_close(want[1], ref_logits)
    for mode in ("fused", "shared x8"):
        torch.testing.assert_close(runs[mode][1], want[1], rtol=1e-4, atol=1e-4 * want[1].abs().max())


@pytest.mark.parametrize("case,fmt", [("qwen2_moe", "nvfp4"), ("gpt_oss", "mxfp4"), ("qwen3", "nvfp4"),
                                      ("deepseek_v3", "mxfp4")])
def test_fp4_inputs_handed_over_as_x8(case, fmt, tmp_path, monkeypatch):
    """KIE_SHARE_X8: fp4 routed experts (and an fp4 shared expert's GLU) read the x8 the router launch writes, an
    fp4 down projection (dense MLP, shared expert) reads its GLU's output written as x8, an fp4 o_proj the
    attention output written as x8: one prepare_x8 launch less for each; the same greedy tokens as the reference decoder and as KIE_SHARE_X8=0 (last logits within fp32
    reassociation)."""
    import kie_moe.kernels.gemv as GV
    import kie_moe.kernels.graph as G
    from kie_moe.models.registry import LoadedModel
    from kie_moe.synthetic import QuantizingStore
    make_checkpoint(case, str(tmp_path))
    m0 = load_model(str(tmp_path))
    m = LoadedModel(m0.path, m0.config, m0.spec, QuantizingStore(m0.weights, fmt))
    prompt = list(range(7, 15))
    made = []
    prepare_x8 = GV.prepare_x8
    monkeypatch.setattr(GV, "prepare_x8", lambda *a, **k: made.append(1) or prepare_x8(*a, **k))
    runs = {}
    for on in (True, False):
        monkeypatch.setattr(G, "SHARE_X8", on)
        be = GraphBackend(m, torch.device("cpu"))
        made.clear()
        runs[on] = (list(be.generate(prompt, SamplingParams(max_new_tokens=STEPS, ignore_eos=True), set())),
                    be.logits.float().clone(), len(made))

    def fp4(L, n):
        return n in L and G.is_fp4(L[n].fmt)

    per_step = 0
    for L, lay in zip(be.layers, be.spec.layers):
        per_step += lay.attn.kind == "gqa" and fp4(L, "o")
        if lay.moe is None:
            per_step += fp4(L, "m_down")
        else:
            per_step += fp4(L, "e_gate") + (fp4(L, "s_gate") and fp4(L, "e_gate")) + fp4(L, "s_down")
    assert per_step > 0
    assert runs[False][2] - runs[True][2] == STEPS * per_step
    want, want_logits = ref_greedy(m, prompt, STEPS)
    assert runs[True][0] == runs[False][0] == want
    assert_logits_close(runs[False][1], want_logits)
    assert_logits_close(runs[True][1], runs[False][1])


def test_non_finite_logits_stop_the_graph_backend(tmp_path):
    """NaN logits reach the host as the sampler's -1 (never as a token: argmax over NaN would be some id, maybe an
    EOS) and the engine stops with the reference backend's error, while the step after still embeds a valid id."""
    import glob
    from safetensors.torch import load_file, save_file
    from kie_moe.engine import Engine
    from kie_moe.models.errors import CheckpointError
    make_checkpoint("qwen3", str(tmp_path))
    f = glob.glob(f"{tmp_path}/*.safetensors")[0]
    t = load_file(f)
    t["model.norm.weight"] = torch.full_like(t["model.norm.weight"], float("nan"))
    save_file(t, f, metadata={"format": "pt"})
    m = load_model(str(tmp_path))
    be = GraphBackend(m, torch.device("cpu"))
    eng = Engine(str(tmp_path), device="cpu", model=m, backend_impl=be)
    with pytest.raises(CheckpointError, match="not finite at step 0"):
        list(eng.stream(list(range(7, 15)), SamplingParams(max_new_tokens=3, ignore_eos=True)))
    assert int(be.sampler.out[0]) == -1 and int(be.token[0]) == 0


def test_unseeded_sampling_draws_a_seed_per_request(tmp_path):
    """Without a seed each request gets its own Philox key (the backend used seed 0 for every unseeded request, so
    two users got the same 'random' text); with one, that seed. Read from the sampler after the first token (the
    interpreter runs a step in seconds: no need for whole generations)."""
    make_checkpoint("qwen3", str(tmp_path))
    be = GraphBackend(load_model(str(tmp_path)), torch.device("cpu"))
    prompt = list(range(7, 15))

    def key(seed):
        gen = be.generate(prompt, SamplingParams(max_new_tokens=4, temperature=2.0, seed=seed, ignore_eos=True), set())
        next(gen)
        gen.close()
        return int(be.sampler.rng[0])

    assert key(None) != key(None)
    assert key(11) == 11


def test_top_p_fallbacks_are_counted_and_reported(tmp_path, capsys):
    """A top-p nucleus wider than the GPU sampler's candidates (temperature 50 flattens a tiny vocab: the nucleus
    of 0.99 holds most of it, over the 64 candidates) is drawn as plain temperature sampling: `kie generate` counts
    every such draw (sampling_fallbacks in --json, a note on stderr), as many as the reference filter's nucleus
    sizes say; a top-k 5 request is exact (no note); the count is per request."""
    import json

    from kie_moe import cli
    from kie_moe.kernels.sampling import sample_probs_ref
    make_checkpoint("qwen3", str(tmp_path))
    base = ["generate", str(tmp_path), "--device", "cpu", "--backend", "graph", "--prompt-ids", "7,8,9",
            "--ignore-eos", "--json", "--temperature", "50", "--seed", "3"]
    assert cli.main(base + ["--top-p", "0.99", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    res = json.loads(out.strip().splitlines()[-1])
    m = load_model(str(tmp_path))
    dec = ReferenceDecoder(m.spec, m.weights)
    wide = 0
    for t in [None] + res["token_ids"][:-1]:            # the logits each draw was made from (teacher-forced)
        logits = dec.forward(torch.tensor([7, 8, 9] if t is None else [t]))[-1].float()
        wide += int((sample_probs_ref(logits, 50.0, 0, 0.99) > 0).sum()) > 64
    assert wide == 2 and res["sampling_fallbacks"] == 2
    assert "2 of 2 draws were plain temperature samples" in err
    assert cli.main(base + ["--top-k", "5", "--max-new-tokens", "1"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["sampling_fallbacks"] == 0 and "note" not in err

"""The monokernel on a real GPU (`-m gpu`; KIE_GPU_TESTS=1 so Triton compiles instead of interpreting).

Parity is checked against the fp32 reference decoder on the same weights, with the kernel's KV cache and prefill
in fp32 too, so the only difference left is summation order: every kernel token must be the reference's argmax
given the same history (teacher forcing), except at a near tie, and free-running greedy tokens must match for
the first 8+ steps. Real sizes use random weights drawn straight into the plan's arena (full llama-3.2-1b; qwen3-
30b-a3b, gpt-oss-20b and deepseek-v2-lite (MLA) at full width, 3-4 layers, so the fp32 reference fits beside
them)."""
import time

import pytest
import torch

from kie_moe.kernels.monokernel import plan as P
from kie_moe.kernels.monokernel.runtime import ArenaStore, MonokernelBackend
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.sampling import SamplingParams

from .test_monokernel import GREEDY, PROMPT, prefill_within_bf16_noise

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def teacher_forced(ref, prompt, tokens):
    """Reference logits [len(tokens), V] (fp32) for each generated position given the kernel's history."""
    ref.reset()
    out = [ref.forward(torch.tensor(prompt))[-1]]
    for t in tokens[:-1]:
        out.append(ref.forward(torch.tensor([t]))[-1])
    ref.reset()
    return torch.stack(out).float()


def free_running(ref, prompt, n):
    ref.reset()
    logits, toks = ref.forward(torch.tensor(prompt))[-1], []
    for _ in range(n):
        toks.append(int(logits.argmax()))
        logits = ref.forward(torch.tensor([toks[-1]]))[-1]
    ref.reset()
    return toks


def assert_parity(be, ref, prompt, got, min_prefix=8, tie=1e-3):
    logits = teacher_forced(ref, prompt, got)
    for s, tok in enumerate(got):
        best = int(logits[s].argmax())
        gap = float(logits[s, best] - logits[s, tok])
        assert tok == best or gap <= tie * float(logits[s].abs().max()), \
            f"step {s}: got {tok}, argmax {best}, gap {gap}"
    want = free_running(ref, prompt, len(got))
    prefix = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
    assert prefix >= min(min_prefix, len(got)), f"greedy tokens diverge at step {prefix}: {got} vs {want}"
    last = logits[-1]
    for tile, (r0, n) in enumerate(be.plan.op_rows["lm"]):
        want_max = float(last[r0:r0 + n].max())
        assert abs(float(be.pv[tile]) - want_max) <= 2e-3 * (1 + abs(want_max)), f"LM tile {tile}"


@pytest.mark.parametrize("case", [c for c, _ in GREEDY])
def test_tiny_families_match_reference(case, tiny_model):
    m = tiny_model(case, torch.bfloat16)
    ref = ReferenceDecoder(m.spec, m.weights, CUDA, torch.float32)
    be = MonokernelBackend(m, CUDA, kv_dtype=torch.float32)
    be._prefill_decoder = ref                     # fp32 prefill: the same math as the reference
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=24, ignore_eos=True), set()))
    assert len(got) == 24
    assert_parity(be, ref, PROMPT, got)


def real_size(arch, layers=None, fmt=None):
    spec = P.preset_spec(arch, layers)
    plan = P.build_plan(spec, None, CUDA, random_seed=1,
                        formats={"attn": fmt, "mlp": fmt, "exp": fmt} if fmt else None)
    ref = ReferenceDecoder(spec, ArenaStore(plan), CUDA, torch.float32)
    be = MonokernelBackend(None, CUDA, plan=plan, kv_dtype=torch.float32)
    be._prefill_decoder = ref
    return be, ref


@pytest.mark.parametrize("arch,layers", [("llama-3.2-1b", None), ("qwen3-30b-a3b", 4), ("gpt-oss-20b", 4),
                                         ("deepseek-v2-lite", 3)])
def test_real_size_parity(arch, layers):
    be, ref = real_size(arch, layers)
    prompt = [(37 * i + 11) % be.spec.vocab_size for i in range(24)]
    got = list(be.generate(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True), set()))
    assert len(got) == 16
    assert_parity(be, ref, prompt, got)
    be.n_splits_override = 4                     # attention split over the sequence at real sizes too
    got4 = list(be.generate(prompt, SamplingParams(max_new_tokens=16, ignore_eos=True), set()))
    assert_parity(be, ref, prompt, got4)


def parity_over_two_launches(be, ref):
    """12 tokens of a 20-token prompt, twice (state a launch must restart, or leave clean, shows in the second)."""
    prompt = [(41 * i + 3) % be.spec.vocab_size for i in range(20)]
    for _ in range(2):
        got = list(be.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), set()))
        assert_parity(be, ref, prompt, got)


@pytest.mark.parametrize("arch,fmt", [("qwen3-30b-a3b", None), ("qwen3-30b-a3b", "nvfp4"), ("gpt-oss-20b", "mxfp4")])
def test_real_size_router_inside_o_proj(arch, fmt, monkeypatch):
    """KIE_ROUTE_IN_O=1 (plan.route_in_o) on the GPU: the o_proj tiles' integer atomics into the router's
    accumulators (ops.route_partial) and the expert tasks' top-k from them, at real widths (128 / 32 experts, the
    router bias of gpt-oss), over two launches."""
    monkeypatch.setenv("KIE_ROUTE_IN_O", "1")
    be, ref = real_size(arch, 4, fmt)
    assert be.route_in_o and not (be.tasks(1)[:, P.F_OP] == P.OP_ROUTER).any()
    parity_over_two_launches(be, ref)
    assert not be.racc.any()


@pytest.mark.parametrize("arch,fmt,bd_ns", [("qwen3-30b-a3b", "fp8", "1024,3"), ("qwen3-30b-a3b", "fp8", "512,0"),
                                           ("qwen3-30b-a3b", None, "1024,3"), ("gpt-oss-20b", None, "1024,3")])
def test_real_size_fused_down(arch, fmt, bd_ns, monkeypatch):
    """KIE_FUSE_DOWN=1 (plan.fused_down) on the GPU: each expert gate / up task adds its h columns' share of the
    down projection into x with fp32 atomics (fused_down.py) at real widths: 16-byte tiles of e4m3 codes with row
    factors, bf16 arena weights, gpt-oss's down bias, both tile walks (KIE_FD_BD, KIE_FD_NS), over two launches
    (the router accumulators' parity rows)."""
    bd, ns = bd_ns.split(",")
    monkeypatch.setenv("KIE_FUSE_DOWN", "1")
    monkeypatch.setenv("KIE_FD_BD", bd)
    monkeypatch.setenv("KIE_FD_NS", ns)
    be, ref = real_size(arch, 4, fmt)
    assert be.fuse_down and not (be.tasks(1)[:, P.F_OP] == P.OP_EXP_DOWN).any()
    parity_over_two_launches(be, ref)


@pytest.mark.parametrize("arch,layers,fmt", [("llama-3.2-1b", 4, None), ("qwen3-30b-a3b", 4, None),
                                              ("qwen3-30b-a3b", 4, "nvfp4"), ("deepseek-v2-lite", 3, None)])
def test_real_size_default_prefill_within_bf16_noise(arch, layers, fmt):
    """The parity tests above swap in an fp32 oracle prefill; this one runs the backend's own (batched, bf16, over
    the plan's buffers, quantized Linears dequantized per layer) and bounds its K/V rows by twice the bf16
    reference decoder's own error against the fp32 one."""
    from types import SimpleNamespace
    spec = P.preset_spec(arch, layers)
    plan = P.build_plan(spec, None, CUDA, random_seed=1,
                        formats={"attn": fmt, "mlp": fmt, "exp": fmt} if fmt else None)
    be = MonokernelBackend(None, CUDA, plan=plan)
    assert be.prefill_mode == "torch" and be._prefill_decoder is None
    prompt = [(37 * i + 11) % spec.vocab_size for i in range(200)]
    prefill_within_bf16_noise(be, SimpleNamespace(spec=spec, weights=ArenaStore(plan)), prompt, CUDA)


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block", "nvfp4", "mxfp4"])
def test_real_size_quantized_parity(fmt):
    """qwen3-30b-a3b widths, 4 layers, every Linear but the router / LM head in `fmt` (random codes); the
    reference runs on the same codes dequantized in fp32."""
    be, ref = real_size("qwen3-30b-a3b", 4, fmt)
    assert be.plan.dims.FMT_EXP == be.plan.dims.FMT_ATTN > 0
    prompt = [(53 * i + 7) % be.spec.vocab_size for i in range(20)]
    got = list(be.generate(prompt, SamplingParams(max_new_tokens=12, ignore_eos=True), set()))
    assert_parity(be, ref, prompt, got)


@pytest.mark.parametrize("case,scheme,kinds", [
    ("qwen2_moe", "fp8", ("attn", "exp")), ("qwen3_moe_mixed", "fp8-block", ("attn", "mlp", "exp")),
    ("olmoe", "nvfp4", ("attn", "exp")), ("llama", "mxfp4", ("attn", "mlp"))])
def test_tiny_quantized_families(case, scheme, kinds, tiny_model):
    from .test_formats import DequantStore, quantize_model
    m = tiny_model(case)
    q = quantize_model(m, scheme, kinds)
    ref = ReferenceDecoder(m.spec, DequantStore(m.weights, q), CUDA, torch.float32)
    be = MonokernelBackend(m, CUDA, kv_dtype=torch.float32, quantized=lambda n: q[n].to(CUDA) if n in q else None)
    be._prefill_decoder = ref
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True), set()))
    assert_parity(be, ref, PROMPT, got)


def test_watchdog_trips_within_a_second_and_next_launch_works(tiny_model):
    m = tiny_model("qwen3_moe_mixed", torch.bfloat16)
    be = MonokernelBackend(m, CUDA, timeout_ms=200)
    p = SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = list(be.generate(PROMPT, p, set()))
    tasks = be.tasks(be.last_launch["n_splits"])
    row = next(i for i in range(tasks.shape[0])
               if int(tasks[i, P.F_OP]) == P.OP_O and int(tasks[i, P.F_LAYER]) == 1)
    be.plant_stuck_task(row)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"o_proj layer 1 .* decode step 0 waited for counter attention\[layer 1\]"):
        list(be.generate(PROMPT, p, set()))
    assert time.perf_counter() - t0 < 1.0
    assert list(be.generate(PROMPT, p, set())) == want


def test_tokens_stream_while_the_kernel_runs_and_host_stop_ends_it():
    be, _ = real_size("llama-3.2-1b")
    prompt = list(range(100, 116))
    n = 3000
    list(be.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), set()))  # compile
    t0 = time.perf_counter()
    gen = be.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), set())
    first = [next(gen) for _ in range(3)]
    t_first = time.perf_counter() - t0
    gen.close()                                  # sets the host stop flag and waits for the kernel
    t_stop = time.perf_counter() - t0
    made = int(be.ring[0])
    assert len(first) == 3 and made < n, f"the kernel ran to the end ({made} tokens) despite the stop flag"
    assert t_stop - t_first < 1.0
    # and the next launch is unaffected
    assert len(list(be.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), set()))) == 8


def test_eos_and_temperature_on_gpu(tiny_model):
    import numpy as np
    from kie_moe.kernels.monokernel.runtime import gumbel_ref
    m = tiny_model("llama", torch.bfloat16)
    ref = ReferenceDecoder(m.spec, m.weights, CUDA, torch.float32)
    be = MonokernelBackend(m, CUDA, kv_dtype=torch.float32)
    be._prefill_decoder = ref
    want = free_running(ref, PROMPT, 12)
    eos = want[5]
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=12), {eos}))
    assert got == want[:want.index(eos) + 1]
    p = SamplingParams(max_new_tokens=12, temperature=0.9, seed=7, ignore_eos=True)
    got = list(be.generate(PROMPT, p, set()))
    logits = teacher_forced(ref, PROMPT, got).cpu().numpy()
    for s, tok in enumerate(got):
        noisy = logits[s] / np.float32(0.9) + gumbel_ref(7, s, np.arange(m.spec.vocab_size))
        assert tok == int(np.argmax(noisy)), f"step {s}"
    assert list(be.generate(PROMPT, p, set())) == got


@pytest.mark.parametrize("top_k,top_p", [(40, 1.0), (0, 0.9), (20, 0.95)])
def test_real_size_top_k_top_p_draws_from_the_reference_filter(top_k, top_p):
    """The SFILTER variant at real width (llama-3.2-1b, 128k vocab: 32 sample tiles of 4096): every token is
    inside the fp32 reference's top-k / nucleus given the kernel's history, unless the draw fell back (a nucleus
    wider than the candidates, counted in the sampler's status), and the same seed replays on the GPU."""
    from kie_moe.kernels.sampling import sample_probs_ref
    be, ref = real_size("llama-3.2-1b")
    p = SamplingParams(max_new_tokens=24, temperature=0.8, top_k=top_k, top_p=top_p, seed=3, ignore_eos=True)
    got = list(be.generate(PROMPT, p, set()))
    assert be.last_launch["filtered"] and len(got) == 24
    logits = teacher_forced(ref, PROMPT, got)
    outside = []   # below the reference's kept set by more than the kernel's summation-order noise
    for s, t in enumerate(got):
        kept = sample_probs_ref(logits[s], 0.8, top_k, top_p) > 0
        floor = float(logits[s][kept].min()) - 2e-3 * (1 + float(logits[s].abs().max()))
        if not kept[t] and float(logits[s, t]) < floor:
            outside.append(s)
    assert len(outside) <= int(be.filter_sampler().status[0]), (outside, int(be.filter_sampler().status[0]))
    assert list(be.generate(PROMPT, p, set())) == got

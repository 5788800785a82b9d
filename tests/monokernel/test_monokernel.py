"""The monokernel end to end under TRITON_INTERPRET=1 (CPU): whole decode steps against ReferenceDecoder.

Greedy tokens must be identical for 8 steps; the last step's LM-head tile maxima must equal the reference's
logits (so a near-miss cannot hide behind argmax), and the K/V rows the kernel appended (MLA: latent and k_pe)
must equal the reference decoder's cache. Plus: attention split over the sequence (with sinks and windows),
temperature sampling against a host replay of the same Gumbel noise, EOS, the engine contract, in-kernel
prefill, and the watchdog."""
import numpy as np
import pytest
import torch
import triton

from kie_moe.kernels.monokernel import plan as P
from kie_moe.kernels.monokernel.runtime import MonokernelBackend, gumbel_ref
from kie_moe.models.reference import ReferenceDecoder
from kie_moe.sampling import SamplingParams

# 13 prompt tokens: longer than the sliding windows of the test models (6, 7), so windows matter
PROMPT = [5, 17, 33, 2, 101, 7, 9, 150, 3, 44, 61, 200, 12]
N = 8


def reference_run(m, prompt, tokens):
    """Teacher-forced reference: logits [len(tokens), V] for each generated position, and the final KV cache."""
    ref = ReferenceDecoder(m.spec, m.weights)
    out = [ref.forward(torch.tensor(prompt))[-1]]
    for t in tokens[:-1]:
        out.append(ref.forward(torch.tensor([t]))[-1])
    return torch.stack(out), ref.cache


def reference_greedy(m, prompt, n):
    ref = ReferenceDecoder(m.spec, m.weights)
    logits = ref.forward(torch.tensor(prompt))[-1]
    toks = []
    for _ in range(n):
        toks.append(int(logits.argmax()))
        logits = ref.forward(torch.tensor([toks[-1]]))[-1]
    return toks


def check_against_reference(be, m, prompt, got, tol=None):
    """tol: relative and absolute; default 1e-4 for fp32 arenas, 5e-3 when the backend runs tensor-core tasks
    (KIE_MONO_FP8_MMA / KIE_MONO_W16_MMA: their input rounded to fp16 first, 2^-11); a bf16 arena keeps activations
    and K/V in bf16 (callers pass 2e-2)."""
    if tol is None:
        tol = 5e-3 if getattr(be, "mma_any", False) else 1e-4
    want = reference_greedy(m, prompt, len(got))
    assert got == want
    logits, cache = reference_run(m, prompt, got)
    last = logits[-1]
    # the last step's LM-head partials: per-tile max logit
    for tile, (r0, n) in enumerate(be.plan.op_rows["lm"]):
        assert float(be.pv[tile]) == pytest.approx(float(last[r0:r0 + n].max()), rel=tol, abs=tol)
    # every K/V row the kernel appended (positions len(prompt)-1 ..) equals the reference cache
    p0, p1 = len(prompt) - 1, len(prompt) - 1 + len(got)
    def close(got_rows, want_rows):   # absolute slack scaled to the rows' magnitude (bf16 rounds to it)
        torch.testing.assert_close(got_rows.float().cpu(), want_rows, rtol=tol,
                                   atol=tol * max(1.0, float(want_rows.abs().max())))

    for i, (k, v) in enumerate(cache):
        if be.plan.dims.MLA:   # (latent, k_pe) rows
            close(be.kv[i, p0:p1], torch.cat([k, v], -1)[p0:p1])
            continue
        close(be.kv[i, 0, :, p0:p1], k[p0:p1].transpose(0, 1))
        close(be.kv[i, 1, :, p0:p1], v[p0:p1].transpose(0, 1))


def reference_over_two_launches_then_refused(be, m, n, monkeypatch, var, bad):
    """An env-switched variant's checks: the reference's tokens for n steps in each of two launches (per-launch
    state, such as tickets and cursors, restarts), then `var`=`bad` refused by a new backend, naming `var`."""
    for _ in range(2):
        got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=n, ignore_eos=True), set()))
        check_against_reference(be, m, PROMPT, got)
    monkeypatch.setenv(var, bad)
    with pytest.raises(ValueError, match=var):
        MonokernelBackend(m, "cpu")


GREEDY = [  # (case, n_sms: programs the tiles are sized for -> several tiles per op)
    ("llama", 3),               # llama3 rope scaling, tied embeddings
    ("qwen3", 1),               # per-head q/k norm, head_dim 24 (not a power of 2), sliding window 7
    ("qwen3_moe_mixed", 1),     # dense + MoE layers, un-normalised top-3 of 9
    ("qwen3_moe_norm", 1),      # renormalised top-k, first layer dense
    ("qwen2_moe", 1),           # q/k/v biases, shared expert with sigmoid gate
    ("mixtral_window", 1),      # sliding window 6 < prompt
    ("olmoe", 1),               # q/k norm over the whole projection, clip_qkv
    ("gpt_oss", 2),             # sinks, biases, alternating windows, clamped GLU, softmax over top-k, YaRN
    ("deepseek_v2", 2),         # MLA without q LoRA, group-limited greedy routing (group max), shared experts
    ("deepseek_v3", 1),         # MLA with q LoRA, sigmoid + correction bias, top-2-sum groups, YaRN mscale
]


@pytest.mark.parametrize("case,n_sms", GREEDY, ids=[c for c, _ in GREEDY])
def test_greedy_matches_reference(case, n_sms, tiny_model):
    m = tiny_model(case)
    be = MonokernelBackend(m, "cpu", n_sms=n_sms)
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=N, ignore_eos=True), set()))
    assert len(got) == N
    check_against_reference(be, m, PROMPT, got)


@pytest.mark.parametrize("case,splits", [("gpt_oss", 3), ("deepseek_v3", 2)])
def test_attention_split_over_sequence(case, splits, tiny_model):
    """Flash-decoding splits (combined by the last split of each kv head), with sinks and windows shorter than
    the context."""
    m = tiny_model(case)
    be = MonokernelBackend(m, "cpu")
    be.n_splits_override = splits
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=5, ignore_eos=True), set()))
    assert be.last_launch["n_splits"] == splits
    check_against_reference(be, m, PROMPT, got)


def test_attention_split_size_from_the_environment(tiny_model, monkeypatch):
    """KIE_ATTN_SPLIT_KB sets the K+V bytes per attention split (pick_splits: 8 KB by default), so a short
    context runs as more, shorter tasks; the launch gives the reference's tokens with the splits it picked. A value
    that is not a positive number of KB is refused with the variable's name; without it GQA splits carry 8 KB, MLA's
    32 KB."""
    m = tiny_model("qwen3_moe_norm")
    monkeypatch.setenv("KIE_ATTN_SPLIT_KB", "1")
    be = MonokernelBackend(m, "cpu", max_splits=8)   # (the interpreter's plan has one program: max_splits 1)
    be._ensure_kv(64)
    row = 2 * be.dims.DH * be.kv.element_size()        # K + V bytes per position
    n_ctx = len(PROMPT) + 16
    want = max(1, min(be.max_splits, n_ctx * row // 1024))
    assert be.pick_splits(n_ctx) == want > 1
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True), set()))
    assert be.last_launch["n_splits"] == want
    check_against_reference(be, m, PROMPT, got)
    for bad in ("0", "-8", "4.5"):
        monkeypatch.setenv("KIE_ATTN_SPLIT_KB", bad)
        with pytest.raises(ValueError, match="KIE_ATTN_SPLIT_KB"):
            MonokernelBackend(m, "cpu")
    monkeypatch.delenv("KIE_ATTN_SPLIT_KB")   # defaults: 8 KB for GQA tasks, MLA's keep 32
    assert MonokernelBackend(m, "cpu").split_kb == 8
    assert MonokernelBackend(tiny_model("deepseek_v3"), "cpu").split_kb == 32


@pytest.mark.parametrize("case,prec", [("qwen3_moe_norm", "tf32x3"), ("gpt_oss", "tf32x3"),
                                       ("qwen3_moe_norm", None), ("gpt_oss", None), ("gpt_oss", "ieee")])
def test_attention_dots_on_the_tensor_cores(case, prec, tiny_model, monkeypatch):
    """KIE_ATTN_DOT=tf32x3 (attention's score and p.V dots as three tf32 products each: ~fp32 accuracy), the
    default bf16x2 (on this fp32 cache: both operands as bf16 hi + lo, three products) and ieee (fp32 FMAs) give
    the reference's tokens and logits within the exact path's bound (per-head q/k norms; sinks and a window); a
    value that is not a precision is refused with the variable's name."""
    m = tiny_model(case)
    if prec is None:
        monkeypatch.delenv("KIE_ATTN_DOT", raising=False)
    else:
        monkeypatch.setenv("KIE_ATTN_DOT", prec)
    prec = prec or "bf16x2"
    be = MonokernelBackend(m, "cpu", max_splits=4)
    be.n_splits_override = 2
    be._ensure_kv(8)
    _, meta = be.kernel_args(be.tasks(2), 2, 4, 2, 1)
    assert meta["ATTN_PREC"] == prec
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=5, ignore_eos=True), set()))
    check_against_reference(be, m, PROMPT, got)
    monkeypatch.setenv("KIE_ATTN_DOT", "fp16")
    with pytest.raises(ValueError, match="KIE_ATTN_DOT"):
        MonokernelBackend(m, "cpu")


@pytest.mark.parametrize("case", ["llama", "gpt_oss"])
def test_long_launches_walk_the_cache_in_larger_blocks(case, tiny_model, monkeypatch):
    """A launch whose last position reaches KIE_ATTN_LONG_FROM runs attention with BLOCK_T = KIE_ATTN_LONG_BLOCK_T
    (another compiled variant) and gives the reference's tokens (GQA; gpt-oss with sinks and a window); a shorter
    launch keeps the plan's block_t; 0 turns it off; MLA and bad values: as documented."""
    m = tiny_model(case)
    monkeypatch.setenv("KIE_ATTN_LONG_FROM", "18")
    monkeypatch.setenv("KIE_ATTN_LONG_BLOCK_T", "32")
    be = MonokernelBackend(m, "cpu", max_splits=2)
    assert be.plan.tiles.block_t == 16
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True), set()))   # positions 13..18
    assert be._launch_args[1]["BLOCK_T"] == 32
    check_against_reference(be, m, PROMPT, got)
    list(be.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), set()))        # ends at 16
    assert be._launch_args[1]["BLOCK_T"] == 16
    monkeypatch.setenv("KIE_ATTN_LONG_BLOCK_T", "0")
    be = MonokernelBackend(m, "cpu", max_splits=2)
    list(be.generate(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True), set()))
    assert be._launch_args[1]["BLOCK_T"] == 16
    if case == "llama":
        assert MonokernelBackend(tiny_model("deepseek_v2"), "cpu").long_block_t == 0   # MLA: its own loop
        for var, bad in (("KIE_ATTN_LONG_BLOCK_T", "48"), ("KIE_ATTN_LONG_BLOCK_T", "8"),
                         ("KIE_ATTN_LONG_FROM", "4k")):
            monkeypatch.setenv(var, bad)
            with pytest.raises(ValueError, match=var):
                MonokernelBackend(m, "cpu")
            monkeypatch.delenv(var)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float16])
def test_attention_bf16x2_on_a_16_bit_cache(kv_dtype, tiny_model, monkeypatch):
    """KIE_ATTN_DOT=bf16x2 on a bf16 / fp16 KV cache (the GPU's: K and V used as stored, q and p split into two
    halves of the cache's dtype, two products) gives the exact (ieee) path's tokens on the same cache, its last
    step's LM-head maxima within 1e-3 and its K/V rows within the cache's rounding, over three attention splits;
    "bf16" LM-head maxima within 3e-2."""
    m = tiny_model("qwen3_moe_norm")
    runs = {}
    for prec in ("ieee", "bf16x2", "bf16"):
        monkeypatch.setenv("KIE_ATTN_DOT", prec)
        be = MonokernelBackend(m, "cpu", max_splits=4, kv_dtype=kv_dtype)
        be.n_splits_override = 3
        toks = list(be.generate(PROMPT, SamplingParams(max_new_tokens=5, ignore_eos=True), set()))
        runs[prec] = (toks, be.pv.clone(), be.kv.float().clone())   # last step's per-tile max logits; K/V
    assert runs["bf16x2"][0] == runs["ieee"][0]
    torch.testing.assert_close(runs["bf16x2"][1], runs["ieee"][1], rtol=1e-3, atol=1e-3)
    # later layers' K/V come from earlier layers' attention: equal up to the cache's own rounding
    torch.testing.assert_close(runs["bf16x2"][2], runs["ieee"][2], rtol=1e-2, atol=1e-2)
    # "bf16" (q and p rounded to the cache's dtype, one product: the graph backend's precision): close, not exact
    torch.testing.assert_close(runs["bf16"][1], runs["ieee"][1], rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("case,n_sms,once", [("qwen3_moe_mixed", 3, "1"), ("deepseek_v3", 2, "1"),
                                             ("qwen3_moe_mixed", 3, "0")])
def test_top_k_picked_once_by_the_last_router_task(case, n_sms, once, tiny_model, monkeypatch):
    """KIE_ROUTE_ONCE=1 (the default): the layer's last router task (a ticket over several router tiles) picks the
    top-k and the expert tasks read their ids: the reference's tokens over 5 steps and two launches (the tickets
    restart with each launch), dense and MoE layers mixed, DeepSeek's groups; =0 (every expert task picks the top-k
    itself) the same; a value other than 0 / 1 is refused naming the variable."""
    m = tiny_model(case)
    monkeypatch.setenv("KIE_ROUTE_IN_O", "0")   # (the router tasks these tickets count)
    monkeypatch.setenv("KIE_ROUTE_ONCE", once)
    be = MonokernelBackend(m, "cpu", n_sms=n_sms, min_task_bytes=64)
    assert be.route_once == (once == "1") and len(be.plan.op_rows["router"]) > 1
    reference_over_two_launches_then_refused(be, m, 5, monkeypatch, "KIE_ROUTE_ONCE", "yes")


@pytest.mark.parametrize("case,n_sms,merge", [("qwen3_moe_mixed", 3, "1"), ("gpt_oss", 2, "1"), ("deepseek_v3", 2, "0"),
                                               ("qwen2_moe", 3, "0")])
def test_router_inside_o_proj(case, n_sms, merge, tiny_model, monkeypatch):
    """KIE_ROUTE_IN_O=1 (plan.route_in_o, the default): no router tasks; a MoE layer's o_proj tiles (several:
    n_sms > 1) add their rows' share of the logits and of sum(x^2) into the layer's fixed-point accumulator and the
    expert tasks route from it. The reference's tokens over two launches (the accumulators restart with each and
    are zeroed between steps by the down tasks: a stale sum would change the routing), with dense and MoE layers
    mixed, the router bias (gpt-oss), DeepSeek's sigmoid + correction-bias groups over MLA, a shared expert
    (qwen2_moe). merge "1": with the top-k 4 slots per reduction (KIE_TOPK_MERGE)."""
    m = tiny_model(case)
    monkeypatch.setenv("KIE_ROUTE_IN_O", "1")
    monkeypatch.setenv("KIE_TOPK_MERGE", merge)
    be = MonokernelBackend(m, "cpu", n_sms=n_sms, min_task_bytes=64)
    t = be.tasks(1)
    o = t[t[:, P.F_OP] == P.OP_O]
    moe = {i for i, lay in enumerate(be.spec.layers) if lay.moe is not None}
    assert be.route_in_o and not be.route_once and not (t[:, P.F_OP] == P.OP_ROUTER).any()
    assert be.topk_merge == (merge == "1")
    assert len(o) > len(be.spec.layers) and moe
    assert all((int(r[P.F_AUX]) == 1) == (int(r[P.F_LAYER]) in moe) for r in o)
    reference_over_two_launches_then_refused(be, m, 5, monkeypatch, "KIE_ROUTE_IN_O", "on")
    assert not be.racc.any()   # the last step's down tasks left every layer's accumulator zeroed


@pytest.mark.parametrize("claim,case,n_sms", [("wait", "qwen3_moe_mixed", 3), ("late", "gpt_oss", 2)])
def test_successor_claimed_after_the_wait_or_after_the_signal(claim, case, n_sms, tiny_model, monkeypatch):
    """KIE_CLAIM=wait / late (kernel._claim_wait): a task claims its successor after its input wait, or after its
    own signal, instead of before the wait. The reference's tokens over two launches (a task claimed twice or
    skipped leaves a counter short: the watchdog, or wrong tokens); another value is refused naming the variable."""
    m = tiny_model(case)
    monkeypatch.setenv("KIE_CLAIM", claim)
    be = MonokernelBackend(m, "cpu", n_sms=n_sms)
    assert be.claim == ("ahead", "wait", "late").index(claim)
    reference_over_two_launches_then_refused(be, m, 4, monkeypatch, "KIE_CLAIM", "early")


def test_attention_combine_over_several_round_trips(tiny_model):
    """More non-empty splits than ops.head_combine takes per round trip (SC = 4 * threads // pow2(REP * Dh); one
    warp makes SC small enough for a context of 13..17): the last split of each kv head combines them all."""
    m = tiny_model("gpt_oss")
    be = MonokernelBackend(m, "cpu", num_warps=1)
    d = be.plan.dims
    sc = max(1, 4 * 32 * be.num_warps // triton.next_power_of_2(d.HQ // d.HKV * d.DH))
    assert sc <= 4
    be.n_splits_override = 2 * sc + 1            # 2-token splits: the last non-empty one is past 2 * SC
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=5, ignore_eos=True), set()))
    assert be.last_launch["n_splits"] == 2 * sc + 1
    check_against_reference(be, m, PROMPT, got)


def test_bf16_weights_and_stream_variants(tiny_model):
    """bf16 arena (the GPU default): the reference upcasts the same bf16 values, so tokens still match. Also the
    x-as-broadcast-tile streaming variant (x_bcast, kernels/tiles.py's layout) with its per-vector accumulators,
    and tl.range-pipelined weight loads (num_stages) instead of the explicit double buffer."""
    m = tiny_model("llama", torch.bfloat16)
    be = MonokernelBackend(m, "cpu", wdtype=torch.bfloat16, n_sms=2, x_bcast=True, num_stages=3)
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=8, ignore_eos=True), set()))
    check_against_reference(be, m, PROMPT, got, tol=2e-2)


def test_temperature_sampling_replays_gumbel_max(tiny_model):
    """Gumbel-max in the kernel == argmax(logits / T + the same counter-based noise) on the host, step by step;
    the same seed replays, another seed differs."""
    m = tiny_model("llama")
    be = MonokernelBackend(m, "cpu")
    p = SamplingParams(max_new_tokens=5, temperature=1.5, seed=1234, ignore_eos=True)
    got = list(be.generate(PROMPT, p, set()))
    logits, _ = reference_run(m, PROMPT, got)
    V = m.spec.vocab_size
    for s, tok in enumerate(got):
        noisy = logits[s].numpy() / np.float32(1.5) + gumbel_ref(1234, s, np.arange(V))
        assert tok == int(np.argmax(noisy)), f"step {s}"
    assert list(be.generate(PROMPT, p, set())) == got
    other = list(be.generate(PROMPT, SamplingParams(max_new_tokens=5, temperature=1.5, seed=99, ignore_eos=True),
                             set()))
    assert other != got
    assert got != reference_greedy(m, PROMPT, 5)


def test_gumbel_noise_is_standard():
    g = gumbel_ref(7, 3, np.arange(200000))
    assert abs(g.mean() - 0.5772) < 0.02 and abs(g.std() - np.pi / np.sqrt(6)) < 0.02


def test_eos_ends_the_launch(tiny_model):
    """EOS stops the kernel itself at that token."""
    m = tiny_model("llama")
    be = MonokernelBackend(m, "cpu")
    want = reference_greedy(m, PROMPT, N)
    eos = want[3]
    first = want.index(eos)
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=N), {eos}))
    assert got == want[:first + 1]
    assert int(be.ring[0]) == first + 1          # the kernel itself stopped there


def test_engine_runs_the_monokernel_backend(tiny_model):
    from kie_moe.engine import make_backend
    m = tiny_model("mixtral_window")
    be = make_backend("monokernel", m, torch.device("cpu"))
    assert be.name == "monokernel"
    got = list(be.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), set()))
    check_against_reference(be, m, PROMPT, got)


def test_watchdog_names_the_stuck_task_and_next_launch_works(tiny_model):
    m = tiny_model("qwen3_moe_mixed")
    be = MonokernelBackend(m, "cpu", n_sms=2)
    tasks = be.tasks(1)
    row = next(i for i in range(tasks.shape[0])
               if int(tasks[i, P.F_OP]) == P.OP_EXP_DOWN and int(tasks[i, P.F_LAYER]) == 1)
    be.plant_stuck_task(row)
    p = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with pytest.raises(RuntimeError, match=r"task \d+ \(expert_down layer 1 rows 0\.\.\d+\) of decode step 0 "
                                           r"waited for counter gate_up\[layer 1\]"):
        list(be.generate(PROMPT, p, set()))
    assert list(be.generate(PROMPT, p, set())) == reference_greedy(m, PROMPT, 4)


@pytest.mark.parametrize("case", ["qwen2_moe", "deepseek_v3"])
def test_in_kernel_prefill(case, tiny_model):
    """prefill="kernel": the prompt runs through the same launch as forced decode steps (no torch)."""
    m = tiny_model(case)
    be = MonokernelBackend(m, "cpu", prefill="kernel")
    got = list(be.generate(PROMPT[:5], SamplingParams(max_new_tokens=4, ignore_eos=True), set()))
    assert be.last_launch["n_forced"] == 4
    check_against_reference(be, m, PROMPT[:5], got)


def prefill_within_bf16_noise(be, m, prompt, dev="cpu"):
    """The backend's own prefill (the batched torch one over the plan's buffers, in the plan's weight dtype: what a
    user's first request runs) writes K/V rows no further from the fp32 reference decoder's than twice the reference
    decoder's own run in that dtype is, layer by layer. -> the worst ratio."""
    ids = prompt[:-1]
    be.prefill(ids)
    caches = {}
    for dt in (torch.float32, be.prefill_dtype):
        ref = ReferenceDecoder(m.spec, m.weights, dev, dt)
        ref.forward(torch.tensor(ids, device=dev))
        caches[dt] = ref.cache
    n, worst = len(ids), 0.0
    for i, ((k32, v32), (kx, vx)) in enumerate(zip(caches[torch.float32], caches[be.prefill_dtype])):
        if be.plan.dims.MLA:
            got, want, other = be.kv[i, :n], torch.cat([k32, v32], -1)[:n], torch.cat([kx, vx], -1)[:n]
        else:
            got = torch.stack([be.kv[i, 0, :, :n].transpose(0, 1), be.kv[i, 1, :, :n].transpose(0, 1)])
            want, other = torch.stack([k32[:n], v32[:n]]), torch.stack([kx[:n], vx[:n]])
        err = float((got.float() - want.float()).abs().max())
        noise = float((other.float() - want.float()).abs().max())
        if noise == 0:     # fp32 weights: the prefill runs fp32 too, and must match the reference closely
            assert err <= 1e-4 * max(1.0, float(want.abs().max())), (i, err)
            continue
        assert err <= 2 * noise, f"layer {i}: prefill K/V off by {err}, the reference in {be.prefill_dtype}: {noise}"
        worst = max(worst, err / noise)
    return worst


@pytest.mark.parametrize("case", ["llama", "qwen3_moe_norm", "deepseek_v3"])
def test_default_prefill_within_bf16_noise(case, tiny_model):
    """The default prefill over a bf16 arena (the GPU's default; no oracle swapped in): its K/V rows within twice
    the bf16 reference decoder's own error."""
    m = tiny_model(case, torch.bfloat16)
    be = MonokernelBackend(m, "cpu", wdtype=torch.bfloat16)
    assert be.prefill_mode == "torch" and be.prefill_dtype == torch.bfloat16
    prefill_within_bf16_noise(be, m, PROMPT)


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_non_finite_logit_stops_with_the_engines_error(temperature, tmp_path):
    """One NaN logit, in the LM head's last tile (not the one holding the real maximum), reaches the host as token
    -1, greedy or sampled (a max that skips NaN would hand over a real-looking id, maybe an EOS); the kernel stops
    there and the engine raises the reference backend's error. The next launch with good weights decodes."""
    import glob
    from safetensors.torch import load_file, save_file
    from kie_moe.engine import Engine
    from kie_moe.models.errors import CheckpointError
    from kie_moe.models.registry import load_model
    from ..models.hf_tiny import make_checkpoint
    make_checkpoint("qwen3", str(tmp_path / "good"))
    good = load_model(str(tmp_path / "good"))
    make_checkpoint("qwen3", str(tmp_path))
    f = glob.glob(f"{tmp_path}/*.safetensors")[0]
    t = load_file(f)
    V = t["lm_head.weight"].shape[0]
    t["lm_head.weight"][V - 2] = float("nan")
    save_file(t, f, metadata={"format": "pt"})
    m = load_model(str(tmp_path))
    be = MonokernelBackend(m, "cpu", n_sms=3)
    assert len(be.plan.op_rows["lm"]) >= 3
    eng = Engine(str(tmp_path), device="cpu", model=m, backend_impl=be)
    p = SamplingParams(max_new_tokens=4, temperature=temperature, seed=5, ignore_eos=True)
    with pytest.raises(CheckpointError, match="not finite at step 0"):
        list(eng.stream(PROMPT, p))
    assert int(be.ring[0]) == 1 and int(be.ring[1]) == -1    # the kernel stopped after the marked token
    assert float(be.pv[len(be.plan.op_rows["lm"]) - 1]) == float("inf")
    be = MonokernelBackend(good, "cpu", n_sms=3)
    assert list(be.generate(PROMPT, SamplingParams(max_new_tokens=4, ignore_eos=True), set())) == \
        reference_greedy(good, PROMPT, 4)


@pytest.mark.parametrize("case,top_k,top_p", [("llama", 5, 1.0), ("qwen3_moe_norm", 0, 0.8), ("gpt_oss", 7, 0.9)])
def test_top_k_top_p_replay_the_graph_sampler(case, top_k, top_p, tiny_model):
    """top-k / top-p inside the kernel (LM tiles store logits, kernels/sampling.py's tile + final tasks draw):
    at every step the token is the one kernels/sampling.sample_tokens draws from the reference decoder's logits
    with the same seed and step (same Philox noise, same candidate filter), it lies in the reference's top-k /
    nucleus, the same seed replays, and the next plain launch is greedy again."""
    from kie_moe.kernels.sampling import DeviceSampler, sample_probs_ref
    m = tiny_model(case)
    be = MonokernelBackend(m, "cpu", n_sms=2, sample_block_v=64, k_cand=16)   # 211 ids: 4 vocab tiles
    p = SamplingParams(max_new_tokens=4, temperature=1.5, top_k=top_k, top_p=top_p, seed=1234, ignore_eos=True)
    got = list(be.generate(PROMPT, p, set()))
    assert be.last_launch["filtered"] and be.filter_sampler().n_tiles == 4
    logits, _ = reference_run(m, PROMPT, got)
    inexact = 0
    for s, tok in enumerate(got):
        ds = DeviceSampler(m.spec.vocab_size, "cpu", k_cand=16, block_v=64).configure(1.5, top_k, top_p, 1234, s)
        assert tok == int(ds(logits[s])[0]), f"step {s}"
        if int(ds.status[0]) == 0:   # exact draw (else: a nucleus wider than the candidates, plain temperature)
            assert float(sample_probs_ref(logits[s], 1.5, top_k, top_p)[tok]) > 0, f"step {s}: outside the filter"
        inexact += int(ds.status[0])
    assert be.sampling_fallbacks() == inexact and (top_k == 0 or inexact == 0)
    assert list(be.generate(PROMPT, p, set())) == got
    assert be.sampling_fallbacks() == inexact          # per request: the replay counts its own draws only
    greedy = list(be.generate(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True), set()))
    assert not be.last_launch["filtered"] and greedy == reference_greedy(m, PROMPT, 3) and be.sampling_fallbacks() == 0


def test_top_k_above_the_candidates_is_refused(tiny_model):
    from kie_moe.models.errors import InputError
    be = MonokernelBackend(tiny_model("llama"), "cpu", k_cand=16)
    with pytest.raises(InputError, match="top_k 17: .* 16 candidates"):
        list(be.generate(PROMPT, SamplingParams(max_new_tokens=2, temperature=1.0, top_k=17), set()))


def test_cli_generate_top_p_on_the_monokernel(tiny_model, capsys):
    """`kie generate --backend monokernel --temperature T --top-p P --seed S` (the request the OpenAI server makes
    for a client's top_p) runs the kernel's top-k / top-p variant; the same seed gives the same tokens; no decode rate
    is reported for an interpreted launch."""
    import json
    from kie_moe import cli
    m = tiny_model("qwen3_moe_norm")
    args = ["generate", m.path, "--device", "cpu", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
            "2", "--ignore-eos", "--json", "--backend", "monokernel", "--temperature", "0.9", "--top-p", "0.9",
            "--top-k", "20", "--seed", "5"]
    assert cli.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["backend"] == "monokernel" and len(out["token_ids"]) == 2
    # interpreted, the launch hands over every token at its end: no decode rate is made up from their arrival
    assert out["tokens_per_s"] is None
    assert cli.main([a for a in args if a != "--json"]) == 0      # the same seed, printed for a person
    printed = capsys.readouterr()
    assert printed.out.strip() == ",".join(map(str, out["token_ids"]))
    assert "one interpreted launch: no per-token rate" in printed.err and "tok/s" not in printed.err


def test_engine_warmup_runs_both_kernel_variants(tiny_model, monkeypatch):
    """Engine.warmup (what `kie serve` runs on a GPU before answering) launches the plain and the top-k variant of
    the kernel, leaves no state behind (the next greedy request is the reference decoder's), and skips the top-k
    run on a backend that refuses it."""
    from kie_moe.engine import Engine
    from kie_moe.models.errors import InputError
    m = tiny_model("llama")
    eng = Engine(m.path, device="cpu", model=m, backend_impl=MonokernelBackend(m, "cpu"))
    assert eng.warmup() == ["greedy", "top-k"]
    assert eng.backend.last_launch["filtered"]
    got = eng.generate(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True)).token_ids
    assert got == reference_greedy(m, PROMPT, 3) and not eng.backend.last_launch["filtered"]
    gen = eng.backend.generate

    def refuses_top_k(ids, p, eos):
        if p.top_k:
            raise InputError("monokernel: no top-k here")
        return gen(ids, p, eos)
    monkeypatch.setattr(eng.backend, "generate", refuses_top_k)
    assert eng.warmup() == ["greedy"]


def test_engine_warmup_compiles_the_long_context_variant(tiny_model, monkeypatch):
    """With long_context (the default on a GPU), Engine.warmup also generates from the monokernel's long-context
    threshold, so that launch variant (BLOCK_T 32 here, KIE_ATTN_LONG_*) compiles before the first request needs
    it; the next short request is the reference decoder's again. Off by default on the CPU."""
    from kie_moe.engine import Engine
    m = tiny_model("llama")
    monkeypatch.setenv("KIE_ATTN_LONG_FROM", "20")
    monkeypatch.setenv("KIE_ATTN_LONG_BLOCK_T", "32")
    eng = Engine(m.path, device="cpu", model=m, backend_impl=MonokernelBackend(m, "cpu"))
    assert eng.warmup(long_context=True) == ["greedy", "top-k", "long-context"]
    # (the launch starts at the prompt's last token, position 19, and ends past 20)
    assert eng.backend.last_launch["start_pos"] == 19 and eng.backend._launch_args[1]["BLOCK_T"] == 32
    got = eng.generate(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True)).token_ids
    assert got == reference_greedy(m, PROMPT, 3) and eng.backend._launch_args[1]["BLOCK_T"] == 16
    assert eng.warmup() == ["greedy", "top-k"]

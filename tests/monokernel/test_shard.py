"""Tensor-parallel monokernel (kernels/monokernel/shard.py) on N simulated ranks: the real kernel under
TRITON_INTERPRET=1, one launch per rank in this process, the ranks' symmetric regions plain CPU tensors that the
kernel's puts write through the peer distances (kccl.sync.peer), ranks interleaved at their KCCL waits. Greedy
tokens must equal the single-device reference for N = 1, 2, 4; N = 1 runs the same put / signal / wait / reduce
tasks and equals the unsharded plan bit for bit. Plus the shard's shapes, the task table, a named deadlock, and the
sm_90 build of the sharded kernel (system-scope acquire / release in the PTX)."""
import os
import shutil
import subprocess
import sys

import pytest
import torch
import triton

from kie_moe.kernels.monokernel import plan as P
from kie_moe.kernels.monokernel.runtime import MonokernelBackend
from kie_moe.kernels.monokernel.shard import ShardedMonokernel, peer_offsets, shard
from kie_moe.models.errors import ConfigError
from kie_moe.sampling import SamplingParams

from .test_monokernel import reference_greedy

PROMPT = [5, 17, 33, 2, 101, 7, 9]
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)


def test_shard_shapes_and_biases(tiny_model):
    m = tiny_model("gpt_oss")                 # q/k/v/o biases, sinks, expert biases: every split rule
    spec0, s0 = shard(m.spec, m.weights, 0, 2)
    spec1, s1 = shard(m.spec, m.weights, 1, 2)
    a, a1 = m.spec.layers[0].attn, spec1.layers[0].attn
    assert (a1.num_heads, a1.num_kv_heads) == (a.num_heads // 2, a.num_kv_heads // 2)
    q = m.weights.get("layers.0.attn.q")
    torch.testing.assert_close(s1.get("layers.0.attn.q"), q[q.shape[0] // 2:])
    assert s1.get("layers.0.attn.o").shape[1] == m.weights.get("layers.0.attn.o").shape[1] // 2
    assert s1.get("layers.0.attn.sinks").shape[0] == a.num_heads // 2
    moe = m.spec.layers[0].moe
    assert spec1.layers[0].moe.intermediate_size == moe.intermediate_size // 2
    up = m.weights.get("layers.0.moe.experts.3.up")
    torch.testing.assert_close(s1.get("layers.0.moe.experts.3.up"), up[moe.intermediate_size // 2:])
    for name in ("layers.0.attn.o_bias", "layers.0.moe.experts.3.down_bias"):   # added once, by rank 0
        torch.testing.assert_close(s0.get(name), m.weights.get(name))
        assert not s1.get(name).any()
    torch.testing.assert_close(s1.get("layers.0.moe.router"), m.weights.get("layers.0.moe.router"))
    with pytest.raises(ConfigError, match="cannot split num_heads=4"):
        shard(m.spec, m.weights, 0, 3)
    assert peer_offsets([1000, 1400, 600], 1).tolist() == [-100, 0, -200]


def test_task_table_has_kccl_tasks(tiny_model):
    m = tiny_model("qwen3_moe_mixed")
    rspec, store = shard(m.spec, m.weights, 1, 2)
    pl = P.build_plan(rspec, store, "cpu", tp=(1, 2), n_sms=3)
    t = P.build_tasks(pl)
    ops = t[:, P.F_OP].tolist()
    L = m.spec.num_layers
    assert ops.count(P.OP_REDUCE) == L * len(pl.op_rows["o"]) + sum(
        len(pl.op_rows["exp_down" if lay.moe else "down"]) for lay in m.spec.layers)
    red = t[t[:, P.F_OP] == P.OP_REDUCE]
    assert (red[:, P.F_WCNT] == 2).all() and (red[:, P.F_WBASE] == 2).all()    # one signal per rank per step
    puts = t[(t[:, P.F_OP] == P.OP_O) | (t[:, P.F_OP] == P.OP_DOWN) | (t[:, P.F_OP] == P.OP_EXP_DOWN)]
    assert sorted(puts[:, P.F_XCTR].tolist()) == sorted(red[:, P.F_WAIT].tolist())   # every counter: put, then wait
    sample = t[t[:, P.F_OP] == P.OP_SAMPLE][0]
    n_lm = pl.n_lm_tiles
    assert int(sample[P.F_WAIT]) == 2 * L * pl.tp_tiles and int(sample[P.F_WCNT]) == 2 * n_lm
    per = -(-m.spec.vocab_size // 2)                        # rank 1 streams vocab rows [per, V)
    assert pl.op_rows["lm"][0][0] == per and sum(n for _, n in pl.op_rows["lm"]) == m.spec.vocab_size - per
    assert pl.sym_layout()["words"] == 2 * 2 * m.spec.hidden_size + 2 * 2 * n_lm + 2 * L * pl.tp_tiles + 1


def test_one_rank_is_the_unsharded_plan_bit_for_bit(tiny_model):
    m = tiny_model("qwen2_moe")               # shared expert with its sigmoid gate, q/k/v biases
    base = MonokernelBackend(m, "cpu", prefill="kernel", n_sms=2)
    want = list(base.generate(PROMPT, GREEDY, set()))
    sm = ShardedMonokernel(m, 1, "cpu", n_sms=2)
    assert list(sm.generate(PROMPT, GREEDY, set())) == want
    be = sm.ranks[0]
    assert torch.equal(be.x, base.x) and torch.equal(be.kv, base.kv)
    lay = be.plan.sym_layout()   # the KCCL counters really counted: every tile, one signal per step
    steps = len(PROMPT) - 1 + GREEDY.max_new_tokens
    ctr = be.sym[lay["ctr"]:lay["ctr"] + lay["n_ctr"]]
    assert int(ctr[-1]) == steps * be.plan.n_lm_tiles and int(ctr[0]) == steps


CASES = [("llama", 2), ("qwen3_moe_mixed", 2), ("gpt_oss", 2), ("qwen3_moe_mixed", 4),
         ("deepseek_v2", 2), ("deepseek_v3", 2)]   # MLA split by heads (latent projections replicated)


@pytest.mark.parametrize("case,world", CASES, ids=[f"{c}-{w}" for c, w in CASES])
def test_ranks_give_the_single_device_tokens(case, world, tiny_model):
    m = tiny_model(case)
    sm = ShardedMonokernel(m, world, "cpu", n_sms=2)
    got = list(sm.generate(PROMPT, GREEDY, set()))
    assert got == reference_greedy(m, PROMPT, len(got)) and len(got) == GREEDY.max_new_tokens
    xs = [be.x for be in sm.ranks]                          # the residual stream is bit-identical on every rank
    assert all(torch.equal(x, xs[0]) for x in xs[1:])


def test_temperature_sampling_matches_one_device(tiny_model):
    m = tiny_model("llama")
    p = SamplingParams(max_new_tokens=4, temperature=0.8, seed=7, ignore_eos=True)
    want = list(MonokernelBackend(m, "cpu", prefill="kernel").generate(PROMPT, p, set()))
    assert list(ShardedMonokernel(m, 2, "cpu").generate(PROMPT, p, set())) == want


def test_deadlock_names_the_stuck_rank(tiny_model):
    m = tiny_model("llama")
    sm = ShardedMonokernel(m, 2, "cpu")
    tasks = sm.ranks[1].tasks(1)
    row = next(i for i in range(tasks.shape[0]) if int(tasks[i, P.F_OP]) == P.OP_REDUCE)
    sm.ranks[1].plant_stuck_task(row)         # rank 1's first reduce waits for a count nobody will reach
    with pytest.raises(RuntimeError, match=r"deadlock: .*rank 1 waits at task \d+ \(tp_reduce layer 0"):
        list(sm.generate(PROMPT, GREEDY, set()))
    assert list(sm.generate(PROMPT, GREEDY, set())) == reference_greedy(m, PROMPT, 5)   # next launch is clean


PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
SCRIPT = r"""
import sys, torch
from kie_moe.models.registry import load_model
from kie_moe.kernels.monokernel.runtime import compile_offline
from kie_moe.kernels.monokernel.shard import rank_backend
m = load_model(sys.argv[1])
for split in ("tp", "ep"):   # within-expert TP and expert parallelism (E_LOC > 0: the locality masks)
    be = rank_backend(m, 1, 2, "cpu", offline=True, wdtype=torch.bfloat16, block_k=512, block_t=32, n_sms=132,
                      expert_split=split)
    assert (be.plan.dims.E_LOC > 0) == (split == "ep")
    ptx = compile_offline(be).asm["ptx"]
    for needle in ("ld.global.acquire.sys", "red.release.sys.global.add", "ld.global.acquire.gpu", "%globaltimer"):
        assert needle in ptx, needle
    print("ok", split, len(ptx))
"""


@pytest.mark.skipif(not (os.path.exists(PTXAS) or shutil.which("ptxas")), reason="no ptxas in this triton build")
def test_sharded_kernel_compiles_for_sm90(tiny_model):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", SCRIPT, tiny_model("qwen2_moe").path], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count("ok ") == 2


# ---- on one GPU: the same code with one rank (the multi-GPU runs are their own issue) -------------------------------

@pytest.mark.gpu
def test_gpu_one_rank_equals_unsharded_and_process_group_path(tiny_model):
    """N = 1 on the GPU: the in-process sharded plan and TpRank (a one-rank NCCL group, torch symmetric memory:
    what every `--devices N` worker runs) both give the unsharded plan's tokens bit for bit."""
    import torch.distributed as dist
    from kie_moe.kernels.monokernel.shard import TpRank
    from kie_moe.launch import free_port
    m = tiny_model("qwen3_moe_mixed", torch.bfloat16)
    p = SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = list(MonokernelBackend(m, "cuda", prefill="kernel").generate(PROMPT, p, set()))
    assert list(ShardedMonokernel(m, 1, "cuda").generate(PROMPT, p, set())) == want
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        r = TpRank(m)
        for _ in range(2):                                   # a second launch re-zeroes the region
            assert list(r.generate(PROMPT, p, set())) == want
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_gpu_kccl_watchdog_names_the_counter(tiny_model):
    import time
    m = tiny_model("qwen3_moe_mixed", torch.bfloat16)
    sm = ShardedMonokernel(m, 1, "cuda", timeout_ms=200)
    be = sm.ranks[0]
    p = SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = list(sm.generate(PROMPT, p, set()))
    tasks = be.tasks(be.last_launch["n_splits"])
    row = next(i for i in range(tasks.shape[0]) if int(tasks[i, P.F_OP]) == P.OP_REDUCE)
    be.plant_stuck_task(row)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tp_reduce layer 0 .*KCCL counter o_proj\[layer 0\] tile 0"):
        list(sm.generate(PROMPT, p, set()))
    assert time.monotonic() - t0 < 5.0
    assert list(sm.generate(PROMPT, p, set())) == want


# ---- expert parallelism and quantized shards --------------------------------------------------------------------

def test_expert_split_picks_tp_where_it_can_cut_and_ep_where_it_cannot():
    from kie_moe.kernels.monokernel.shard import expert_range, expert_split
    from kie_moe.kccl.tp_sim import owns_expert
    spec = P.preset_spec("qwen3-30b-a3b", 1)           # 128 experts of I = 768
    assert expert_split(spec, 8) == "tp"                # 96 columns each
    assert expert_split(spec, 8, "nvfp4") == "tp" and expert_split(spec, 8, "mxfp4") == "tp"   # 96 = 6 x 16 = 3 x 32
    assert expert_split(spec, 8, "fp8-block") == "ep"   # 96 is not whole 128-column blocks
    assert expert_split(spec, 8, want="ep") == "ep"
    assert expert_split(spec, 8, "fp8-block", want="auto") == "ep"   # "auto" (the CLI's default) = let it choose
    with pytest.raises(ConfigError, match="not a multiple of 128 columns"):
        expert_split(spec, 8, "fp8-block", want="tp")
    with pytest.raises(ConfigError, match="128 experts cannot give each of 256 ranks one"):
        expert_split(spec, 256, want="ep")
    for E, world in ((9, 4), (128, 8), (5, 5)):        # the same owners as the torch TP simulation
        for r in range(world):
            lo, n = expert_range(E, r, world)
            assert [e for e in range(E) if owns_expert(e, E, r, world)] == list(range(lo, lo + n))


def _qstore(store, q):
    """A quantized checkpoint as build_plan / shard see one: dequantized floats on get(), codes on request."""
    from .test_formats import DequantStore

    class QStore(DequantStore):
        def quantized_tensor(self, name):
            return self.q.get(name)
    return QStore(store, q)


EP_CASES = [  # (tiny checkpoint, world, expert split, scheme or None, Linear kinds quantized, expected split)
    ("qwen3_moe_mixed", 2, "ep", None, (), "ep"),                    # 9 experts over 2 ranks: 5, 4
    ("gpt_oss", 2, "ep", None, (), "ep"),                            # expert biases (added by their owner)
    ("qwen3_moe_mixed", 2, None, "fp8", ("attn", "mlp", "exp"), "tp"),    # codes and row scales cut per rank
    ("mixtral_window", 2, None, "nvfp4", ("attn", "exp"), "ep"),     # I = 48: 24-column halves split a 16-group
]


@pytest.mark.parametrize("case,world,want,scheme,kinds,split", EP_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[3] or 'float'}-{c[5]}" for c in EP_CASES])
def test_expert_parallel_and_quantized_ranks_give_the_single_device_tokens(case, world, want, scheme, kinds, split,
                                                                           tiny_model):
    from .test_formats import DequantStore, quantize_model
    m = tiny_model(case)
    q = quantize_model(m, scheme, kinds) if scheme else {}

    class M:
        spec = m.spec
        weights = _qstore(m.weights, q) if q else m.weights

    class Ref:
        spec = m.spec
        weights = DequantStore(m.weights, q)
    sm = ShardedMonokernel(M, world, "cpu", n_sms=2, expert_split=want)
    moe = next(lay.moe for lay in m.spec.layers if lay.moe is not None)
    for r, be in enumerate(sm.ranks):
        d = be.plan.dims
        assert (d.E_LOC > 0) == (split == "ep")
        if split == "ep":                                # whole experts of this rank only
            from kie_moe.kernels.monokernel.shard import expert_range
            assert (d.E_LO, d.E_LOC) == expert_range(moe.num_experts, r, world)
            assert be.plan.spec.layers[-1].moe.intermediate_size == moe.intermediate_size
        if scheme:
            assert d.FMT_EXP == {"fp8": 1, "nvfp4": 3}[scheme]
    got = list(sm.generate(PROMPT, GREEDY, set()))
    assert got == reference_greedy(Ref, PROMPT, len(got)) and len(got) == GREEDY.max_new_tokens
    xs = [be.x for be in sm.ranks]
    assert all(torch.equal(x, xs[0]) for x in xs[1:])

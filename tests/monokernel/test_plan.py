"""The planner without running the kernel: arena layout, tiling, and the task table's dependency structure."""
import pytest
import torch

from kie_moe.kernels.monokernel import plan as P
from kie_moe.models.registry import spec_from_config

from ..models.hf_tiny import BASE, CASES


def tiny_spec(case):
    from transformers import AutoConfig
    mt, over = CASES[case]
    return spec_from_config(AutoConfig.for_model(mt, **{**BASE, **over}).to_dict())


@pytest.mark.parametrize("rows,row_bytes,sms", [(3072, 4096, 132), (128, 4096, 132), (151936, 4096, 132),
                                                (97, 100, 3), (5, 10 << 20, 132)])
def test_split_rows_covers_every_row_once_in_equal_tiles(rows, row_bytes, sms):
    tiles = P.split_rows(rows, row_bytes, sms, 16 << 10, 64 << 10)
    assert tiles[0][0] == 0 and sum(n for _, n in tiles) == rows
    assert all(a + n == b for (a, n), (b, _) in zip(tiles, tiles[1:]))
    assert max(n for _, n in tiles) - min(n for _, n in tiles[:-1] or tiles) <= 1
    if rows * row_bytes >= sms * (64 << 10) and rows >= sms:
        assert len(tiles) % sms == 0 or len(tiles) > sms   # at least a full wave of programs


@pytest.mark.parametrize("case", ["llama", "qwen3_moe_mixed", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("splits", [1, 3])
def test_every_wait_is_met_by_earlier_tasks(case, splits):
    """Topological order: the count a task needs at step s is signalled by tasks before it (same step) or by
    the previous step -- so claiming tasks in order can never deadlock."""
    spec = tiny_spec(case)
    plan = P.build_plan(spec, None, "cpu", n_sms=5, random_seed=0)
    tasks = P.build_tasks(plan, splits).tolist()
    T = len(tasks)
    for step in range(3):
        seen: dict[int, int] = {}
        for s in range(step):
            for r in tasks:
                seen[r[P.F_SIG]] = seen.get(r[P.F_SIG], 0) + 1
        for i, r in enumerate(tasks):
            need = r[P.F_WCNT] * step + r[P.F_WBASE]
            assert seen.get(r[P.F_WAIT], 0) >= need, f"task {i} ({P.describe_task(torch.tensor(tasks), i)})"
            seen[r[P.F_SIG]] = seen.get(r[P.F_SIG], 0) + 1
    assert tasks[-1][P.F_OP] == P.OP_SAMPLE and sum(r[P.F_OP] == P.OP_SAMPLE for r in tasks) == 1
    assert T == len({(r[P.F_OP], r[P.F_LAYER], r[P.F_ROW0], r[P.F_NROWS], r[P.F_AUX]) for r in tasks})


def test_arena_views_hold_the_checkpoint_tensors(tiny_model):
    m = tiny_model("qwen2_moe")
    plan = P.build_plan(m.spec, m.weights, "cpu")
    for name in m.weights.names():
        assert torch.equal(plan.view(name), m.weights.get(name).float()), name
    # q|k|v rows are one matrix
    q = plan.view("layers.1.attn.q")
    off = plan.layers[1, P.LF_QKV].item()
    assert plan.arena.entries["layers.1.attn.q"][0] == off
    assert plan.arena.entries["layers.1.attn.k"][0] == off + q.numel()
    assert plan.weight_bytes_per_token() > 0


@pytest.mark.parametrize("arch,want", [("llama-3.2-1b", 2), ("qwen3-30b-a3b", 1), ("laneformer-2b", 1)])
def test_gpu_launch_shape_fits_an_sm(arch, want):
    # a GPU plan (meta device: shapes only) of a dense model runs 2 programs per SM, an MoE / Laneformer 1; the
    # warps and register cap the backend derives must let all of them share an sm_90 SM (64K registers, 228 KB)
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend
    plan = P.build_plan(P.preset_spec(arch, 2), None, "meta", n_sms=132)
    assert plan.programs_per_sm == want and plan.n_sms == 132 * want
    be = MonokernelBackend(None, torch.device("meta"), plan=plan, offline=True)
    regs = be.maxnreg or 255
    assert want * be.num_warps * 32 * regs <= 65536
    assert be.grid == plan.n_sms


def test_fp4_plans_take_twice_the_tile_rows_and_mxfp4_no_stages(monkeypatch):
    """A GPU plan (meta device) whose fp4 Linears stream on the CUDA cores (KIE_MONO_FP4_MMA=0) at one program per
    SM sizes its tiles from GPU_TILE_ELEMS_FP4 (H100 sweeps: nvfp4 +18%, mxfp4 +15% on qwen3-30b-a3b): every op's
    rows per tile double against the fp8 plan's (fp4 ops still at half a float op's elements), and an mxfp4 plan
    drops the cp.async stages (+26%); an explicit tile_elems / num_stages and 2 programs per SM keep theirs. With
    the fp4 tasks on the tensor cores (the default) the plans keep the fp8 plan's tiles and stages."""
    spec = P.preset_spec("qwen3-30b-a3b", 2)
    mm = {f: P.build_plan(spec, None, "meta", n_sms=132, formats={"attn": f, "exp": f}) for f in ("nvfp4", "mxfp4")}
    f8 = P.build_plan(spec, None, "meta", n_sms=132, formats={"attn": "fp8", "exp": "fp8"})
    for p in mm.values():   # (the fp4 ops' own tiles go unused: their tasks are mma8's)
        assert P.fp4_mma_tasks(p.dims) and p.tiles.ns == 3
        assert (p.tiles.bn["lm"], p.tiles.bn["router"]) == (f8.tiles.bn["lm"], f8.tiles.bn["router"])
    monkeypatch.setenv("KIE_MONO_FP4_MMA", "0")
    plan = lambda fmt, **kw: P.build_plan(spec, None, "meta", n_sms=132,  # noqa: E731
                                          formats={"attn": fmt, "exp": fmt}, **kw)
    nv, mx, f8 = plan("nvfp4"), plan("mxfp4"), plan("fp8")
    assert nv.tiles.bn == mx.tiles.bn
    for op in ("qkv", "o", "exp_up", "exp_down"):   # fp4 ops: half of 2 x 16384 elements, fp8's full 16384
        assert nv.tiles.bn[op] == f8.tiles.bn[op], op
    assert nv.tiles.bn["lm"] == 2 * f8.tiles.bn["lm"]   # the bf16 LM head: 2 x 16384 elements
    assert (nv.tiles.ns, mx.tiles.ns, f8.tiles.ns) == (3, 0, 3)
    assert plan("mxfp4", num_stages=2).tiles.ns == 2 and plan("mxfp4", programs_per_sm=2).tiles.ns == 3
    small = plan("nvfp4", tile_elems=P.GPU_TILE_ELEMS[1])
    assert all(small.tiles.bn[op] * 2 == nv.tiles.bn[op] for op in ("qkv", "o", "exp_up", "exp_down", "lm"))
    assert plan("nvfp4", programs_per_sm=2).tiles.bn == plan("mxfp4", programs_per_sm=2).tiles.bn


def test_fp4_packed_names_follow_their_readers(tiny_model, monkeypatch):
    """plan.fp4_packed: an fp4 Linear is stored in packing "mma" only where every reader is a tensor-core task:
    attention and routed experts' gate / up (and down where its task runs on the tensor cores: I_MOE and I_SH
    multiples of 32), never the shared expert's gate / up (CUDA-core stream_glu), nor anything with the fp4 tasks
    (KIE_MONO_FP4_MMA=0) or the packing (KIE_MONO_FP4_PACK=0) off, nor fp8."""
    import dataclasses
    spec = tiny_model("qwen2_moe").spec     # routed experts (I_MOE 32) and a shared expert (I_SH 48)
    d = P.build_plan(spec, None, "meta", n_sms=132, formats={"attn": "nvfp4", "exp": "nvfp4"}).dims
    names = ["layers.0.attn.q", "layers.0.attn.o", "layers.1.moe.experts.3.gate", "layers.1.moe.experts.3.down",
             "layers.1.moe.shared.up", "layers.1.moe.shared.down", "layers.0.moe.router"]
    assert (d.I_MOE, d.I_SH) == (32, 48)
    assert [P.fp4_packed(d, n) for n in names] == [True, True, True, False, False, False, False]
    d = dataclasses.replace(d, I_SH=64)   # down rows on the tensor cores: packed too
    assert [P.fp4_packed(d, n) for n in names] == [True, True, True, True, False, True, False]
    d8 = P.build_plan(spec, None, "meta", n_sms=132, formats={"attn": "fp8", "exp": "fp8"}).dims
    assert not any(P.fp4_packed(d8, n) for n in names)
    for flag in ("KIE_MONO_FP4_MMA", "KIE_MONO_FP4_PACK"):
        monkeypatch.setenv(flag, "0")
        assert not any(P.fp4_packed(d, n) for n in names)
        monkeypatch.delenv(flag)
    monkeypatch.setenv("KIE_MONO_FP8_MMA_DOWN", "0")
    assert [P.fp4_packed(d, n) for n in names] == [True, True, True, False, False, False, False]


def test_launch_maxnreg():
    assert P.launch_maxnreg(1, 8) is None and P.launch_maxnreg(2, 4) is None   # ptxas' 255 fits
    assert P.launch_maxnreg(4, 4) == 128 and P.launch_maxnreg(2, 8) == 128 and P.launch_maxnreg(3, 4) == 168


@pytest.mark.parametrize("case", ["llama", "qwen3", "qwen3_moe_mixed", "qwen2_moe", "gpt_oss", "mixtral_window",
                                  "deepseek_v2", "deepseek_v3"])
def test_split_tasks_equals_the_builder(case):
    # the runtime derives every split count's table from the one-split table (plan.split_tasks): it must be the
    # table build_tasks makes for that count, row for row, dense / MoE / MLA alike
    plan = P.build_plan(tiny_spec(case), None, "cpu", n_sms=5, random_seed=0)
    base = P.build_tasks(plan, 1)
    assert P.split_tasks(base, 1) is base
    for n in (2, 3, 7):
        assert torch.equal(P.split_tasks(base, n), P.build_tasks(plan, n)), n


@pytest.mark.parametrize("case", ["qwen3_moe_mixed", "gpt_oss"])
def test_fused_down_table(case):
    """build_tasks(fuse_dn=True): no expert down tasks; a MoE layer's gate / up tasks signal its output counter,
    which the next layer's q|k|v (or the LM head) waits on for all of them; split_tasks derives it as above."""
    plan = P.build_plan(tiny_spec(case), None, "cpu", n_sms=5, random_seed=0)
    base = P.build_tasks(plan, 1, rin_o=True, fuse_dn=True)
    ref = P.build_tasks(plan, 1, rin_o=True, fuse_dn=False)
    op = base[:, P.F_OP]
    assert not (op == P.OP_EXP_DOWN).any() and (ref[:, P.F_OP] == P.OP_EXP_DOWN).any()
    assert len(base) == len(ref) - int((ref[:, P.F_OP] == P.OP_EXP_DOWN).sum())
    up = base[op == P.OP_EXP_UP]
    for layer in up[:, P.F_LAYER].unique().tolist():
        sig = up[up[:, P.F_LAYER] == layer, P.F_SIG].unique()
        assert len(sig) == 1
        waiters = base[base[:, P.F_WAIT] == sig[0]]
        n_up = int((up[:, P.F_LAYER] == layer).sum())
        assert len(waiters) and (waiters[:, P.F_WCNT] == n_up).all() and (waiters[:, P.F_WBASE] == n_up).all()
    for n in (2, 3):
        assert torch.equal(P.split_tasks(base, n), P.build_tasks(plan, n, rin_o=True, fuse_dn=True)), n


def test_split_tasks_equals_the_builder_tensor_parallel(tiny_model):
    from kie_moe.kernels.monokernel.shard import shard
    m = tiny_model("qwen3_moe_mixed")
    rspec, store = shard(m.spec, m.weights, 1, 2)
    plan = P.build_plan(rspec, store, "cpu", tp=(1, 2), n_sms=3)
    base = P.build_tasks(plan, 1)
    for n in (2, 5):
        assert torch.equal(P.split_tasks(base, n), P.build_tasks(plan, n)), n


def test_task_size_of_one_op_from_the_environment(monkeypatch):
    """KIE_TASK_KB sizes one op's tasks without moving the others'. qwen3-30b-a3b's expert gate / up defaults to
    256 KB (session 34): one wave of 48-row tasks (16 per slot on 132 programs); exp_up:128 gives the plan's size,
    two waves of 24 rows. q|k|v, o_proj, the experts' down and the LM head keep their tiles. The LM head's tasks
    default to 512 KB (session 33); lm:128 gives the plan's size. Malformed entries are refused naming the
    variable."""
    spec = P.preset_spec("qwen3-30b-a3b", 2)
    monkeypatch.delenv("KIE_TASK_KB", raising=False)
    base = P.build_plan(spec, None, "meta", n_sms=132, formats={"attn": "fp8", "exp": "fp8"})
    monkeypatch.setenv("KIE_TASK_KB", "exp_up:128")
    small_up = P.build_plan(spec, None, "meta", n_sms=132, formats={"attn": "fp8", "exp": "fp8"})
    assert {n for _, n in base.op_rows["exp_up"]} == {48} and len(base.op_rows["exp_up"]) == 16
    assert {n for _, n in small_up.op_rows["exp_up"]} == {24} and len(small_up.op_rows["exp_up"]) == 32
    for op in ("qkv", "o", "exp_down", "lm", "router"):
        assert small_up.op_rows[op] == base.op_rows[op], op
    # fp4 experts: the plan's 512 KB already exceeds the 256 KB floor
    fp4 = P.build_plan(spec, None, "meta", n_sms=132, formats={"attn": "nvfp4", "exp": "nvfp4"})
    monkeypatch.setenv("KIE_TASK_KB", "exp_up:512")
    assert fp4.op_rows["exp_up"] == P.build_plan(spec, None, "meta", n_sms=132,
                                                 formats={"attn": "nvfp4", "exp": "nvfp4"}).op_rows["exp_up"]
    monkeypatch.delenv("KIE_TASK_KB")
    # the LM head's own default: tasks of at most 512 KB (bf16 rows of D = 2048: 4 KB each), not the plan's 128;
    # KIE_TASK_KB=lm:128 gives the plan's size back
    lm = base.op_rows["lm"]
    assert max(n for _, n in lm) * 4096 == 512 << 10 and len(lm) == -(-spec.vocab_size // 128)   # 1,187 tasks
    monkeypatch.setenv("KIE_TASK_KB", "lm:128")
    small = P.build_plan(spec, None, "meta", n_sms=132, formats={"attn": "fp8", "exp": "fp8"})
    assert max(n for _, n in small.op_rows["lm"]) * 4096 == 128 << 10 and len(small.op_rows["lm"]) == 4748
    for bad in ("exp_up", "experts:256", "lm:0", "lm:1.5"):
        monkeypatch.setenv("KIE_TASK_KB", bad)
        with pytest.raises(ValueError, match="KIE_TASK_KB"):
            P.build_plan(spec, None, "meta", n_sms=132)


def test_task_rows_are_one_padded_vector():
    """The kernel's claim loads a task row as one NF-wide vector: NF is a power of two and the columns past the
    last field stay zero (qwen3-30b-a3b at 132 programs, 2 layers)."""
    spec = P.preset_spec("qwen3-30b-a3b", 2)
    plan = P.build_plan(spec, None, "meta", n_sms=132, formats={"attn": "fp8", "exp": "fp8"})
    t = P.build_tasks(plan, 1)
    assert t.shape[1] == P.NF and P.NF & (P.NF - 1) == 0 and P.F_XWAIT + 1 <= P.NF
    assert int(t[:, P.F_XWAIT + 1:].abs().sum()) == 0

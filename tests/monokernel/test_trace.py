"""kernels/monokernel/trace.py: the analysis on a hand-made timeline (where the answer is known), and on the GPU a
traced launch against an untraced one."""
import numpy as np
import pytest

from kie_moe.kernels.monokernel import plan as P
from kie_moe.kernels.monokernel.trace import format_table, summarize


def _streamed_bytes(m, plan) -> float:
    """Independent count of a float plan's weight bytes per step: every 2-D weight of the store but the embedding
    table, routed experts scaled by top_k / E (the active ones)."""
    eb = plan.weights.element_size()
    moe = {i: lay.moe for i, lay in enumerate(m.spec.layers) if lay.moe is not None}
    total = 0.0
    for n in m.weights.names():
        t = m.weights.get(n)
        if t.ndim != 2 or n == "embed":
            continue
        frac = 1.0
        if ".moe.experts." in n:
            lay = moe[int(n.split(".")[1])]
            frac = lay.top_k / lay.num_experts
        total += t.numel() * eb * frac
    return total


def test_op_bytes_count_every_streamed_weight(tiny_model):
    m = tiny_model("qwen3_moe_mixed")        # dense and MoE layers, q/k norms (1-D: not streamed as a Linear)
    plan = P.build_plan(m.spec, m.weights, "cpu", n_sms=2)
    assert sum(plan.op_bytes_per_step().values()) == pytest.approx(_streamed_bytes(m, plan))


def _tasks(ops_sigs):
    t = np.zeros((len(ops_sigs), P.NF), dtype=np.int32)
    for i, (op, sig) in enumerate(ops_sigs):
        t[i, P.F_OP], t[i, P.F_SIG] = op, sig
    return t


def _stamp(tr, i, start, ready, done, ghz=2.0, prog=0):
    tr[i] = [start, ready, done, int(start * ghz), int(ready * ghz), int(done * ghz), prog, 0]


def test_summarize_charges_the_critical_path_to_the_phase_that_ends_it():
    # one step = 2 qkv tiles (counter 0) then 1 o_proj tile (counter 1) waiting for both; 3 steps, step 0 skipped
    tasks = _tasks([(P.OP_QKV, 0), (P.OP_QKV, 0), (P.OP_O, 1)])
    tr = np.zeros((9, 8), dtype=np.int64)
    for s in range(3):
        b = 10_000 + s * 1_000
        _stamp(tr, 3 * s + 0, b, b + 100, b + 300, prog=0)      # qkv: 200 ns work
        _stamp(tr, 3 * s + 1, b, b + 100, b + 500, prog=1)      # qkv: 400 ns work (the straggler)
        _stamp(tr, 3 * s + 2, b, b + 600, b + 900, prog=2)      # o: ready 100 ns after the last qkv, 300 ns work
    s = summarize(tasks, tr, n_programs=3, skip_steps=1, op_bytes={"o_proj": 4e5})
    assert s["steps"] == 2 and s["tasks_per_step"] == 3
    assert s["sm_ghz"] == pytest.approx(2.0, rel=1e-3)
    q, o = s["ops"]["qkv_proj"], s["ops"]["o_proj"]
    assert q["work_us"] == pytest.approx(0.3) and q["wait_us"] == pytest.approx(0.1) and q["work_us_max"] == 0.4
    assert o["wait_us"] == pytest.approx(0.6) and o["work_us"] == pytest.approx(0.3)
    # step 1: qkv ends at 11500 (500 after the span's start), o at 11900 (+400); step 2 starts at 12000: qkv ends
    # 12500 (+600, with the 100 ns gap between steps), o at 12900 (+400)
    assert q["critical_us_per_step"] == pytest.approx((0.5 + 0.6) / 2)
    assert o["critical_us_per_step"] == pytest.approx(0.4)
    assert sum(d["critical_us_per_step"] for d in s["ops"].values()) == pytest.approx(s["ms_per_step"] * 1e3)
    assert o["wake_lag_us"] == pytest.approx(0.1) and q["ready_spread_us"] == 0 and o["ready_spread_us"] == 0
    assert o["mb_per_step"] == 0.4 and o["gbps_on_critical_path"] == pytest.approx(1000.0)   # 400 KB in 0.4 us
    assert "o_proj" in format_table(s)
    # between tasks: each program runs one task a step; steps 1 and 2 start 1,000 ns apart, so program 0 waits
    # 1000 - 300 = 700 ns from its done to its next start, program 1 500, program 2 100: mean 433 ns, and those
    # 1,300 ns over 3 programs x the 1,900 ns span
    assert s["between_us"] == pytest.approx((0.7 + 0.5 + 0.1) / 3)
    assert s["between_share"] == pytest.approx(1300 / (3 * 1900))
    assert "between tasks 23%" in format_table(s)


def test_phases_are_named_by_most_of_their_tasks():
    # one step: 3 attention tiles signal counter 0, 3 o_proj tiles counter 1, and counter 2 a shared expert's
    # gate / up task (first in row order, as plan.build_tasks emits it) beside 2 routed expert tiles; the third
    # phase is the routed experts' (it was named by its first task), though its last task is the shared one's
    ops = [P.OP_ATTN, P.OP_ATTN, P.OP_ATTN, P.OP_O, P.OP_O, P.OP_O, P.OP_SH_UP, P.OP_EXP_UP, P.OP_EXP_UP]
    tasks = _tasks([(o, i // 3) for i, o in enumerate(ops)])
    tr = np.zeros((18, 8), dtype=np.int64)
    for st in range(2):
        b = 10_000 + st * 10_000
        for i in range(9):
            ph = i // 3
            end = b + 1000 * (ph + 1) + (300 if i == 6 else 0)   # the shared expert ends its phase, 300 ns late
            _stamp(tr, 9 * st + i, b + 1000 * ph, b + 1000 * ph + 100, end, prog=i)
    s = summarize(tasks, tr, n_programs=9, skip_steps=1)["ops"]
    assert set(s) == {"attention", "o_proj", "shared_gate_up", "expert_gate_up"}
    assert s["shared_gate_up"]["tasks_per_step"] == 1 and s["shared_gate_up"]["work_us"] == pytest.approx(1.2)
    # the experts' phase (ending at +3,300 with the shared task) is charged to the routed experts, 1.3 us after
    # o_proj's end
    assert s["expert_gate_up"]["critical_us_per_step"] == pytest.approx(1.3)
    assert s["shared_gate_up"]["critical_us_per_step"] == 0


def test_summarize_splits_attention_work_at_its_loop_stamp():
    # 2 steps of one attention task (step 0 skipped): ready at +100 ns, K/V loop at +400 / +600, done at +900
    tasks = _tasks([(P.OP_ATTN, 0)])
    tr = np.zeros((2, 8), dtype=np.int64)
    for s, loop in enumerate((400, 600)):
        b = 10_000 + s * 1_000
        _stamp(tr, s, b, b + 100, b + 900)
        tr[s, 7] = int((b + loop) * 2.0)
    a = summarize(tasks, tr, n_programs=1, skip_steps=1)["ops"]["attention"]
    assert a["work_us"] == pytest.approx(0.8) and a["pre_us"] == pytest.approx(0.5)
    tr[:, 7] = 0                                  # no loop stamp: no split
    assert summarize(tasks, tr, n_programs=1, skip_steps=1)["ops"]["attention"]["pre_us"] is None


def test_summarize_splits_expert_work_at_its_mid_and_loop_stamps():
    # an expert gate / up task: ready at +100 ns, top-k done (mid) at +300, rows loop at +500, done at +900
    tasks = _tasks([(P.OP_EXP_UP, 0)])
    tr = np.zeros((2, P.TRACE_W), dtype=np.int64)
    for s in range(2):
        b = 10_000 + s * 1_000
        tr[s, :8] = [b, b + 100, b + 900, 2 * b, 2 * (b + 100), 2 * (b + 900), 0, 2 * (b + 500)]
        tr[s, 8] = 2 * (b + 300)
    e = summarize(tasks, tr, n_programs=1, skip_steps=1)["ops"]["expert_gate_up"]
    assert e["work_us"] == pytest.approx(0.8) and e["mid_us"] == pytest.approx(0.2) and e["pre_us"] == pytest.approx(0.4)
    assert "mid us" in format_table(summarize(tasks, tr, n_programs=1, skip_steps=1))
    assert summarize(tasks, tr[:, :8], n_programs=1, skip_steps=1)["ops"]["expert_gate_up"]["mid_us"] is None


def test_summarize_needs_more_steps_than_it_skips():
    tasks = _tasks([(P.OP_QKV, 0)])
    tr = np.zeros((1, 8), dtype=np.int64)
    _stamp(tr, 0, 1, 2, 3)
    with pytest.raises(ValueError, match="1 whole step"):
        summarize(tasks, tr, 1)


@pytest.mark.gpu
def test_gpu_traced_launch_decodes_the_same_and_stamps_every_task(tiny_model):
    import torch
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend
    m = tiny_model("qwen3_moe_mixed", torch.bfloat16)
    mk = MonokernelBackend(m, "cuda")
    mk.launch(3, 4, 6, (), ignore_eos=True)
    torch.cuda.synchronize()
    want = mk.ring[1:7].tolist()
    T = mk.last_launch["n_tasks"]
    mk.launch(3, 4, 6, (), ignore_eos=True, trace_tasks=6 * T)
    torch.cuda.synchronize()
    mk.check_error()
    assert mk.ring[1:7].tolist() == want
    tr = mk.trace[:6 * T].cpu().numpy()
    assert (tr[:, 2] > 0).all() and (tr[:, 0] <= tr[:, 1]).all() and (tr[:, 1] <= tr[:, 2]).all()
    assert (tr[:, 3] <= tr[:, 4]).all() and (tr[:, 4] <= tr[:, 5]).all()
    s = summarize(mk._launch_tasks.cpu().numpy(), tr, mk.grid, op_bytes=mk.plan.op_bytes_per_step())
    assert sum(mk.plan.op_bytes_per_step().values()) == pytest.approx(_streamed_bytes(m, mk.plan))
    assert s["steps"] == 5 and {"expert_gate_up", "mlp_gate_up", "lm_head"} <= set(s["ops"])
    if mk.mma_any:   # the tensor-core tasks stamp their rows loop, the expert gate / up its top-k before it
        e = s["ops"]["expert_gate_up"]
        assert 0 < e["mid_us"] <= e["pre_us"] <= e["work_us"]

"""Where a monokernel decode step spends its time, from a traced launch (MonokernelBackend.launch(trace_tasks=N)).

The kernel's MODE 3 stamps every task (claim order t = step * T + row) with the global timer and the SM's clock64 at
three events: start (before its weight loads), input ready (its dependency wait returned), done (after its signal),
and some tasks one or two more in clock64 only: `loop` when their main loop starts (attention's K/V loop, the
tensor-core tasks' weight rows after their input is staged: ops.attention_task, mma8.py), `mid` when a routed
expert's gate / up task has its top-k (kernel.py):
trace int64 [N, 9] (plan.TRACE_W) = gt_start, gt_ready, gt_done, clk_start, clk_ready, clk_done, program, clk_loop,
clk_mid (0: none; traces of 8 fields, before the mid event, read the same).

summarize() turns that into
- per op kind: tasks, mean wait (start -> ready) and work (ready -> done) in us, from clock64 (exact on one SM),
  and for ops with a loop stamp the part of the work before it (`pre`: attention's q / k / RoPE / cache-append,
  a tensor-core task's input staging), and with a mid stamp the part before that (`mid`: the expert's top-k);
- the critical path: a phase is every task of one step that signals the same counter (one layer's o_proj tiles,
  ...), named by the op most of its tasks run; phases ordered by when their last task finished, each is charged
  the time since the previous phase ended. Summed per op kind, that says which ops the step's wall time goes to
  (their sum is the traced span);
- per phase kind: the lag from the previous phase's end to this phase's first ready task (wake-up latency) and the
  spread of its tasks' ready times (a task is ready when its input is there AND its program is free: a wide spread
  means programs arrive late, still busy with earlier tasks);
- busy share: sum of work over (programs x span); between share: the time a program spends from one task's done
  stamp to its next task's start stamp (the claim, the claimed row's load, the stop-word check), summed over
  (programs x span), and its mean per task (`between_us`; clock64 of the same SM).
"""
from __future__ import annotations

import numpy as np

from . import plan as P


def summarize(tasks: np.ndarray, trace: np.ndarray, n_programs: int, skip_steps: int = 1,
              op_bytes: dict[str, float] | None = None) -> dict:
    """tasks: int [T, NF] (one step's table); trace: int64 [N, 8 or 9] as above (rows never stamped are all zero).
    skip_steps: leading steps left out (the first step of a launch pays for cold caches and the claim ramp).
    op_bytes: weight bytes per step of each op kind (Plan.op_bytes_per_step): adds each op's MB and the GB/s its
    share of the critical path streams them at."""
    T = tasks.shape[0]
    n = min(trace.shape[0], (trace[:, 2] > 0).nonzero()[0].max() + 1 if (trace[:, 2] > 0).any() else 0)
    n_steps = n // T
    if n_steps <= skip_steps:
        raise ValueError(f"trace holds {n_steps} whole step(s) of {T} tasks: need more than skip_steps={skip_steps}")
    tr = trace[skip_steps * T:n_steps * T].astype(np.int64)
    steps = n_steps - skip_steps
    rows = np.tile(np.arange(T), steps)
    step = np.repeat(np.arange(steps), T)
    op = tasks[rows, P.F_OP]
    sig = tasks[rows, P.F_SIG]
    gt0, gt1, gt2 = tr[:, 0], tr[:, 1], tr[:, 2]
    clk = tr[:, 5] - tr[:, 3]
    ns = gt2 - gt0
    ghz = float(clk.sum() / max(1, ns.sum()))   # clock64 ticks per ns over all tasks (the SM clock)
    wait_us = (tr[:, 4] - tr[:, 3]) / ghz / 1e3
    work_us = (tr[:, 5] - tr[:, 4]) / ghz / 1e3
    span_ns = int(gt2.max() - gt0.min())
    name = lambda o: P.OP_NAMES.get(int(o), f"op{int(o)}")  # noqa: E731

    per_op = {}
    for o in np.unique(op):
        m = op == o
        per_op[name(o)] = dict(tasks_per_step=int(m.sum() // steps), wait_us=float(wait_us[m].mean()),
                               work_us=float(work_us[m].mean()), work_us_max=float(work_us[m].max()), pre_us=None,
                               mid_us=None)
        for col, key_ in ((7, "pre_us"), (8, "mid_us")):
            if col < tr.shape[1]:
                ml = m & (tr[:, col] > 0)
                if ml.any():
                    per_op[name(o)][key_] = float(((tr[ml, col] - tr[ml, 4]) / ghz / 1e3).mean())

    # phases: (step, signalled counter) -> (op, first ready, last done, first done)
    key = step.astype(np.int64) * (int(sig.max()) + 1) + sig
    order = np.argsort(key, kind="stable")
    ks, idx = np.unique(key[order], return_index=True)
    bounds = list(idx) + [len(order)]
    phases = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        sel = order[a:b]
        kinds, counts = np.unique(op[sel], return_counts=True)   # a phase is named by most of its tasks (the
        # experts' gate / up phase also holds the shared expert's tasks, first in row order)
        phases.append((int(gt2[sel].max()), int(gt1[sel].min()), int(gt1[sel].max()), name(kinds[counts.argmax()])))
    phases.sort()
    crit: dict[str, float] = {}
    lag: dict[str, list] = {}
    tail: dict[str, list] = {}
    prev_end = int(gt0.min())
    for end, first_ready, last_ready, nm in phases:
        crit[nm] = crit.get(nm, 0.0) + (end - prev_end) / 1e3 / steps
        lag.setdefault(nm, []).append((first_ready - prev_end) / 1e3)
        tail.setdefault(nm, []).append((last_ready - first_ready) / 1e3)
        prev_end = max(prev_end, end)
    for nm, d in per_op.items():
        d["critical_us_per_step"] = crit.get(nm, 0.0)
        d["wake_lag_us"] = float(np.mean(lag[nm])) if nm in lag else None
        d["ready_spread_us"] = float(np.mean(tail[nm])) if nm in tail else None
        if op_bytes and nm in op_bytes:
            d["mb_per_step"] = op_bytes[nm] / 1e6
            d["gbps_on_critical_path"] = op_bytes[nm] / max(1e-9, d["critical_us_per_step"]) / 1e3
    busy = float(work_us.sum() * 1e3 / (n_programs * max(1, span_ns)))
    # between tasks: each program's consecutive tasks (by start), done -> next start, on its own SM's clock
    prog = tr[:, 6]
    o2 = np.lexsort((tr[:, 3], prog))
    same = prog[o2][1:] == prog[o2][:-1]
    gaps = (tr[o2, 3][1:] - tr[o2, 5][:-1])[same] / ghz      # ns
    return dict(steps=int(steps), tasks_per_step=int(T), ms_per_step=span_ns / 1e6 / steps, sm_ghz=ghz, busy_share=busy,
                wait_share=float(wait_us.sum() * 1e3 / (n_programs * max(1, span_ns))),
                between_share=float(gaps.sum() / (n_programs * max(1, span_ns))),
                between_us=float(gaps.mean() / 1e3) if gaps.size else None, ops=per_op)


def format_table(s: dict) -> str:
    lines = [f"{s['steps']} steps x {s['tasks_per_step']} tasks, {s['ms_per_step']:.3f} ms/step, SM clock "
             f"{s['sm_ghz']:.2f} GHz, programs busy {100 * s['busy_share']:.0f}% / waiting "
             f"{100 * s['wait_share']:.0f}% / between tasks {100 * s.get('between_share', 0):.0f}%"
             + (f" ({s['between_us']:.2f} us per task)" if s.get("between_us") is not None else ""),
             f"{'op':<16}{'tasks':>7}{'wait us':>9}{'work us':>9}{'max':>8}{'crit us/step':>13}{'lag us':>8}"
             f"{'spread us':>10}{'MB':>8}{'GB/s crit':>10}{'pre us':>8}{'mid us':>8}"]
    ops = sorted(s["ops"].items(), key=lambda kv: -kv[1]["critical_us_per_step"])
    for nm, d in ops:
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"{nm:<16}{d['tasks_per_step']:>7}{d['wait_us']:>9.2f}{d['work_us']:>9.2f}{d['work_us_max']:>8.1f}"
                     f"{d['critical_us_per_step']:>13.1f}{f(d['wake_lag_us']):>8}{f(d['ready_spread_us']):>10}"
                     f"{f(d.get('mb_per_step')):>8}{f(d.get('gbps_on_critical_path')):>10}{f(d.get('pre_us')):>8}"
                     f"{f(d.get('mid_us')):>8}")
    return "\n".join(lines)

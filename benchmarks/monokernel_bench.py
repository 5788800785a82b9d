"""Monokernel decode speed on real shapes (random weights drawn straight into the plan's device arena: no
checkpoint, no host copy), beside the read-bandwidth probe. GPU only; `--help` works anywhere.

For each preset: build the plan, compile + warm up with one short launch, then time `--reps` launches of
`--new-tokens` greedy steps each (one launch = all steps; CUDA events around it; KV positions before
`--prompt-len` are zeros: their values do not change the bytes read). Reports tok/s, ms/token, the bytes one
step streams (active weights + scales + LM head + KV), GB/s and % of the probe, per weight format (`--formats`:
random codes of fp8 / fp8-block / nvfp4 / mxfp4 for every Linear but the router, LM head and embeddings).

Breakdown (on by default): the same plan in the kernel's two benchmark modes, which give wrong tokens but say
where time goes: `sync_only` (every task only claims, waits and signals: scheduling + dependency latency per
step) and `no_wait` (no dependency waits: how fast the task structure streams weights). `--sweep` repeats the
first preset over a handful of variants (pipeline stages, tile shapes, task bytes, 2 programs per SM with 4
warps, x layout).

    python benchmarks/monokernel_bench.py --out results.json
    python benchmarks/monokernel_bench.py --archs llama-3.2-1b --sweep --out sweep.json
    python benchmarks/monokernel_bench.py --archs laneformer-2b --formats fp16 --out lf.json   # kie preview's model
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

DEFAULT_ARCHS = "llama-3.2-1b,qwen3-30b-a3b"
SWEEP = [  # plan / launch options per point (defaults: block_k 1024, tile_elems 16384, 8 warps, 128 KB tasks
    # (512 for a Laneformer and fp4 weights), num_stages 3, one program per SM)
    dict(), dict(num_stages=0), dict(num_stages=2), dict(num_stages=4), dict(block_k=2048, num_stages=3),
    dict(tile_elems=32768, num_stages=3), dict(max_task_kb=64), dict(max_task_kb=512),
    dict(num_warps=4, programs_per_sm=2), dict(num_warps=4, programs_per_sm=2, num_stages=0),
    dict(tile_elems=8192, block_k=512, x_bcast=True, num_stages=0),
]


def read_probe_gbps(nbytes: int = 4 << 30) -> float:
    """torch int64 sum over 4 GiB: the read ceiling the roofline percentages use (as benchmarks/gpu_smoke.py)."""
    import torch
    import triton.testing as tt
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    ms = tt.do_bench(lambda: x.view(torch.int64).sum(), warmup=50, rep=300, return_mode="median")
    del x
    torch.cuda.empty_cache()
    return nbytes / ms / 1e6


def bench_one(arch: str, probe: float, *, new_tokens: int, prompt_len: int, reps: int, layers: int | None = None,
              block_k=None, tile_elems=None, block_t=None, num_warps=None, max_task_kb=None, x_bcast=False,
              num_stages=None, programs_per_sm=None, maxnreg=None, breakdown: bool = False, fmt: str = "bf16",
              trace_steps: int = 0) -> dict:
    import torch
    from kie_moe.kernels.monokernel import plan as P
    from kie_moe.kernels.monokernel.runtime import MonokernelBackend
    r = dict(arch=arch, fmt=fmt, layers=layers, block_k=block_k, tile_elems=tile_elems, block_t=block_t,
             num_warps=num_warps, max_task_kb=max_task_kb, x_bcast=x_bcast, num_stages=num_stages,
             programs_per_sm=programs_per_sm, maxnreg=maxnreg, new_tokens=new_tokens, prompt_len=prompt_len)
    mk = None
    try:
        spec = P.preset_spec(arch, layers)
        t0 = time.perf_counter()
        plan = P.build_plan(spec, None, "cuda", random_seed=0, block_k=block_k, tile_elems=tile_elems,
                            block_t=block_t, max_task_bytes=None if max_task_kb is None else max_task_kb << 10,
                            x_bcast=x_bcast, num_stages=num_stages,
                            programs_per_sm=programs_per_sm, wdtype=torch.float16 if fmt == "fp16" else None,
                            formats=None if fmt in ("bf16", "fp16") else {"attn": fmt, "mlp": fmt, "exp": fmt})
        torch.cuda.synchronize()
        r["plan_s"] = time.perf_counter() - t0
        r["programs_per_sm"] = plan.programs_per_sm
        r["tiles"] = dict(block_k=plan.tiles.block_k, bn=plan.tiles.bn, block_t=plan.tiles.block_t,
                          num_stages=plan.tiles.ns, programs=plan.n_sms)
        r["tasks_per_op"] = {k: len(v) for k, v in plan.op_rows.items()}
        mk = MonokernelBackend(None, torch.device("cuda"), plan=plan, num_warps=num_warps, maxnreg=maxnreg)
        r.update(num_warps=mk.num_warps, maxnreg=mk.maxnreg)
        tok = 1000 % spec.vocab_size

        def timed(mode: int) -> tuple[float, list, float]:
            t0 = time.perf_counter()
            mk.launch(tok, prompt_len, 4, (), ignore_eos=True, mode=mode)          # compile + warm up
            torch.cuda.synchronize()
            mk.check_error()
            # the timed launches' task table (their context picks the attention split count: qwen3 at 32 + 128
            # tokens needs 10 splits, the 4-token warm-up 2): built on the host once per split count, ~0.2 s, which
            # otherwise fell into the first timed run (session 7: qwen3's first of 3 runs 25-35% slower)
            mk.tasks(mk.pick_splits(prompt_len + new_tokens))
            warm = time.perf_counter() - t0
            times = []
            for _ in range(reps):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                mk.launch(tok, prompt_len, new_tokens, (), ignore_eos=True, mode=mode)
                e.record()
                torch.cuda.synchronize()
                mk.check_error()
                assert int(mk.ring[0]) == new_tokens, f"ring holds {int(mk.ring[0])} tokens, expected {new_tokens}"
                times.append(s.elapsed_time(e) / 1e3)
            return sorted(times)[len(times) // 2], times, warm

        t, times, r["compile_and_warmup_s"] = timed(0)
        d = plan.dims
        kv = 2 * d.L * d.HKV * d.DH * mk.kv.element_size() * (prompt_len + new_tokens / 2)   # mean context
        bpt = plan.weight_bytes_per_token() + kv
        r.update(tok_per_s=new_tokens / t, ms_per_token=1e3 * t / new_tokens, runs_s=times,
                 bytes_per_token=bpt, gbps=bpt * new_tokens / t / 1e9,
                 pct_of_probe=100 * bpt * new_tokens / t / 1e9 / probe,
                 n_tasks_per_step=mk.last_launch["n_tasks"], n_splits=mk.last_launch["n_splits"],
                 attn_block_t=mk.last_launch["block_t"], attn_prec=mk.attn_prec,   # the timed launches'
                 tokens_sample=mk.ring[1:9].tolist(),
                 # the KIE_* switches this run had (an A/B's JSON says which side it is)
                 env={k: v for k, v in sorted(os.environ.items()) if k.startswith("KIE_")})
        if breakdown:
            for mode, name in ((1, "sync_only"), (2, "no_wait")):
                tm, _, _ = timed(mode)
                r[name] = dict(ms_per_token=1e3 * tm / new_tokens, tok_per_s=new_tokens / tm,
                               pct_of_probe=100 * bpt * new_tokens / tm / 1e9 / probe)
        if trace_steps:   # one more launch, time stamped per task (kernels/monokernel/trace.py)
            from kie_moe.kernels.monokernel.trace import format_table, summarize
            n = mk.last_launch["n_tasks"] * trace_steps
            mk.launch(tok, prompt_len, trace_steps, (), ignore_eos=True, trace_tasks=n)
            torch.cuda.synchronize()
            mk.check_error()
            ob = plan.op_bytes_per_step()
            if mk.fuse_down:   # (KIE_FUSE_DOWN: the gate / up tasks stream the down rows too)
                ob["expert_gate_up"] = ob.get("expert_gate_up", 0.0) + ob.pop("expert_down", 0.0)
            r["trace"] = summarize(mk._launch_tasks.cpu().numpy(), mk.trace[:n].cpu().numpy(), mk.grid, op_bytes=ob)
            print(format_table(r["trace"]), flush=True)
    except Exception as ex:  # one failing config must not lose the others
        r["error"] = f"{type(ex).__name__}: {ex}"[:2000]
        r["trace"] = traceback.format_exc()[-3000:]
    finally:
        del mk
        try:
            import torch
            torch.cuda.empty_cache()
        except Exception:
            pass
    print(json.dumps({k: v for k, v in r.items() if k not in ("trace", "runs_s")}), flush=True)
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--archs", default=DEFAULT_ARCHS, help=f"comma-separated presets (default {DEFAULT_ARCHS})")
    ap.add_argument("--layers", type=int, default=None, help="cut every preset to this many layers")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--formats", default="bf16,fp8", help="weight formats of every Linear (router, LM head and "
                    "embeddings stay bf16): bf16, fp16 (every float tensor in fp16: the Laneformer preview's "
                    "dtype), fp8, fp8-block, nvfp4, mxfp4 (default bf16,fp8)")
    ap.add_argument("--sweep", action="store_true", help="tile-shape grid on the first preset in the first format")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the sync-only / no-wait kernel variants")
    ap.add_argument("--programs-per-sm", type=int, default=None,
                    help="persistent programs per SM (default: plan.gpu_programs_per_sm)")
    ap.add_argument("--num-warps", type=int, default=None, help="default: plan.launch_warps(programs per SM)")
    ap.add_argument("--maxnreg", type=int, default=None, help="registers per thread cap (2+ programs per SM need "
                    "<= 128 at 8 warps)")
    ap.add_argument("--num-stages", type=int, default=None, help="weight-load pipeline stages (default: the plan's)")
    ap.add_argument("--block-t", type=int, default=None, help="attention positions per step (default: the plan's)")
    ap.add_argument("--block-k", type=int, default=None, help="K step of the weight tiles (default: the plan's)")
    ap.add_argument("--tile-elems", type=int, default=None, help="elements per weight tile (default: the plan's)")
    ap.add_argument("--max-task-kb", type=int, default=None,
                    help="largest task in KB (more tasks per phase below; default: the plan's: 128, 512 for lanes and "
                         "fp4)")
    ap.add_argument("--x-bcast", action="store_true", help="x as a broadcast tile in the weights' layout (XB 1: "
                    "no per-step layout conversion or barrier; needs BK x BN fp32 registers)")
    ap.add_argument("--trace", type=int, default=0, metavar="STEPS",
                    help="also run STEPS time-stamped decode steps and print where a step's time goes per op "
                         "(critical path, wait / work per task: kernels/monokernel/trace.py)")
    a = ap.parse_args(argv)

    import torch
    import triton
    if not torch.cuda.is_available():
        raise SystemExit("monokernel_bench: needs a CUDA GPU")
    res = dict(device=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count,
               torch=torch.__version__, triton=triton.__version__, date=time.strftime("%Y-%m-%d"))
    res["read_probe_gbps"] = probe = read_probe_gbps()
    print(json.dumps(res), flush=True)
    kw = dict(new_tokens=a.new_tokens, prompt_len=a.prompt_len, reps=a.reps, layers=a.layers, trace_steps=a.trace,
              programs_per_sm=a.programs_per_sm, maxnreg=a.maxnreg, num_warps=a.num_warps, num_stages=a.num_stages,
              block_k=a.block_k, block_t=a.block_t, tile_elems=a.tile_elems, max_task_kb=a.max_task_kb,
              x_bcast=a.x_bcast)
    archs = [x for x in a.archs.split(",") if x]
    fmts = [f for f in a.formats.split(",") if f]
    # the breakdown (two more compiles) for the first format only: the gpu-check stage has 300 s
    res["runs"] = [bench_one(x, probe, breakdown=not a.no_breakdown and i == 0, fmt=f, **kw)
                   for x in archs for i, f in enumerate(fmts)]
    if a.sweep:
        base = {k: v for k, v in kw.items() if k not in ("programs_per_sm", "num_warps", "num_stages", "block_k",
                                                          "tile_elems", "max_task_kb", "block_t")}
        res["sweep"] = [bench_one(archs[0], probe, fmt=fmts[0], **point, **base) for point in SWEEP]
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))
    return res


if __name__ == "__main__":
    main()

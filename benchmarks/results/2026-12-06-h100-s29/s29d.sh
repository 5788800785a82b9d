#!/bin/bash
# Session 29 call 4: qwen3-30b-a3b fp8 monokernel with KIE_MONO_FP8_MMA=1 at 256 KB tasks (the expert gate / up phase
# in one wave of 128 tasks instead of two: 256) beside the default 128 KB, same machine.
R=/tmp/s29d; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s29d.tgz -C /tmp s29d; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-200; export PYTHONPATH=/tmp/site KIE_MONO_FP8_MMA=1
for kb in 256 128; do timeout 75 python3 benchmarks/monokernel_bench.py --archs qwen3-30b-a3b --formats fp8 --max-task-kb $kb --no-breakdown --reps 3 --out $R/mk-$kb.json >$R/mk-$kb.log 2>&1; echo "$kb rc=$?"; grep -o '"tok_per_s": [0-9.]*\|"read_probe_gbps": [0-9.]*\|"tasks_per_op": {[^}]*}' $R/mk-$kb.json | tr '\n' ' '; echo; pk; done

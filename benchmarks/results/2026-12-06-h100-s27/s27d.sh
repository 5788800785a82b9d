#!/bin/bash
# Session 27 call 4: launch shapes of q/k/v and o_proj on an H100 (kernels_micro --layer-sweep, ops qkv,o; the grid's
# 2-warp rows were never timed for these two): qwen3-30b-a3b fp8, then llama-3.2-1b bf16.
R=/tmp/s27d; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s27d.tgz -C /tmp s27d; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-200; export PYTHONPATH=/tmp/site; pk
sw() { timeout $3 python3 benchmarks/kernels_micro.py --skip big,models --layer-sweep $1 --no-eager --rep-ms 30 --budget-s $2 --layer-ops qkv,o --out $R/sweep-${1/:/-}.json >$R/sweep-${1/:/-}.log 2>&1; echo "sweep $1 rc=$?"; grep -E "best|default|probe" $R/sweep-${1/:/-}.log; pk; }
sw qwen3-30b-a3b:fp8 170 200
sw llama-3.2-1b:bf16 120 150

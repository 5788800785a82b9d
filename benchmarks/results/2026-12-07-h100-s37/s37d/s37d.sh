#!/bin/bash
# Session 37's last call: where the monokernel's step goes, on today's default build: monokernel_bench's breakdown
# (sync-only: claims, waits and signals only; no-wait: the task structure streaming without dependencies) for
# qwen3-30b-a3b fp8 and llama-3.2-1b bf16. Carry .whl.
R=/tmp/s37d LIMIT=${LIMIT:-220}; . scripts/device-steps.sh
for a in "qwen3-30b-a3b fp8" "llama-3.2-1b bf16"; do set -- $a
  t=$(left); [ $t -gt 40 ] || break; [ $t -gt 130 ] && t=130
  timeout $t python3 benchmarks/monokernel_bench.py --archs $1 --formats $2 --reps 3 --out $R/bd-$1.json >$R/bd-$1.log 2>&1
  echo "$1 rc=$?"; grep -o '"tok_per_s": [0-9.]*\|"pct_of_probe": [0-9.]*\|"sync_only[^,]*,\|"no_wait[^,]*,\|"ms_per_token": [0-9.]*' $R/bd-$1.log | tr '\n' ' '; echo; pk
done

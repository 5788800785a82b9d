#!/bin/bash
# Session 32 call 3: the new defaults (KIE_MONO_FP8_MMA=1, KIE_DOWN_L2=1, KIE_CLAIM=late): qwen3-30b-a3b fp8 with a
# trace; KIE_CLAIM=ahead (the old default) against late on llama-3.2-1b fp8 and bf16 and laneformer-2b fp16; the GPU
# whole-step tests with the new defaults; the top-k once per layer (KIE_ROUTE_ONCE=1) with the late claim; the graph backend on llama-3.2-1b (issue 6's ratio).
R=/tmp/s32c; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s32c.tgz -C /tmp s32c; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
left() { echo $(( 480 - ($(date +%s) - T0) )); }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-160; export PYTHONPATH=/tmp/site
mk() { # name arch fmt env...
  n=$1; a=$2; f=$3; shift 3; t=$(left); [ $t -gt 35 ] || { echo "skip $n"; return; }; [ $t -gt 75 ] && t=75
  env "$@" timeout $t python3 benchmarks/monokernel_bench.py --archs $a --formats $f --no-breakdown --reps 3 $XA --out $R/mk-$n.json >$R/mk-$n.log 2>&1; echo "$n rc=$?"
  grep -o '"tok_per_s": [0-9.]*\|"pct_of_probe": [0-9.]*\|"tokens_sample": [^]]*' $R/mk-$n.log | tr '\n' ' '; echo; pk; }
XA="--trace 4" mk q qwen3-30b-a3b fp8
tail -14 $R/mk-q.log | grep -v '^{' | cut -c1-160
mk qonce qwen3-30b-a3b fp8 KIE_ROUTE_ONCE=1
mk l8late llama-3.2-1b fp8
mk l8ahead llama-3.2-1b fp8 KIE_CLAIM=ahead
mk lflate laneformer-2b fp16
mk lfahead laneformer-2b fp16 KIE_CLAIM=ahead
t=$(left); if [ $t -gt 40 ]; then [ $t -gt 170 ] && t=170
  KIE_GPU_TESTS=1 timeout $t python3 -m pytest tests/monokernel/test_monokernel_gpu.py tests/monokernel/test_trace.py -v -p no:cacheprovider -o addopts="" -m gpu >$R/test-gpu.log 2>&1; echo "tests rc=$?"; grep -cE "PASSED" $R/test-gpu.log; grep -E "FAILED|ERROR" $R/test-gpu.log | head -8 | cut -c1-200; pk; fi
mk l16late llama-3.2-1b bf16
mk l16ahead llama-3.2-1b bf16 KIE_CLAIM=ahead
t=$(left); if [ $t -gt 40 ]; then [ $t -gt 60 ] && t=60
  timeout $t python3 benchmarks/graph_bench.py --runs llama-3.2-1b:fp8,llama-3.2-1b:bf16 --backends graph --out $R/graph-l.json >$R/graph-l.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph-l.log | cut -c1-160; pk; fi
pk

#!/bin/bash
# Session 40: the monokernel's fp4 codes in packing "mma" where only tensor-core tasks read them (plan.fp4_packed,
# KIE_MONO_FP4_PACK, default on) against checkpoint bytes, same call; the nvfp4 step's breakdown (sync-only /
# no-wait) with the tensor-core fp4 tasks; the GPU runs of the packed test_mma8 cases and the quantized parity
# tests; the graph backend's qwen3 nvfp4 / mxfp4 for the ratio if time is left. Carry .whl.
R=/tmp/s40c LIMIT=${LIMIT:-520}; . scripts/device-steps.sh
mk qn qwen3-30b-a3b nvfp4
mk qnp0 qwen3-30b-a3b nvfp4 KIE_MONO_FP4_PACK=0
mk qm qwen3-30b-a3b mxfp4
mk qmp0 qwen3-30b-a3b mxfp4 KIE_MONO_FP4_PACK=0
t=$(left); [ $t -gt 120 ] && t=120
if [ $t -gt 40 ]; then
  KIE_GPU_TESTS=1 timeout -s INT $t python3 -m pytest tests/monokernel/test_mma8.py tests/monokernel/test_monokernel_gpu.py \
    -q --tb=short -rA -p no:cacheprovider -o addopts="" -n 4 -k "mma- or quantized or fp4_tasks" >$R/test-q.log 2>&1
  echo "tests rc=$?"; grep -cE "^PASSED" $R/test-q.log; grep -E "^(FAILED|ERROR)" $R/test-q.log | head -8 | cut -c1-200; pk; fi
t=$(left); if [ $t -gt 60 ]; then [ $t -gt 110 ] && t=110
  timeout $t python3 benchmarks/monokernel_bench.py --archs qwen3-30b-a3b --formats nvfp4 --reps 3 \
    --out $R/mk-qn-bd.json >$R/mk-qn-bd.log 2>&1; echo "breakdown rc=$?"
  grep -o '"tok_per_s": [0-9.]*\|"pct_of_probe": [0-9.]*\|"ms_per_token": [0-9.]*' $R/mk-qn-bd.log | tr '\n' ' '; echo; pk; fi
t=$(left); if [ $t -gt 50 ]; then
  timeout $t python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:mxfp4,qwen3-30b-a3b:nvfp4 --backends graph \
    --out $R/graph.json >$R/graph.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph.log | cut -c1-160; pk; fi

#!/bin/bash
# Next session's first call (prepared in session 32): qwen3-30b-a3b fp8 with the defaults (late claim, route once,
# fp8 tasks, down rows into L2), then KIE_UP_L2=1, KIE_NEXT_L2=1, both, KIE_STOP_EARLY=1 (tokens must equal the
# base's), every monokernel GPU test with the defaults (right after the base), a trace of UP_L2 + NEXT_L2.
# Carry .whl with pytest-xdist and execnet beside compressed-tensors' wheels.
R=/tmp/s33a LIMIT=560; . scripts/device-steps.sh
mk base qwen3-30b-a3b fp8
# (devices scarce in session 33: s33b's LM-head size and graph ratio moved here)
# every GPU test of the monokernel with the defaults (none has run with KIE_ROUTE_ONCE=1 yet); 4 pytest-xdist workers
# when the carried wheel imports (the cold compiles are CPU work: 16 cores), else one
XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
t=$(left); if [ $t -gt 40 ]; then [ $t -gt 150 ] && t=150
  KIE_GPU_TESTS=1 timeout $t python3 -m pytest tests/monokernel/test_monokernel_gpu.py tests/monokernel/test_trace.py -v $XD -p no:cacheprovider -o addopts="" -m gpu >$R/test-gpu.log 2>&1; echo "tests rc=$? ($XD)"; grep -cE "PASSED" $R/test-gpu.log; grep -E "FAILED|ERROR" $R/test-gpu.log | head -8 | cut -c1-200; pk; fi
mk up qwen3-30b-a3b fp8 KIE_UP_L2=1
mk next qwen3-30b-a3b fp8 KIE_NEXT_L2=1
mk both qwen3-30b-a3b fp8 KIE_UP_L2=1 KIE_NEXT_L2=1
mk stop qwen3-30b-a3b fp8 KIE_STOP_EARLY=1
mk lm512 qwen3-30b-a3b fp8 KIE_TASK_KB=lm:512
t=$(left); if [ $t -gt 50 ]; then [ $t -gt 70 ] && t=70
  timeout $t python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:fp8 --backends graph --out $R/graph-q.json >$R/graph-q.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph-q.log | cut -c1-160; pk; fi
XA="--trace 4" mk tboth qwen3-30b-a3b fp8 KIE_UP_L2=1 KIE_NEXT_L2=1
tail -14 $R/mk-tboth.log | grep -v '^{' | cut -c1-160
pk

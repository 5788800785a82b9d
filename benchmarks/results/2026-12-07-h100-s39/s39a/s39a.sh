#!/bin/bash
# Prepared in session 38 for the next session's first call: the issues' figures on today's defaults, on whatever
# card comes (issue 5 and 6 name the H200; the last H200 figures are sessions 19 / 32): the monokernel beside the
# graph backend on qwen3-30b-a3b fp8 and llama-3.2-1b bf16 in one call, Mixtral-8x7B nvfp4 / mxfp4 graph decode (with
# session 38's KIE_ROUTER_XH on), and kernels_micro's fp4 routed-expert rows. Carry .whl.
R=/tmp/s39a LIMIT=${LIMIT:-420}; . scripts/device-steps.sh
mk q qwen3-30b-a3b fp8
mk l llama-3.2-1b bf16
t=$(left); if [ $t -gt 60 ]; then [ $t -gt 90 ] && t=90
  timeout $t python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:fp8,llama-3.2-1b:bf16 --backends graph --out $R/graph.json \
    >$R/graph.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph.log | cut -c1-160; pk; fi
t=$(left); if [ $t -gt 60 ]; then [ $t -gt 90 ] && t=90
  timeout $t python3 benchmarks/graph_bench.py --runs mixtral-8x7b:nvfp4,mixtral-8x7b:mxfp4 --out $R/graph-mixtral.json \
    >$R/graph-mixtral.log 2>&1; echo "mixtral rc=$?"; grep "tok/s" $R/graph-mixtral.log | cut -c1-160; pk; fi
t=$(left); if [ $t -gt 60 ]; then
  timeout $((t - 5)) python3 benchmarks/kernels_micro.py --skip big,models --formats nvfp4,mxfp4 --budget-s $((t - 15)) \
    --out $R/experts.json >$R/experts.log 2>&1; echo "experts rc=$?"; grep -E " mma " $R/experts.log | cut -c1-150; pk; fi

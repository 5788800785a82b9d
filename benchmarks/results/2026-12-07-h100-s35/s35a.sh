#!/bin/bash
# Session 35's first call: the router folded into o_proj's phase (KIE_ROUTER_FOLD, new default) A/B on qwen3 fp8,
# a trace of the new defaults (the router phase gone? bf16x2's attention), the graph backend at 32 positions in the
# same call (issue 6's ratio), then the GPU suite with the new defaults (fold, bf16x2, 256 KB expert tasks: tiny
# tests on 4 pytest-xdist workers, real-size in one process). Carry .whl (compressed-tensors, pytest-xdist, execnet).
R=/tmp/s35a LIMIT=${LIMIT:-560}; . scripts/device-steps.sh
XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
T="tests/monokernel/test_monokernel_gpu.py tests/monokernel/test_trace.py tests/monokernel/test_laneformer_gpu.py"
mk q qwen3-30b-a3b fp8
mk q0 qwen3-30b-a3b fp8 KIE_ROUTER_FOLD=0
MKT=60 XA="--trace 4" mk tq qwen3-30b-a3b fp8
t=$(left); if [ $t -gt 50 ]; then [ $t -gt 80 ] && t=80
  timeout $t python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:fp8,llama-3.2-1b:bf16 --backends graph --out $R/graph.json >$R/graph.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph.log | cut -c1-160; pk; fi
gt tiny 110 -k "not real_size" $XD
gt real $(( $(left) - 5 )) -k "real_size"
pk

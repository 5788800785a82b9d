#!/bin/bash
# Next session's first call (prepared in session 36): issue 6's ratio with the attention task called (session 36's
# default: +9.5% on qwen3 fp8; inlined again as its A/B) beside the graph backend in the same call, the Laneformer's
# attention (ieee called, its unmeasured default; inlined), llama bf16 inlined / called again (session 36: -0.5%),
# KIE_MMA8_KS=all, a trace of the defaults, then the GPU tests after the fold's removal. Carry .whl.
R=/tmp/s37a LIMIT=${LIMIT:-540}; . scripts/device-steps.sh
mk q qwen3-30b-a3b fp8
mk qi qwen3-30b-a3b fp8 KIE_ATTN_NOINLINE=0   # session 36's +9.5% again, on this machine
mk qk qwen3-30b-a3b fp8 KIE_MMA8_KS=all        # every warp on each block of the 3-block tasks (NOTES session 36)
t=$(left); if [ $t -gt 50 ]; then [ $t -gt 80 ] && t=80
  timeout $t python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:fp8,llama-3.2-1b:bf16 --backends graph --out $R/graph.json >$R/graph.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph.log | cut -c1-160; pk; fi
mk l llama-3.2-1b bf16
mk li llama-3.2-1b bf16 KIE_ATTN_NOINLINE=0
mk f laneformer-2b fp16
mk fi laneformer-2b fp16 KIE_ATTN_NOINLINE=0
MKT=60 XA="--trace 4" mk tq qwen3-30b-a3b fp8
T="tests/monokernel/test_monokernel_gpu.py tests/monokernel/test_trace.py tests/monokernel/test_laneformer_gpu.py"
gt tiny 110 -k "not real_size" -n 4
gt real $(( $(left) - 5 )) -k "real_size"
pk

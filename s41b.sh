#!/bin/bash
# Prepared in session 40 (as s41a.sh) (predictions: NOTES, last entry). gpt-oss-20b mxfp4 on
# the monokernel with its fp4 tasks on the tensor cores (session 40's s40g ran out of its 70 s cap compiling), the
# graph backend beside it, and qwen3-30b-a3b fp8 on the monokernel: the fp8 tasks now go through mma8's weight-kind
# dispatch (the same inlined code is expected: same speed, same tokens as session 39's 296.9 tok/s). Carry .whl.
R=/tmp/s41b LIMIT=${LIMIT:-540}; . scripts/device-steps.sh
MKT=150 mk go gpt-oss-20b mxfp4
t=$(left); if [ $t -gt 60 ]; then [ $t -gt 130 ] && t=130
  timeout $t python3 benchmarks/graph_bench.py --runs gpt-oss-20b:mxfp4 --backends graph --out $R/graph.json \
    >$R/graph.log 2>&1; echo "graph rc=$?"; grep -o '"tok_per_s": [0-9.]*\|"pct_roofline": [0-9.]*' $R/graph.log | tr '\n' ' '; echo; pk; fi
MKT=90 mk q8 qwen3-30b-a3b fp8
# KIE_MMA_SCALE_ASM (off): the fp4 scale loads as inline PTX, for compile time; same tokens expected, speed unknown
mk qn qwen3-30b-a3b nvfp4
mk qns qwen3-30b-a3b nvfp4 KIE_MMA_SCALE_ASM=1

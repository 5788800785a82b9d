#!/bin/bash
# Session 41, second call (predictions: NOTES, "session 41 ... fewer reductions in the top-k"). The top-k with one
# max-with-index per slot (and the top-k's own softmax for renormalised softmax routers): qwen3-30b-a3b fp8 default
# (the router ticket's top-k) against s41a's 297.1, and KIE_ROUTE_IN_O=1 (every gate / up task's top-k) with a trace;
# then session 40's prepared gpt-oss-20b mxfp4 monokernel (tensor-core fp4) + graph peer, and KIE_MMA_SCALE_ASM.
R=/tmp/s41c LIMIT=${LIMIT:-545}; . scripts/device-steps.sh
MKT=90 mk q8 qwen3-30b-a3b fp8
mk q8r qwen3-30b-a3b fp8 KIE_ROUTE_IN_O=1
MKT=60 XA="--trace 4" mk tq8r qwen3-30b-a3b fp8 KIE_ROUTE_IN_O=1
MKT=150 mk go gpt-oss-20b mxfp4
t=$(left); if [ $t -gt 60 ]; then [ $t -gt 130 ] && t=130
  timeout $t python3 benchmarks/graph_bench.py --runs gpt-oss-20b:mxfp4 --backends graph --out $R/graph.json \
    >$R/graph.log 2>&1; echo "graph rc=$?"; grep -o '"tok_per_s": [0-9.]*\|"pct_roofline": [0-9.]*' $R/graph.log | tr '\n' ' '; echo; pk; fi
mk qn qwen3-30b-a3b nvfp4
mk qns qwen3-30b-a3b nvfp4 KIE_MMA_SCALE_ASM=1

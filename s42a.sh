#!/bin/bash
# Prepared in session 41 for the next session's first call (predictions: NOTES, "session 41 ... prediction for
# s42a.sh"). The rows issue 6 asks for with today's defaults (KIE_ROUTE_IN_O, KIE_MMA_SCALE_ASM on), the router-in-o
# A/B on nvfp4 and gpt-oss-20b, the top-k 4 slots per reduction (KIE_TOPK_MERGE, traced), and the graph backend
# beside them in the same call. On an H200 if one comes (then these are the first H200 monokernel rows since
# session 32). Carry .whl.
R=/tmp/s42a LIMIT=${LIMIT:-545}; . scripts/device-steps.sh
MKT=90 mk q8 qwen3-30b-a3b fp8
MKT=60 XA="--trace 4" mk tq8m qwen3-30b-a3b fp8 KIE_TOPK_MERGE=1
mk qn qwen3-30b-a3b nvfp4
mk qn0 qwen3-30b-a3b nvfp4 KIE_ROUTE_IN_O=0
mk qm qwen3-30b-a3b mxfp4
MKT=100 mk go gpt-oss-20b mxfp4
MKT=100 mk go0 gpt-oss-20b mxfp4 KIE_ROUTE_IN_O=0
t=$(left); if [ $t -gt 60 ]; then [ $t -gt 170 ] && t=170
  timeout $t python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:fp8,qwen3-30b-a3b:nvfp4,qwen3-30b-a3b:mxfp4 \
    --backends graph --out $R/graph.json >$R/graph.log 2>&1; echo "graph rc=$?"
  grep -o '"tok_per_s": [0-9.]*' $R/graph.log | tr '\n' ' '; echo; pk; fi

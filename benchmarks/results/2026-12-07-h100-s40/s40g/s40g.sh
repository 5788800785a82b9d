#!/bin/bash
# Session 40, the last ~250 s of device time: the monokernel on gpt-oss-20b in mxfp4 (issue 6's native-MXFP4 row is
# gpt-oss-120b; the 20b shape fits one call), its fp4 tasks on the tensor cores (default) and on the CUDA cores, then
# the graph backend beside it if time is left. Carry .whl.
R=/tmp/s40g LIMIT=${LIMIT:-150}; . scripts/device-steps.sh
MKT=70 mk go gpt-oss-20b mxfp4
MKT=50 mk go0 gpt-oss-20b mxfp4 KIE_MONO_FP4_MMA=0
t=$(left); if [ $t -gt 40 ]; then
  timeout $t python3 benchmarks/graph_bench.py --runs gpt-oss-20b:mxfp4 --backends graph --out $R/graph.json \
    >$R/graph.log 2>&1; echo "graph rc=$?"; grep -o '"tok_per_s": [0-9.]*\|"pct_roofline": [0-9.]*' $R/graph.log | tr '\n' ' '; pk; fi

#!/bin/bash
# Prepared in session 39 for the next session's first call (NOTES session 39, last entry): the monokernel's fp4 tiles
# on qwen3-30b-a3b. nvfp4 with session 39's doubled tiles (now its default) with and without cp.async stages, mxfp4
# at 16384 (its default) / 32768 elements / 32768 without stages, and the graph backend in the same call for the
# ratio. Carry .whl.
R=/tmp/s40a LIMIT=${LIMIT:-300}; . scripts/device-steps.sh
mk qn qwen3-30b-a3b nvfp4
XA="--num-stages 0" mk qns qwen3-30b-a3b nvfp4
mk qm qwen3-30b-a3b mxfp4
XA="--tile-elems 32768" mk qmt qwen3-30b-a3b mxfp4
XA="--tile-elems 32768 --num-stages 0" mk qmts qwen3-30b-a3b mxfp4
t=$(left); if [ $t -gt 50 ]; then [ $t -gt 90 ] && t=90
  timeout $t python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:nvfp4,qwen3-30b-a3b:mxfp4 --backends graph \
    --out $R/graph.json >$R/graph.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph.log | cut -c1-160; pk; fi

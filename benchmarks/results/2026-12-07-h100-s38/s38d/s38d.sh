#!/bin/bash
# Session 38: the router launch writes the tensor-core experts' xh (KIE_ROUTER_XH; NOTES session 38 prediction):
# its tests on the GPU, then Mixtral-8x7B nvfp4 / mxfp4 graph decode with the flag off / on. Carry .whl.
R=/tmp/s38d LIMIT=${LIMIT:-250}; . scripts/device-steps.sh
KIE_GPU_TESTS=1 timeout 90 python3 -m pytest tests/kernels/test_moe.py tests/kernels/test_graph_backend.py -q --tb=short \
  -rA -p no:cacheprovider -o addopts="" -k "xh or tensor_core" >$R/test-xh.log 2>&1; echo "tests rc=$?"
grep -cE "^PASSED" $R/test-xh.log; grep -E "^(FAILED|ERROR)" $R/test-xh.log | head -8 | cut -c1-200; tail -1 $R/test-xh.log; pk
for f in nvfp4 mxfp4; do for v in 0 1; do t=$(left); [ "$t" -gt 40 ] || break 2
  KIE_ROUTER_XH=$v timeout $((t - 5)) python3 benchmarks/graph_bench.py --runs mixtral-8x7b:$f --out $R/graph-$f-xh-$v.json \
  >$R/graph-$f-xh-$v.log 2>&1; echo "graph $f XH=$v rc=$?"; grep "tok/s" $R/graph-$f-xh-$v.log; pk; done; done

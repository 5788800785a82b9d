#!/bin/bash
# Session 38: the fp4 tensor-core expert launches as stream-K (KIE_MMA_EXPERTS_SK; NOTES session 38 prediction).
# GPU tests of fp4_mma_experts (interpreter-sized cases and real sizes, grid and stream-K), kernels_micro's expert
# rows for nvfp4 / mxfp4 at five shapes (the `mma sk` row beside `mma`), then Mixtral-8x7B nvfp4 / mxfp4 graph decode
# with the flag off / on. Carry .whl.
R=/tmp/s38b LIMIT=${LIMIT:-540}; . scripts/device-steps.sh
KIE_GPU_TESTS=1 timeout 150 python3 -m pytest tests/kernels/test_fp4_mma_experts.py -q --tb=short -rA -p no:cacheprovider \
  -o addopts="" >$R/test-fe.log 2>&1; echo "tests rc=$?"; grep -cE "^PASSED" $R/test-fe.log; grep -E "^(FAILED|ERROR)" $R/test-fe.log | head -8 | cut -c1-200; tail -1 $R/test-fe.log; pk
timeout 215 python3 benchmarks/kernels_micro.py --skip big,models --formats nvfp4,mxfp4 --budget-s 200 --out $R/experts.json \
  >$R/experts.log 2>&1; echo "experts rc=$?"; grep -E " mma( sk)? " $R/experts.log | cut -c1-150; pk
for f in nvfp4 mxfp4; do for v in 0 1; do t=$(left); [ "$t" -gt 70 ] || break 2
  KIE_MMA_EXPERTS_SK=$v timeout $((t - 5)) python3 benchmarks/graph_bench.py --runs mixtral-8x7b:$f --out $R/graph-$f-sk-$v.json \
  >$R/graph-$f-sk-$v.log 2>&1; echo "graph $f SK=$v rc=$?"; grep "tok/s" $R/graph-$f-sk-$v.log; pk; done; done

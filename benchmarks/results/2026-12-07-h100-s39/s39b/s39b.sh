#!/bin/bash
# Session 39: the tensor-core fp4 routed experts on stacks in packing "mma" (KIE_PACK_EXPERTS; NOTES session 39
# prediction): the packed tests on the GPU (mma.sync), Mixtral-8x7B nvfp4 / mxfp4 graph decode with the flag off / on,
# the monokernel on qwen3-30b-a3b nvfp4 / mxfp4 (last measured in session 6), then kernels_micro's expert rows with
# the new `mma packed` rows beside `mma`. Carry .whl.
R=/tmp/s39b LIMIT=${LIMIT:-520}; . scripts/device-steps.sh
KIE_GPU_TESTS=1 timeout 120 python3 -m pytest tests/kernels/test_fp4_mma_experts.py tests/kernels/test_fp4_mma.py \
  tests/kernels/test_graph_backend.py -q --tb=short -rA -p no:cacheprovider -o addopts="" \
  -k "(packed or packing or real_sizes or tensor_core_experts_their_xh) and not cpu" >$R/test-pack.log 2>&1; echo "tests rc=$?"
grep -cE "^PASSED" $R/test-pack.log; grep -E "^(FAILED|ERROR)" $R/test-pack.log | head -8 | cut -c1-200; tail -1 $R/test-pack.log; pk
for f in nvfp4 mxfp4; do for v in 0 1; do t=$(left); [ "$t" -gt 40 ] || break 2
  KIE_PACK_EXPERTS=$v timeout $((t - 5)) python3 benchmarks/graph_bench.py --runs mixtral-8x7b:$f --out $R/graph-$f-pack-$v.json \
  >$R/graph-$f-pack-$v.log 2>&1; echo "graph $f PACK=$v rc=$?"; grep "tok/s" $R/graph-$f-pack-$v.log; pk; done; done
mk qn qwen3-30b-a3b nvfp4
mk qm qwen3-30b-a3b mxfp4
t=$(left); if [ $t -gt 60 ]; then
  timeout $((t - 5)) python3 benchmarks/kernels_micro.py --skip big,models --formats nvfp4,mxfp4 --budget-s $((t - 15)) \
    --out $R/experts.json >$R/experts.log 2>&1; echo "experts rc=$?"; grep -E " mma" $R/experts.log | cut -c1-150; pk; fi

#!/bin/bash
# Session 39: the packed experts' GPU tests (bit-equal at the same GLU K chunks), then kernels_micro's expert rows with
# `mma packed glu-ksN` rows: is auto_glu_k_split's choice for packed stacks (4 programs per SM for nvfp4) right?
# Carry .whl.
R=/tmp/s39c LIMIT=${LIMIT:-330}; . scripts/device-steps.sh
KIE_GPU_TESTS=1 timeout 100 python3 -m pytest tests/kernels/test_fp4_mma_experts.py tests/kernels/test_fp4_mma.py \
  -q --tb=short -rA -p no:cacheprovider -o addopts="" -k "packed or packing or real_sizes" >$R/test-pack.log 2>&1
echo "tests rc=$?"; grep -cE "^PASSED" $R/test-pack.log; grep -E "^(FAILED|ERROR)" $R/test-pack.log | head -8 | cut -c1-200
tail -1 $R/test-pack.log; pk
t=$(left); if [ $t -gt 60 ]; then
  timeout $((t - 5)) python3 benchmarks/kernels_micro.py --skip big,models --formats nvfp4,mxfp4 --budget-s $((t - 15)) \
    --out $R/experts.json >$R/experts.log 2>&1; echo "experts rc=$?"; grep -E " mma" $R/experts.log | cut -c1-150; pk; fi
# the packed nvfp4 decode's tokens left PACK=0's at step 6 in s39b (its GLU K chunks went 3 -> 1): the same K chunks
# (KIE_MMA_GLU_KS=3, what the rule gives checkpoint bytes) should give PACK=0's tokens
t=$(left); if [ $t -gt 40 ]; then
  KIE_PACK_EXPERTS=1 KIE_MMA_GLU_KS=3 timeout $((t - 5)) python3 benchmarks/graph_bench.py --runs mixtral-8x7b:nvfp4 \
    --out $R/graph-nvfp4-pack-1-ks3.json >$R/graph-nvfp4-pack-1-ks3.log 2>&1; echo "graph ks3 rc=$?"; grep "tok/s" $R/graph-nvfp4-pack-1-ks3.log; pk; fi

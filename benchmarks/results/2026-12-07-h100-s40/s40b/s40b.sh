#!/bin/bash
# Session 40: the monokernel's fp4 tasks on the tensor cores (mma8.py's WK 3 / 4 over fp4_mma's loop;
# KIE_MONO_FP4_MMA, default on). qwen3-30b-a3b nvfp4 / mxfp4 with the flag on and off in the same call, then the
# GPU (mma.sync) runs of test_mma8's fp4 tasks (and a few fp8 / 16-bit cases: their calls changed too), and the
# quantized real-size / tiny parity tests of test_monokernel_gpu. Carry .whl.
R=/tmp/s40b LIMIT=${LIMIT:-500}; . scripts/device-steps.sh
mk qn qwen3-30b-a3b nvfp4
mk qn0 qwen3-30b-a3b nvfp4 KIE_MONO_FP4_MMA=0
mk qm qwen3-30b-a3b mxfp4
mk qm0 qwen3-30b-a3b mxfp4 KIE_MONO_FP4_MMA=0
t=$(left); [ $t -gt 150 ] && t=150
if [ $t -gt 40 ]; then
  KIE_GPU_TESTS=1 timeout -s INT $t python3 -m pytest tests/monokernel/test_mma8.py -q --tb=short -rA -p no:cacheprovider \
    -o addopts="" -n 4 -k "fp4 or nvfp4 or mxfp4 or 130x1040 or 33x48" >$R/test-mma8.log 2>&1; echo "mma8 tests rc=$?"
  grep -cE "^PASSED" $R/test-mma8.log; grep -E "^(FAILED|ERROR)" $R/test-mma8.log | head -8 | cut -c1-200; pk; fi
T=tests/monokernel/test_monokernel_gpu.py
t=$(left); [ $t -gt 40 ] && gt q $((t - 10)) -k "quantized" -n 4

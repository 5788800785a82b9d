#!/bin/bash
# Session 38: the fp4 tensor-core GEMV at the same 256 MB with K = 8192 / 4096 / 2048 (32 / 16 / 8 steps per warp):
# does a warp's stream length set the loop's rate (NOTES session 38 prediction)? Carry .whl.
R=/tmp/s38c LIMIT=${LIMIT:-200}; . scripts/device-steps.sh
timeout 190 python3 benchmarks/kernels_micro.py --skip big-experts,models --formats nvfp4,mxfp4 --mma-configs "" \
  --mma-shapes 65536x8192,131072x4096,262144x2048 --budget-s 180 --out $R/kmicro-k.json >$R/kmicro-k.log 2>&1
echo "rc=$?"; grep -E "GB/s" $R/kmicro-k.log | cut -c1-140; pk

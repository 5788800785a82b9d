#!/bin/bash
# Session 40 (run inline on the warm H100 after s40c, whose test stage ran out of time): the GPU runs of test_mma8's
# packed fp4 cases, the fp4 decode tests and the fp4 quantized parity tests. It lacked scripts/device-steps.sh's env
# stage, so the four tests that import compressed-tensors failed to import (re-run in s40e).
mkdir -p $OUT/s40d; KIE_GPU_TESTS=1 timeout -s INT 200 python3 -m pytest tests/monokernel/test_mma8.py tests/monokernel/test_monokernel_gpu.py -q --tb=short -rA -p no:cacheprovider -o addopts="" -n 6 -k "mma- or fp4_tasks or (quantized and (nvfp4 or mxfp4))" > $OUT/s40d/test-q.log 2>&1

#!/bin/bash
# Session 40: s40d's four import failures again, with the env stage (the carried wheels). Carry .whl.
R=/tmp/s40e LIMIT=150; . scripts/device-steps.sh; KIE_GPU_TESTS=1 timeout -s INT 120 python3 -m pytest tests/monokernel/test_mma8.py tests/monokernel/test_monokernel_gpu.py -q --tb=short -rA -p no:cacheprovider -o addopts="" -n 4 -k "fp4_tasks or (tiny_quantized and (nvfp4 or mxfp4))" > $R/test-q.log 2>&1; pk

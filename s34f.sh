#!/bin/bash
# Session 34's last call (~280 s of device time left): the monokernel GPU tests with the new defaults (bf16x2
# attention, 256 KB expert tasks): tiny families on 4 pytest-xdist workers, then the real-size tests in one process
# until the limit (SIGINT: pytest still prints what ran).
R=/tmp/s34f LIMIT=${LIMIT:-200}; . scripts/device-steps.sh
XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
T="tests/monokernel/test_monokernel_gpu.py tests/monokernel/test_trace.py"
KIE_GPU_TESTS=1 timeout -s INT 80 python3 -m pytest $T -q --tb=short -rA $XD -p no:cacheprovider -o addopts="" -m gpu -k "not real_size" >$R/test-tiny.log 2>&1; echo "tiny tests rc=$? ($XD)"
grep -cE "^PASSED" $R/test-tiny.log; grep -E "^(FAILED|ERROR)" $R/test-tiny.log | head -8 | cut -c1-200; pk
t=$(left); [ $t -gt 110 ] && t=110
KIE_GPU_TESTS=1 timeout -s INT $t python3 -m pytest $T -q --tb=short -rA -p no:cacheprovider -o addopts="" -m gpu -k "real_size_parity or real_size_quantized" >$R/test-real.log 2>&1; echo "real-size tests rc=$?"
grep -cE "^PASSED" $R/test-real.log; grep -E "^(FAILED|ERROR)" $R/test-real.log | head -8 | cut -c1-200; pk

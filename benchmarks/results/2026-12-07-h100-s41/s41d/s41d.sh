#!/bin/bash
# Session 41, third call: the GPU tests of the top-k with fewer reductions (test_route on the GPU, the tiny families
# and real-size parity with KIE_ROUTE_IN_O=1, the router_inside tests), before making KIE_ROUTE_IN_O the default.
R=/tmp/s41d LIMIT=${LIMIT:-240}; . scripts/device-steps.sh
KIE_GPU_TESTS=1 timeout -s INT 40 python3 -m pytest tests/monokernel/test_route.py -q -rA -p no:cacheprovider -o addopts="" \
  >$R/test-route.log 2>&1; echo "route rc=$?"; grep -cE "^PASSED" $R/test-route.log; grep -E "^(FAILED|ERROR)" $R/test-route.log | head -5; pk
T=tests/monokernel/test_monokernel_gpu.py
export KIE_ROUTE_IN_O=1; gt rino $(( $(left) - 10 )) -k "router_inside or tiny_families or real_size_parity or quantized_parity" -n 4

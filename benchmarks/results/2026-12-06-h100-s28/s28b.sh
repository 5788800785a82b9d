#!/bin/bash
# Session 28 call 2: the fp8 tensor-core GEMV with 4 pieces per step (256 B of a row) beside 2, its GPU tests, then
# issue 5's same-run peer with both of our schemes (call 1's peer budget ran out before fp8).
R=/tmp/s28b; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s28b.tgz -C /tmp s28b; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -2 $R/env.log; export PYTHONPATH=/tmp/site KIE_GPU_TESTS=1; pk
timeout 150 python3 -m pytest tests/kernels/test_fp8_mma.py -q -p no:cacheprovider -o addopts="" -m "gpu or not gpu" >$R/test_fp8_mma.log 2>&1; echo "test_fp8_mma rc=$?"; tail -3 $R/test_fp8_mma.log; pk
(cd benchmarks && timeout 120 python3 fp8_mma_bench.py --only big,persist --out $R/fp8-mma.json) >$R/fp8-mma.log 2>&1; echo "bench rc=$?"; grep -o '"name": "[^"]*".*pct_of_probe": [0-9.]*' $R/fp8-mma.log | sed 's/", "shape.*"gbps"/ gbps/'; pk
timeout 330 python3 benchmarks/peers.py --arch qwen3-30b-a3b --modes compile --ours-schemes fp8,bf16 --out $R/peers.json --budget-s 320 >$R/peers.log 2>&1; echo "peers rc=$?"; tail -5 $R/peers.log; pk

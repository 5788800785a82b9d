#!/bin/bash
# Session 28 call 1: the fp8 tensor-core GEMV (kernels/fp8_mma.py): its GPU tests (small shapes through mma.sync,
# real sizes, persistent grids), benchmarks/fp8_mma_bench.py, the CUDA-core fp8 loops at the same occupancy
# (stream_probe points), then issue 5's same-run peer (HF static cache + torch.compile) beside our graph backend.
R=/tmp/s28a; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s28a.tgz -C /tmp s28a; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -2 $R/env.log; export PYTHONPATH=/tmp/site KIE_GPU_TESTS=1; pk
timeout 150 python3 -m pytest tests/kernels/test_fp8_mma.py -q -p no:cacheprovider -o addopts="" -m "gpu or not gpu" >$R/test_fp8_mma.log 2>&1; echo "test_fp8_mma rc=$?"; tail -3 $R/test_fp8_mma.log; pk
(cd benchmarks && timeout 150 python3 fp8_mma_bench.py --out $R/fp8-mma.json) >$R/fp8-mma.log 2>&1; echo "bench rc=$?"; grep -o '"name": "[^"]*".*pct_of_probe": [0-9.]*' $R/fp8-mma.log | sed 's/"first_call_s.*"gbps"/ gbps/'; pk
(cd benchmarks && timeout 90 python3 stream_probe.py --only 0,4,8,27,28,29,44,45 --out $R/stream-probe.json) >$R/stream-probe.log 2>&1; echo "probe rc=$?"; cut -c1-200 $R/stream-probe.log; pk
timeout 200 python3 benchmarks/peers.py --arch qwen3-30b-a3b --modes compile --ours-schemes bf16,fp8 --out $R/peers.json --budget-s 190 >$R/peers.log 2>&1; echo "peers rc=$?"; tail -8 $R/peers.log; pk

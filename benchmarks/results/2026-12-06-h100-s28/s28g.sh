#!/bin/bash
# Session 28 call 7: A/B of the two hoisted loads (KIE_SELECT_LOADS_FIRST, KIE_RSTD_EARLY; both on by default), each
# row its own process; their GPU tests; graph parity bf16 with both on.
R=/tmp/s28g; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s28g.tgz -C /tmp s28g; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
g() { n=$1; arch=$2; shift 2; env "$@" timeout 100 python3 benchmarks/graph_bench.py --runs $arch --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log | cut -c1-100; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-200; export PYTHONPATH=/tmp/site KIE_GPU_TESTS=1; pk
g q qwen3-30b-a3b:fp8 X=1
g qs0 qwen3-30b-a3b:fp8 KIE_SELECT_LOADS_FIRST=0
g qr0 qwen3-30b-a3b:fp8 KIE_RSTD_EARLY=0
g l llama-3.2-1b:bf16 X=1
g lr0 llama-3.2-1b:bf16 KIE_RSTD_EARLY=0
g qb qwen3-30b-a3b:fp8 X=1
timeout 60 python3 -m pytest tests/kernels/test_gemv.py tests/kernels/test_moe.py -q -p no:cacheprovider -o addopts="" -m "gpu or not gpu" -k "rstd_early or route or select or deferred or test_gemv" -x >$R/tests.log 2>&1; echo "tests rc=$?"; tail -2 $R/tests.log; pk
mkdir -p $R/par; scripts/gpu-check $R/par parity | grep -E "rc=|passed|failed"; pk

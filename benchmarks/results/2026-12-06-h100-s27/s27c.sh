#!/bin/bash
# Session 27 call 3: KIE_GEMV_ACCUM (split-K q/k/v, o_proj and dense down adding with atomics) A/B on qwen3-30b-a3b
# fp8 and llama-3.2-1b bf16, K steps per program 2 (default) and 1; its kernel tests and graph parity on the GPU.
R=/tmp/s27c; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s27c.tgz -C /tmp s27c; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
g() { n=$1; arch=$2; shift 2; env "$@" timeout 120 python3 benchmarks/graph_bench.py --runs $arch --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -2 $R/env.log; export PYTHONPATH=/tmp/site KIE_GPU_TESTS=1; pk
g base qwen3-30b-a3b:fp8 X=0
g acc qwen3-30b-a3b:fp8 KIE_GEMV_ACCUM=1
g acc1 qwen3-30b-a3b:fp8 KIE_GEMV_ACCUM=1 KIE_GEMV_ACCUM_STEPS=1
g lbase llama-3.2-1b:bf16 X=0
g lacc llama-3.2-1b:bf16 KIE_GEMV_ACCUM=1
timeout 100 python3 -m pytest tests/kernels/test_gemv.py tests/kernels/test_moe.py -q -p no:cacheprovider -o addopts="" --timeout=90 -k "accumulat or glu_side" >$R/test-accum.log 2>&1; echo "accum tests rc=$?"; tail -2 $R/test-accum.log; pk
mkdir -p $R/par; KIE_GEMV_ACCUM=1 scripts/gpu-check $R/par parity | grep -E "===|rc=|passed|failed"; pk
g acc2 qwen3-30b-a3b:fp8 KIE_GEMV_ACCUM=1
g base2 qwen3-30b-a3b:fp8 X=0

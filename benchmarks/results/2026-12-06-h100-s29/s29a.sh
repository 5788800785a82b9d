#!/bin/bash
# Session 29 call 1: first GPU run of the monokernel's fp8 tensor-core tasks (KIE_MONO_FP8_MMA): the task tests and
# whole-step tests on the GPU, graph_bench monokernel with it on (beside the graph backend's tokens), on without the
# down task, off.
R=/tmp/s29a; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s29a.tgz -C /tmp s29a; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
g() { n=$1; arch=$2; be=$3; shift 3; env "$@" timeout 170 python3 benchmarks/graph_bench.py --runs $arch --backends $be --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log | cut -c1-160; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-300; export PYTHONPATH=/tmp/site; pk
KIE_GPU_TESTS=1 timeout 200 python3 -m pytest tests/monokernel/test_mma8.py -q -p no:cacheprovider -o addopts="" -m "gpu or not gpu" --maxfail=5 >$R/test_mma8.log 2>&1; echo "test_mma8 rc=$?"; tail -3 $R/test_mma8.log | cut -c1-300; pk
g m1q qwen3-30b-a3b:fp8 graph,monokernel KIE_MONO_FP8_MMA=1
g m1dq qwen3-30b-a3b:fp8 monokernel KIE_MONO_FP8_MMA=1 KIE_MONO_FP8_MMA_DOWN=0
g m0q qwen3-30b-a3b:fp8 monokernel KIE_MONO_FP8_MMA=0

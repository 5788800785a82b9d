#!/bin/bash
# Session 29 call 3: whole decode steps of the tensor-core tasks on the GPU (fp8 on an fp32 arena, W16 on a bf16
# arena), llama-3.2-1b bf16 with KIE_MONO_W16_MMA on / off and fp8 with KIE_MONO_FP8_MMA (now with the dense MLP),
# then qwen3-30b-a3b fp8 with KIE_MONO_FP8_MMA=1: the per-op trace.
R=/tmp/s29c; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s29c.tgz -C /tmp s29c; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
g() { n=$1; arch=$2; be=$3; shift 3; env "$@" timeout 150 python3 benchmarks/graph_bench.py --runs $arch --backends $be --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log | cut -c1-160; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-300; export PYTHONPATH=/tmp/site; pk
KIE_GPU_TESTS=1 timeout 150 python3 -m pytest tests/monokernel/test_mma8.py -q -p no:cacheprovider -o addopts="" -m "gpu or not gpu" -k tensor_cores >$R/test_mma8.log 2>&1; echo "test_mma8 rc=$?"; grep -E "passed|failed|^FAILED|^E  " $R/test_mma8.log | head -12 | cut -c1-200; pk
g w1l llama-3.2-1b:bf16 monokernel KIE_MONO_W16_MMA=1
g w0l llama-3.2-1b:bf16 monokernel KIE_MONO_W16_MMA=0
g m1l llama-3.2-1b:fp8 monokernel KIE_MONO_FP8_MMA=1
KIE_MONO_FP8_MMA=1 timeout 120 python3 benchmarks/monokernel_bench.py --archs qwen3-30b-a3b --formats fp8 --trace 4 --no-breakdown --reps 3 --out $R/mk-trace.json >$R/mk-trace.log 2>&1; echo "trace rc=$?"; tail -30 $R/mk-trace.log | cut -c1-200; pk

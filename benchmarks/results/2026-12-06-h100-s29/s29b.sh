#!/bin/bash
# Session 29 call 2 (same machine, warm): llama-3.2-1b fp8 monokernel with KIE_MONO_FP8_MMA on / off, the phased fp8-mma stream_probe points beside the CUDA-core ones, then
# KIE_EPILOGUE_EARLY's A/B on the graph backend.
R=/tmp/s29b; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s29b.tgz -C /tmp s29b; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
g() { n=$1; arch=$2; be=$3; shift 3; env "$@" timeout 170 python3 benchmarks/graph_bench.py --runs $arch --backends $be --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log | cut -c1-160; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-300; export PYTHONPATH=/tmp/site; pk
g m1l llama-3.2-1b:fp8 monokernel KIE_MONO_FP8_MMA=1
g m0l llama-3.2-1b:fp8 monokernel KIE_MONO_FP8_MMA=0
timeout 120 python3 benchmarks/stream_probe.py --only 65,66,67,68,69,70,71,72,73,39,40,41 --out $R/stream-probe.json >$R/stream-probe.log 2>&1; echo "probe rc=$?"; tail -16 $R/stream-probe.log | cut -c1-160; pk
g e1q qwen3-30b-a3b:fp8 graph KIE_EPILOGUE_EARLY=1
g e0q qwen3-30b-a3b:fp8 graph KIE_EPILOGUE_EARLY=0
g e1l llama-3.2-1b:bf16 graph KIE_EPILOGUE_EARLY=1
g e0l llama-3.2-1b:bf16 graph KIE_EPILOGUE_EARLY=0

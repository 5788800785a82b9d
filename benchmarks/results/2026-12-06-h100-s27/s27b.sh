#!/bin/bash
# Session 27 call 2: what one launch boundary costs inside the graph step (KIE_GRAPH_EXTRA_LAUNCHES=N,G: N empty PDL
# launches of G programs after every layer's attention; measurement only), the lm_head in fp8 (fp8+head) beside
# fp8, and the router tests on the GPU (the softmax-on-picks test now on the ordered down). Packed after every stage.
R=/tmp/s27b; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s27b.tgz -C /tmp s27b; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
g() { n=$1; arch=$2; shift 2; env "$@" timeout 120 python3 benchmarks/graph_bench.py --runs $arch --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -2 $R/env.log; export PYTHONPATH=/tmp/site KIE_GPU_TESTS=1; pk
g base qwen3-30b-a3b:fp8 X=0
g e1 qwen3-30b-a3b:fp8 KIE_GRAPH_EXTRA_LAUNCHES=1,1
g e4 qwen3-30b-a3b:fp8 KIE_GRAPH_EXTRA_LAUNCHES=4,1
g e1w qwen3-30b-a3b:fp8 KIE_GRAPH_EXTRA_LAUNCHES=1,132
g head qwen3-30b-a3b:fp8+head X=0
g lbase llama-3.2-1b:bf16 X=0
g le1 llama-3.2-1b:bf16 KIE_GRAPH_EXTRA_LAUNCHES=1,1
timeout 150 python3 -m pytest tests/kernels/test_moe.py -q -p no:cacheprovider -o addopts="" --timeout=100 -k "softmax or route" >$R/test_moe.log 2>&1; echo "test_moe rc=$?"; tail -3 $R/test_moe.log; pk
g base2 qwen3-30b-a3b:fp8 X=0

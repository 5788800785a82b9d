#!/bin/bash
# Session 27 call 5 (short: ~260 s of budget left): KIE_QKV_ATTN's kernel tests on the GPU (memory ordering across
# programs), then the graph A/B on qwen3-30b-a3b fp8 and llama-3.2-1b bf16.
R=/tmp/s27e; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s27e.tgz -C /tmp s27e; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
g() { n=$1; arch=$2; shift 2; env "$@" timeout 60 python3 benchmarks/graph_bench.py --runs $arch --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; export PYTHONPATH=/tmp/site KIE_GPU_TESTS=1; pk
timeout 60 python3 -m pytest tests/kernels/test_qkv_attention.py -q -p no:cacheprovider -o addopts="" >$R/test-qkv-attn.log 2>&1; echo "qkv_attention tests rc=$?"; tail -2 $R/test-qkv-attn.log; pk
g qa qwen3-30b-a3b:fp8 KIE_QKV_ATTN=1
g base qwen3-30b-a3b:fp8 X=0
g lqa llama-3.2-1b:bf16 KIE_QKV_ATTN=1
g lbase llama-3.2-1b:bf16 X=0

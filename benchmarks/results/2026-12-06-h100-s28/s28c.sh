#!/bin/bash
# Session 28 call 3: A/B of the attention launch's loads before pos (KIE_ATTN_LOADS_FIRST=1, the new default, vs 0),
# each row its own process; the rope / attention tests on the GPU (all of them); graph parity bf16.
R=/tmp/s28c; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s28c.tgz -C /tmp s28c; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
g() { n=$1; arch=$2; shift 2; env "$@" timeout 120 python3 benchmarks/graph_bench.py --runs $arch --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log | cut -c1-160; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -2 $R/env.log; export PYTHONPATH=/tmp/site KIE_GPU_TESTS=1; pk
g q1 qwen3-30b-a3b:fp8 KIE_ATTN_LOADS_FIRST=1
g q0 qwen3-30b-a3b:fp8 KIE_ATTN_LOADS_FIRST=0
g l1 llama-3.2-1b:bf16 KIE_ATTN_LOADS_FIRST=1
g l0 llama-3.2-1b:bf16 KIE_ATTN_LOADS_FIRST=0
g q0b qwen3-30b-a3b:fp8 KIE_ATTN_LOADS_FIRST=0
g q1b qwen3-30b-a3b:fp8 KIE_ATTN_LOADS_FIRST=1
timeout 100 python3 -m pytest tests/kernels/test_rope.py tests/kernels/test_attention.py -q -p no:cacheprovider -o addopts="" -m "gpu or not gpu" >$R/test_attn.log 2>&1; echo "attn tests rc=$?"; tail -3 $R/test_attn.log; pk
mkdir -p $R/par; scripts/gpu-check $R/par parity | grep -E "===|rc=|passed|failed"; pk

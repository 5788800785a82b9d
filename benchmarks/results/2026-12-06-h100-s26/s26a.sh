#!/bin/bash
# Session 26 call 1: the atomic down through the GPU parity stages and the MoE kernel tests, then layer / graph
# rows with and without it, then gpt-oss's GLU cap with 4 picks per round. Packed after every stage.
R=/tmp/s26a; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s26a.tgz -C /tmp s26a; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
lay() { n=$1; shift; mkdir -p $R/lay-$n; env "$@" scripts/gpu-check $R/lay-$n layer:qwen3-30b-a3b:fp8 | grep -E "rc=|folded in|q/k/v|=>"; pk; }
g() { n=$1; shift; env "$@" timeout 120 python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:fp8 --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -2 $R/env.log; export PYTHONPATH=/tmp/site KIE_GPU_TESTS=1; pk
mkdir -p $R/atomic; KIE_EXPERT_DOWN_ATOMIC=1 scripts/gpu-check $R/atomic parity parity-quant | grep -E "===|rc=|passed|failed|graph parity"; pk
KIE_EXPERT_DOWN_ATOMIC=1 timeout 200 python3 -m pytest -m gpu tests/kernels/test_moe.py -q -p no:cacheprovider -o addopts="" --timeout=120 >$R/atomic/test_moe.log 2>&1; echo "test_moe rc=$?"; tail -3 $R/atomic/test_moe.log; pk
lay base X=0; lay atomic KIE_EXPERT_DOWN_ATOMIC=1
g base X=0; g atomic KIE_EXPERT_DOWN_ATOMIC=1
for v in 0 1; do mkdir -p $R/cap$v; KIE_EXPERT_DOWN_ATOMIC=1 KIE_EXPERT_GLU_CAP=$v scripts/gpu-check $R/cap$v layer:gpt-oss-120b:mxfp4-experts | grep -E "rc=|experts|=>"; pk; done
g base2 X=0

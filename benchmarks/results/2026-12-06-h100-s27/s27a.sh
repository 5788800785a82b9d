#!/bin/bash
# Session 27 call 1: graph A/B of the one-warp fp8 expert tiles (KIE_EXPERT_WARPS=1) and of the softmax router's
# top-k on the logits (KIE_ROUTER_SOFTMAX_ON_PICKS, on; =0 the base), each row its own process; the layer rows of
# the three settings; the router tests on the GPU; parity-quant / parity-fp32 with this session's defaults; the demo
# (the main job) through --backend auto, now the graph backend. Packed after every stage.
R=/tmp/s27a; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s27a.tgz -C /tmp s27a; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
lay() { n=$1; shift; mkdir -p $R/lay-$n; env "$@" scripts/gpu-check $R/lay-$n layer:qwen3-30b-a3b:fp8 | grep -E "rc=|folded in|q/k/v|top-k|down|=>"; pk; }
g() { n=$1; arch=$2; shift 2; env "$@" timeout 120 python3 benchmarks/graph_bench.py --runs $arch --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -2 $R/env.log; export PYTHONPATH=/tmp/site KIE_GPU_TESTS=1; pk
g base qwen3-30b-a3b:fp8 X=0
g w1 qwen3-30b-a3b:fp8 KIE_EXPERT_WARPS=1
g sm0 qwen3-30b-a3b:fp8 KIE_ROUTER_SOFTMAX_ON_PICKS=0
g base2 qwen3-30b-a3b:fp8 X=0
lay base X=0; lay w1 KIE_EXPERT_WARPS=1; lay sm0 KIE_ROUTER_SOFTMAX_ON_PICKS=0
timeout 120 python3 -m pytest -m gpu tests/kernels/test_moe.py -q -p no:cacheprovider -o addopts="" --timeout=100 -k "route or softmax or deferred or per_round" >$R/test_moe.log 2>&1; echo "test_moe rc=$?"; tail -2 $R/test_moe.log; pk
mkdir -p $R/par; scripts/gpu-check $R/par parity-quant parity-fp32 | grep -E "===|rc=|passed|failed"; pk
timeout 150 python3 -m kie_moe.cli demo --out $R/demo >$R/demo.log 2>&1; echo "demo rc=$?"; tail -12 $R/demo.log; pk
g w1b qwen3-30b-a3b:fp8 KIE_EXPERT_WARPS=1

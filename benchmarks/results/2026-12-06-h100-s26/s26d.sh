#!/bin/bash
# Session 26 call 4: the graph step's tail in one launch + the pinned host ring (KIE_GRAPH_STEP_TAIL, default on)
# against the torch tail + per-step copy (=0): graph A/B qwen3-30b-a3b fp8 and llama-3.2-1b bf16, the tail's kernel
# test and graph parity (bf16) on the GPU, a same-run HF compile peer, the qwen3 A/B again in the other order.
R=/tmp/s26d; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s26d.tgz -C /tmp s26d; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
g() { n=$1; arch=$2; shift 2; env "$@" timeout 120 python3 benchmarks/graph_bench.py --runs $arch --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -2 $R/env.log; export PYTHONPATH=/tmp/site KIE_GPU_TESTS=1; pk
g q1 qwen3-30b-a3b:fp8 KIE_GRAPH_STEP_TAIL=1
g q0 qwen3-30b-a3b:fp8 KIE_GRAPH_STEP_TAIL=0
g l1 llama-3.2-1b:bf16 KIE_GRAPH_STEP_TAIL=1
g l0 llama-3.2-1b:bf16 KIE_GRAPH_STEP_TAIL=0
timeout 60 python3 -m pytest tests/kernels/test_sampling_kernel.py -q -p no:cacheprovider -o addopts="" -k "next_step or ring or reproducible" >$R/sampling-gpu.log 2>&1; echo "sampling tests rc=$?"; tail -2 $R/sampling-gpu.log; pk
mkdir -p $R/tail; scripts/gpu-check $R/tail parity | grep -E "===|rc=|passed|failed"; pk
timeout 200 python3 benchmarks/peers.py --arch qwen3-30b-a3b --modes compile --ours-schemes bf16,fp8 --out $R/peers-qwen3-30b-a3b.json --budget-s 190 >$R/peers.log 2>&1; echo "peers rc=$?"; tail -5 $R/peers.log; pk
g q0b qwen3-30b-a3b:fp8 KIE_GRAPH_STEP_TAIL=0
g q1b qwen3-30b-a3b:fp8 KIE_GRAPH_STEP_TAIL=1

#!/bin/bash
# Session 25: per-launch rows of each opt-in flag vs the base, graph A/B (qwen3-30b-a3b fp8), the mxfp4 GLU cap.
# Ordered by priority; packed after every stage so a cut run keeps what it measured.
R=/tmp/s25a; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s25a.tgz -C /tmp s25a; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
lay() { mkdir -p $R/$1; env $1 scripts/gpu-check $R/$1 layer:qwen3-30b-a3b:fp8 | grep -E "rc=|folded in|q/k/v|=>"; pk; }
g() { n=$1; shift; env "$@" timeout 120 python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:fp8 --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log; pk; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -3 $R/env.log; export PYTHONPATH=/tmp/site; pk
lay X=0; lay KIE_EXPERT_DOWN_ATOMIC=1; lay KIE_RSTD_ONE_LOAD=1; lay KIE_TOPK_PER_ROUND=4; lay KIE_TOPK_PER_ROUND=2
g base X=0; g atomic KIE_EXPERT_DOWN_ATOMIC=1; g rstd KIE_RSTD_ONE_LOAD=1; g pr4 KIE_TOPK_PER_ROUND=4; g all3 KIE_EXPERT_DOWN_ATOMIC=1 KIE_RSTD_ONE_LOAD=1 KIE_TOPK_PER_ROUND=4
for v in 0 1; do mkdir -p $R/cap$v; KIE_EXPERT_GLU_CAP=$v scripts/gpu-check $R/cap$v layer:gpt-oss-120b:mxfp4-experts | grep -E "rc=|experts|=>"; pk; done
lay KIE_EXPERT_DOWN_UNROLL=3; lay KIE_GEMV_UNROLL=2; lay KIE_EXPERT_GLU_UNROLL=2
g base2 X=0

#!/bin/bash
# Session 28 call 5: issue 6's ratio today: the monokernel beside the graph backend in the same process (graph_bench
# --backends graph,monokernel), qwen3-30b-a3b fp8 and llama-3.2-1b bf16.
R=/tmp/s28e; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s28e.tgz -C /tmp s28e; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-300; export PYTHONPATH=/tmp/site; pk
for a in llama-3.2-1b:bf16 qwen3-30b-a3b:fp8; do timeout 200 python3 benchmarks/graph_bench.py --runs $a --backends graph,monokernel --out $R/gm-${a%%:*}.json >$R/gm-${a%%:*}.log 2>&1; echo "$a rc=$?"; grep "tok/s" $R/gm-${a%%:*}.log | cut -c1-160; pk; done

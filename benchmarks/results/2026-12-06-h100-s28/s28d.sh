#!/bin/bash
# Session 28 call 4: issue 5's same-run peer (HF static cache + torch.compile, bf16) beside our graph backend fp8 and
# bf16 with the attention loads-first default (call 3: qwen3-30b-a3b fp8 +1.2%).
R=/tmp/s28d; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s28d.tgz -C /tmp s28d; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-300; export PYTHONPATH=/tmp/site; pk
timeout 330 python3 benchmarks/peers.py --arch qwen3-30b-a3b --modes compile --ours-schemes fp8,bf16 --out $R/peers.json --budget-s 320 >$R/peers.log 2>&1; echo "peers rc=$?"; tail -5 $R/peers.log; pk

#!/bin/bash
# Session 26 call 3: KIE_EARLY_OPROJ (attention releases o_proj early; o_proj prefetches its weights to L2 before its
# PDL wait). Graph A/B on qwen3-30b-a3b fp8 first; the parity stages with the flag only if it won; a same-run HF
# compile peer with the better setting; llama-3.2-1b bf16 A/B; the qwen3 A/B again in the other order (drift).
R=/tmp/s26c; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s26c.tgz -C /tmp s26c; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
g() { n=$1; arch=$2; shift 2; env "$@" timeout 120 python3 benchmarks/graph_bench.py --runs $arch --out $R/graph-$n.json >$R/graph-$n.log 2>&1; echo "graph $n rc=$?"; grep "tok/s" $R/graph-$n.log; pk; }
tps() { python3 -c "import json,sys; print(json.load(open('$R/graph-$1.json'))['rows'][0]['tok_per_s'])" 2>/dev/null || echo 0; }
scripts/gpu-check $R env >/dev/null 2>&1; tail -2 $R/env.log; export PYTHONPATH=/tmp/site KIE_GPU_TESTS=1; pk
g q0 qwen3-30b-a3b:fp8 KIE_EARLY_OPROJ=0
g q1 qwen3-30b-a3b:fp8 KIE_EARLY_OPROJ=1
W=$(python3 -c "print(1 if $(tps q1) > $(tps q0) else 0)"); echo "better: KIE_EARLY_OPROJ=$W"
if [ "$W" = 1 ]; then mkdir -p $R/early; KIE_EARLY_OPROJ=1 scripts/gpu-check $R/early parity parity-quant | grep -E "===|rc=|passed|failed"; pk; fi
KIE_EARLY_OPROJ=$W timeout 240 python3 benchmarks/peers.py --arch qwen3-30b-a3b --modes compile --ours-schemes bf16,fp8 --out $R/peers-qwen3-30b-a3b.json --budget-s 230 >$R/peers.log 2>&1; echo "peers rc=$?"; tail -7 $R/peers.log; pk
g l0 llama-3.2-1b:bf16 KIE_EARLY_OPROJ=0
g l1 llama-3.2-1b:bf16 KIE_EARLY_OPROJ=1
g q1b qwen3-30b-a3b:fp8 KIE_EARLY_OPROJ=1
g q0b qwen3-30b-a3b:fp8 KIE_EARLY_OPROJ=0

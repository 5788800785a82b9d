#!/bin/bash
# Session 32 call 2: the new defaults (KIE_MONO_FP8_MMA=1, KIE_DOWN_L2=1) on qwen3-30b-a3b fp8; when a task claims
# its successor (KIE_CLAIM=wait / late against ahead; tokens must equal the base's) and a trace of one; the GPU
# whole-step tests with the new defaults; the graph backend on the same machine (issue 6's ratio).
R=/tmp/s32b; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s32b.tgz -C /tmp s32b; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
left() { echo $(( 560 - ($(date +%s) - T0) )); }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-160; export PYTHONPATH=/tmp/site
mk() { # name arch fmt env...
  n=$1; a=$2; f=$3; shift 3; t=$(left); [ $t -gt 40 ] || { echo "skip $n"; return; }; [ $t -gt 75 ] && t=75
  env "$@" timeout $t python3 benchmarks/monokernel_bench.py --archs $a --formats $f --no-breakdown --reps 3 $XA --out $R/mk-$n.json >$R/mk-$n.log 2>&1; echo "$n rc=$?"
  grep -o '"tok_per_s": [0-9.]*\|"tokens_sample": [^]]*' $R/mk-$n.log | tr '\n' ' '; echo; pk; }
mk base qwen3-30b-a3b fp8
mk wait qwen3-30b-a3b fp8 KIE_CLAIM=wait
mk late qwen3-30b-a3b fp8 KIE_CLAIM=late
XA="--trace 4" mk twait qwen3-30b-a3b fp8 KIE_CLAIM=wait
tail -14 $R/mk-twait.log | grep -v '^{' | cut -c1-160
t=$(left); if [ $t -gt 60 ]; then [ $t -gt 80 ] && t=80
  timeout $t python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:fp8 --backends graph --out $R/graph-q.json >$R/graph-q.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph-q.log | cut -c1-160; pk; fi
t=$(left); if [ $t -gt 40 ]; then [ $t -gt 150 ] && t=150
  KIE_GPU_TESTS=1 timeout $t python3 -m pytest tests/monokernel/test_monokernel_gpu.py tests/monokernel/test_trace.py -q -p no:cacheprovider -o addopts="" -m gpu -k "quantized or tiny or watchdog or traced or real_size_parity" >$R/test-gpu.log 2>&1; echo "tests rc=$?"; grep -E "passed|failed|^FAILED|Error" $R/test-gpu.log | head -8 | cut -c1-200; pk; fi
mk lwait llama-3.2-1b fp8 KIE_CLAIM=wait
mk lbase llama-3.2-1b fp8
pk

#!/bin/bash
# Session 32 call 1: qwen3-30b-a3b fp8 monokernel -- the fp8 flag's build (KIE_MONO_FP8_MMA=1) as the base, the
# down rows prefetched into L2 by the expert gate / up tasks (KIE_DOWN_L2=1; its tokens must equal the base's), its
# trace (the down task's pre), the flag off (is the flag the better default?), KIE_DOWN_L2 with the top-k once;
# llama-3.2-1b fp8 with the flag on / off.
R=/tmp/s32a; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s32a.tgz -C /tmp s32a; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
left() { echo $(( 560 - ($(date +%s) - T0) )); }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-160; export PYTHONPATH=/tmp/site
mk() { # name arch fmt env...
  n=$1; a=$2; f=$3; shift 3; t=$(left); [ $t -gt 40 ] || { echo "skip $n"; return; }; [ $t -gt 75 ] && t=75
  env "$@" timeout $t python3 benchmarks/monokernel_bench.py --archs $a --formats $f --no-breakdown --reps 3 $XA --out $R/mk-$n.json >$R/mk-$n.log 2>&1; echo "$n rc=$?"
  grep -o '"tok_per_s": [0-9.]*\|"tokens_sample": [^]]*' $R/mk-$n.log | tr '\n' ' '; echo; pk; }
mk base qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1
mk dl2 qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_DOWN_L2=1
XA="--trace 4" mk trace qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_DOWN_L2=1
tail -14 $R/mk-trace.log | grep -v '^{' | cut -c1-160
mk off qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=0
mk lon llama-3.2-1b fp8 KIE_MONO_FP8_MMA=1
mk loff llama-3.2-1b fp8 KIE_MONO_FP8_MMA=0
mk dl2once qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_DOWN_L2=1 KIE_ROUTE_ONCE=1
XA="--trace 4" mk tbase qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1
tail -14 $R/mk-tbase.log | grep -v '^{' | cut -c1-160
pk

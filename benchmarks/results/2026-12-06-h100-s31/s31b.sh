#!/bin/bash
# Session 31 call 2 (ieee attention dots, the default): qwen3-30b-a3b fp8 monokernel with KIE_MONO_FP8_MMA=1 -- the
# base, the top-k picked once per layer (KIE_ROUTE_ONCE=1: its tokens must equal the base's), 4 pieces, both, the
# per-op trace with the top-k once, the blocked staging.
R=/tmp/s31b; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s31b.tgz -C /tmp s31b; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
left() { echo $(( 285 - ($(date +%s) - T0) )); }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-160; export PYTHONPATH=/tmp/site
mk() { # name env...
  n=$1; shift; t=$(left); [ $t -gt 40 ] || { echo "skip $n"; return; }; [ $t -gt 70 ] && t=70
  env KIE_MONO_FP8_MMA=1 "$@" timeout $t python3 benchmarks/monokernel_bench.py --archs qwen3-30b-a3b --formats fp8 --no-breakdown --reps 3 $XA --out $R/mk-$n.json >$R/mk-$n.log 2>&1; echo "$n rc=$?"
  grep -o '"tok_per_s": [0-9.]*\|"tokens_sample": [^]]*' $R/mk-$n.log | tr '\n' ' '; echo; pk; }
mk base KIE_ATTN_DOT=ieee
mk once KIE_ROUTE_ONCE=1
mk p4 KIE_MMA8_PIECES=4
mk both KIE_ROUTE_ONCE=1 KIE_MMA8_PIECES=4
XA="--trace 4" mk trace KIE_ROUTE_ONCE=1
tail -12 $R/mk-trace.log | grep -v '^{' | cut -c1-160
mk loop KIE_MMA8_STAGE=loop
pk

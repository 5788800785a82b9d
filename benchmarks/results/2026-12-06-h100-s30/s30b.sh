#!/bin/bash
# Session 30 call 2: attention's dots on the tensor cores (KIE_ATTN_DOT=tf32x3) -- the task alone
# (attention_task_micro.py), qwen3-30b-a3b fp8 monokernel (KIE_MONO_FP8_MMA=1) with / without it (8 KB splits, the
# default since this session's first command), the GPU whole-step tests with it, llama-3.2-1b bf16 with / without it.
R=/tmp/s30b; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s30b.tgz -C /tmp s30b; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
left() { echo $(( 225 - ($(date +%s) - T0) )); }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-120; export PYTHONPATH=/tmp/site
timeout 60 python3 benchmarks/attention_task_micro.py --out $R/attn-micro.json >$R/attn-micro.log 2>&1; echo "micro rc=$?"
grep -o '"pos": [0-9]*\|"others": "[a-z+]*"\|"prec": "[a-z0-9]*"\|"n_splits": [0-9]*\|"block_t": [0-9]*\|"num_warps": [0-9]*\|"us_per_task": [0-9.]*\|error' $R/attn-micro.log | tr '\n' ' ' | sed 's/"pos"/\n"pos"/g'; echo; pk
mk() { # name arch fmt env...
  n=$1; a=$2; f=$3; shift 3; t=$(left); [ $t -gt 45 ] || { echo "skip $n"; return; }; [ $t -gt 70 ] && t=70
  env "$@" timeout $t python3 benchmarks/monokernel_bench.py --archs $a --formats $f --no-breakdown --reps 3 --out $R/mk-$n.json >$R/mk-$n.log 2>&1; echo "$n rc=$?"
  grep -o '"tok_per_s": [0-9.]*\|"n_splits": [0-9]*\|"tokens_sample": [^]]*' $R/mk-$n.log | tr '\n' ' '; echo; pk; }
mk t3 qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_ATTN_DOT=tf32x3
mk i3 qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_ATTN_DOT=ieee
t=$(left); if [ $t -gt 40 ]; then [ $t -gt 80 ] && t=80
  KIE_ATTN_DOT=tf32x3 KIE_GPU_TESTS=1 timeout $t python3 -m pytest tests/monokernel/test_monokernel_gpu.py -q -p no:cacheprovider -o addopts="" -m "gpu or not gpu" -k "tiny_families" >$R/test-tf32x3.log 2>&1; echo "tests rc=$?"; tail -3 $R/test-tf32x3.log; pk; fi
mk lt3 llama-3.2-1b bf16 KIE_ATTN_DOT=tf32x3
mk l0 llama-3.2-1b bf16 KIE_ATTN_DOT=ieee
pk

#!/bin/bash
# Session 31 call 1: session 30's s30b stages (attention's dots on the tensor cores, KIE_ATTN_DOT=tf32x3: the task
# alone, qwen3-30b-a3b fp8 monokernel with KIE_MONO_FP8_MMA=1, the GPU whole-step tests, llama-3.2-1b bf16), then
# the one-shot input staging (KIE_MMA8_STAGE=loop: the old blocked passes), KIE_MMA8_PIECES=4, the expert gate / up in one wave
# (KIE_TASK_KB=exp_up:256), the rank top-k (KIE_ROUTE_RANK=1) and 2 programs per SM (qwen3 fp8, fp8 flag, tf32x3), qwen3's per-op trace (with the new
# pre / mid stamps) with tf32x3 and the graph backend on the same machine (issue 6's ratio).
R=/tmp/s31a; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s31a.tgz -C /tmp s31a; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
left() { echo $(( 555 - ($(date +%s) - T0) )); }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-160; export PYTHONPATH=/tmp/site
timeout 60 python3 benchmarks/attention_task_micro.py --out $R/attn-micro.json >$R/attn-micro.log 2>&1; echo "micro rc=$?"
grep -o '"pos": [0-9]*\|"others": "[a-z+]*"\|"prec": "[a-z0-9]*"\|"n_splits": [0-9]*\|"block_t": [0-9]*\|"num_warps": [0-9]*\|"us_per_task": [0-9.]*\|error' $R/attn-micro.log | tr '\n' ' ' | sed 's/"pos"/\n"pos"/g'; echo; tail -3 $R/attn-micro.log | cut -c1-200; pk
mk() { # name arch fmt env...
  n=$1; a=$2; f=$3; shift 3; t=$(left); [ $t -gt 45 ] || { echo "skip $n"; return; }; [ $t -gt 75 ] && t=75
  env "$@" timeout $t python3 benchmarks/monokernel_bench.py --archs $a --formats $f --no-breakdown --reps 3 $XA --out $R/mk-$n.json >$R/mk-$n.log 2>&1; echo "$n rc=$?"
  grep -o '"tok_per_s": [0-9.]*\|"n_splits": [0-9]*\|"tokens_sample": [^]]*' $R/mk-$n.log | tr '\n' ' '; echo; pk; }
mk t3 qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_ATTN_DOT=tf32x3
mk i3 qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_ATTN_DOT=ieee
mk sl qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_ATTN_DOT=tf32x3 KIE_MMA8_STAGE=loop
mk p4 qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_ATTN_DOT=tf32x3 KIE_MMA8_PIECES=4
mk k256 qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_ATTN_DOT=tf32x3 KIE_TASK_KB=exp_up:256
t=$(left); if [ $t -gt 60 ]; then [ $t -gt 100 ] && t=100
  KIE_MONO_FP8_MMA=1 KIE_ATTN_DOT=tf32x3 timeout $t python3 benchmarks/monokernel_bench.py --archs qwen3-30b-a3b --formats fp8 --trace 4 --no-breakdown --reps 3 --out $R/mk-trace.json >$R/mk-trace.log 2>&1; echo "trace rc=$?"; tail -14 $R/mk-trace.log | cut -c1-200; pk; fi
t=$(left); if [ $t -gt 40 ]; then [ $t -gt 110 ] && t=110
  KIE_ATTN_DOT=tf32x3 KIE_GPU_TESTS=1 timeout $t python3 -m pytest tests/monokernel/test_mma8.py tests/monokernel/test_trace.py tests/monokernel/test_monokernel_gpu.py -q -p no:cacheprovider -o addopts="" -m "gpu or not gpu" -k "fp8_tasks_on_the_tensor_cores and (qwen2_moe or qwen3_moe_norm-attn) or gpu_traced or tiny_families" >$R/test-tf32x3.log 2>&1; echo "tests rc=$?"; grep -E "passed|failed|^FAILED" $R/test-tf32x3.log | head -8 | cut -c1-200; pk; fi
t=$(left); if [ $t -gt 50 ]; then [ $t -gt 80 ] && t=80
  timeout $t python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:fp8 --backends graph --out $R/graph-q.json >$R/graph-q.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph-q.log | cut -c1-160; pk; fi
mk rk qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_ATTN_DOT=tf32x3 KIE_ROUTE_RANK=1
mk lt3 llama-3.2-1b bf16 KIE_ATTN_DOT=tf32x3
mk l0 llama-3.2-1b bf16 KIE_ATTN_DOT=ieee
XA="--programs-per-sm 2" mk p2 qwen3-30b-a3b fp8 KIE_MONO_FP8_MMA=1 KIE_ATTN_DOT=tf32x3
pk

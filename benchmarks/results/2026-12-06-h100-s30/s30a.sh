#!/bin/bash
# Session 30 call 1: the monokernel's attention task alone under four surroundings (attention_task_micro.py), then
# qwen3-30b-a3b fp8 monokernel (KIE_MONO_FP8_MMA=1) with the waiting programs' poll as is / thread 0 only
# (KIE_WAIT_ONE=1) / with a 100 ns sleep between polls (KIE_WAIT_SLEEP_NS=100), then the GPU whole-step tests
# with both; and attention splits of 8 KB (KIE_ATTN_SPLIT_KB=8: 10 tasks per kv head at 160 positions).
R=/tmp/s30a; mkdir -p $R; T0=$(date +%s)
pk() { tar czf $OUT/s30a.tgz -C /tmp s30a; echo "[t=$(( $(date +%s) - T0 ))s] packed"; }
left() { echo $(( 400 - ($(date +%s) - T0) )); }
scripts/gpu-check $R env >/dev/null 2>&1; tail -1 $R/env.log | cut -c1-200; export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
timeout 110 python3 benchmarks/attention_task_micro.py --out $R/attn-micro.json >$R/attn-micro.log 2>&1; echo "micro rc=$?"
cut -c1-230 $R/attn-micro.log | tail -30; pk
export KIE_MONO_FP8_MMA=1
for v in base split8 one sleep100; do
  case $v in base) E="";; one) E="KIE_WAIT_ONE=1";; sleep100) E="KIE_WAIT_SLEEP_NS=100";; split8) E="KIE_ATTN_SPLIT_KB=8";; esac
  t=$(left); [ $t -gt 60 ] || { echo "skip $v"; continue; }; [ $t -gt 85 ] && t=85
  env $E timeout $t python3 benchmarks/monokernel_bench.py --archs qwen3-30b-a3b --formats fp8 --no-breakdown --reps 3 --out $R/mk-$v.json >$R/mk-$v.log 2>&1; echo "$v rc=$?"
  grep -o '"tok_per_s": [0-9.]*\|"read_probe_gbps": [0-9.]*\|"tokens_sample": [^]]*' $R/mk-$v.json | tr '\n' ' '; echo; pk
done
t=$(left); if [ $t -gt 40 ]; then
  KIE_WAIT_ONE=1 KIE_WAIT_SLEEP_NS=100 KIE_GPU_TESTS=1 timeout $t python3 -m pytest tests/monokernel/test_monokernel_gpu.py -q -p no:cacheprovider -o addopts="" -m "gpu or not gpu" -k "watchdog or tiny_families or tokens_stream" -x >$R/test-wait.log 2>&1; echo "tests rc=$?"; tail -3 $R/test-wait.log; fi
pk

#!/bin/bash
# Next session's first call (prepared in session 32): qwen3-30b-a3b fp8 with the defaults (late claim, route once,
# fp8 tasks, down rows into L2), then KIE_UP_L2=1, KIE_NEXT_L2=1, both, KIE_TASK_KB=lm:512, KIE_STOP_EARLY=1, a trace of the best;
# llama-3.2-1b fp8 with KIE_NEXT_L2; qwen3 fp8 and llama bf16 at 8K context (issue 6); the remaining GPU tests with the defaults. Tokens of each A/B must equal the base's.
R=/tmp/s33a LIMIT=560; . scripts/device-steps.sh
mk base qwen3-30b-a3b fp8
mk up qwen3-30b-a3b fp8 KIE_UP_L2=1
mk next qwen3-30b-a3b fp8 KIE_NEXT_L2=1
mk both qwen3-30b-a3b fp8 KIE_UP_L2=1 KIE_NEXT_L2=1
mk lm512 qwen3-30b-a3b fp8 KIE_TASK_KB=lm:512
mk stop qwen3-30b-a3b fp8 KIE_STOP_EARLY=1
XA="--trace 4" mk tboth qwen3-30b-a3b fp8 KIE_UP_L2=1 KIE_NEXT_L2=1
tail -14 $R/mk-tboth.log | grep -v '^{' | cut -c1-160
mk lbase llama-3.2-1b fp8
mk lnext llama-3.2-1b fp8 KIE_NEXT_L2=1
mk lstop llama-3.2-1b fp8 KIE_STOP_EARLY=1
XA="--prompt-len 8192" mk q8k qwen3-30b-a3b fp8
XA="--prompt-len 8192" mk l8k llama-3.2-1b bf16
XA="--trace 4" mk t3 qwen3-30b-a3b fp8 KIE_ATTN_DOT=tf32x3   # (128 B of spills offline on the late-claim base)
tail -14 $R/mk-t3.log | grep -v '^{' | cut -c1-160
t=$(left); if [ $t -gt 40 ]; then [ $t -gt 200 ] && t=200
  KIE_GPU_TESTS=1 timeout $t python3 -m pytest tests/monokernel/test_monokernel_gpu.py tests/monokernel/test_trace.py -v -p no:cacheprovider -o addopts="" -m gpu -k "not tiny_families and not real_size_parity and not default_prefill and not (quantized_parity and fp8)" >$R/test-gpu.log 2>&1; echo "tests rc=$?"; grep -cE "PASSED" $R/test-gpu.log; grep -E "FAILED|ERROR" $R/test-gpu.log | head -8 | cut -c1-200; pk; fi
pk

#!/bin/bash
# Next session's first call (prepared in session 33, whose devices ran out after one call): why s33a's 4-worker GPU
# run failed fp8-block / nvfp4 real-size parity and the nvfp4 default-prefill test (one process; SIGINT at the
# limit so pytest still prints the tracebacks; then with KIE_ROUTE_ONCE=0 if they fail), the defaults (LM head in
# 512 KB tasks since session 33), attention's bf16x2 / bf16 dots (NOTES prediction) in the step and alone, 8K
# context (issue 6). Carry .whl (compressed-tensors' wheels, pytest-xdist, execnet).
R=/tmp/s34a LIMIT=560; . scripts/device-steps.sh
K="quantized_parity and (block or nvfp4) or prefill_within_bf16_noise and nvfp4"
KIE_GPU_TESTS=1 timeout -s INT 150 python3 -m pytest tests/monokernel/test_monokernel_gpu.py -q --tb=short -rA -p no:cacheprovider -o addopts="" -m gpu -k "$K" >$R/test-gpu.log 2>&1; echo "tests rc=$?"
grep -E "^(PASSED|FAILED|ERROR)|Error|assert " $R/test-gpu.log | head -12 | cut -c1-220; pk
if grep -q "^FAILED" $R/test-gpu.log; then
  KIE_ROUTE_ONCE=0 KIE_GPU_TESTS=1 timeout -s INT 90 python3 -m pytest tests/monokernel/test_monokernel_gpu.py -q --tb=line -rA -p no:cacheprovider -o addopts="" -m gpu -k "quantized_parity and (block or nvfp4)" >$R/test-once0.log 2>&1; echo "once=0 tests rc=$?"
  grep -E "^(PASSED|FAILED|ERROR)" $R/test-once0.log | cut -c1-220; pk; fi
mk base qwen3-30b-a3b fp8
mk a2 qwen3-30b-a3b fp8 KIE_ATTN_DOT=bf16x2
mk a1 qwen3-30b-a3b fp8 KIE_ATTN_DOT=bf16
t=$(left); if [ $t -gt 50 ]; then [ $t -gt 80 ] && t=80
  timeout $t python3 benchmarks/attention_task_micro.py --contexts 36 8192 --out $R/attn-micro.json >$R/attn-micro.log 2>&1; echo "micro rc=$?"
  python3 -c "import json,sys
for l in open(sys.argv[1]):
    if l.startswith('{'): r=json.loads(l); print(r['pos'], r['prec'], r['block_t'], r['n_splits'], r.get('us_per_task', r.get('error', '')))" $R/attn-micro.log; pk; fi
MKT=150 XA="--prompt-len 8192" mk q8k qwen3-30b-a3b fp8
MKT=120 XA="--prompt-len 8192" mk l8k llama-3.2-1b bf16
pk

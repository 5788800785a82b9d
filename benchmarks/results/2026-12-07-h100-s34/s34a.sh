#!/bin/bash
# Session 34's call (trimmed after refused starts left one call's budget): why s33a's 4-worker GPU run failed
# fp8-block / nvfp4 real-size parity and the nvfp4 default-prefill test (one process; SIGINT at the limit so pytest
# still prints the tracebacks), the defaults (LM head in 512 KB tasks since session 33) against attention's bf16 /
# bf16x2 dots (NOTES prediction), 8K context (issue 6). Carry .whl (compressed-tensors' wheels, pytest-xdist, execnet).
R=/tmp/s34a LIMIT=555; . scripts/device-steps.sh
K="quantized_parity and (block or nvfp4) or prefill_within_bf16_noise and nvfp4"
KIE_GPU_TESTS=1 timeout -s INT 110 python3 -m pytest tests/monokernel/test_monokernel_gpu.py -q --tb=short -rA -p no:cacheprovider -o addopts="" -m gpu -k "$K" >$R/test-gpu.log 2>&1; echo "tests rc=$?"
grep -E "^(PASSED|FAILED|ERROR)|Error|assert " $R/test-gpu.log | head -12 | cut -c1-220; pk
mk base qwen3-30b-a3b fp8
mk a1 qwen3-30b-a3b fp8 KIE_ATTN_DOT=bf16
MKT=140 XA="--prompt-len 8192" mk q8k qwen3-30b-a3b fp8
mk a2 qwen3-30b-a3b fp8 KIE_ATTN_DOT=bf16x2
MKT=110 XA="--prompt-len 8192" mk l8k llama-3.2-1b bf16
pk

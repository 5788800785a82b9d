#!/bin/bash
# Session 35's second call (warm machine), the fold off (s35a: no gain, two GPU parity failures with it): the two
# failing GPU tests without it, nvfp4 / bf16 qwen3, llama bf16, 8K with and without the long-context blocks, 3K
# with the threshold at 2,048.
R=/tmp/s35b LIMIT=${LIMIT:-540}; . scripts/device-steps.sh
export KIE_ROUTER_FOLD=0
T="tests/monokernel/test_monokernel_gpu.py"
gt fails 120 -k "test_tiny_families_match_reference and olmoe or test_real_size_parity and qwen3-30b-a3b-4"
mk qn qwen3-30b-a3b nvfp4
mk l llama-3.2-1b bf16
MKT=60 XA="--prompt-len 8192" mk q8k qwen3-30b-a3b fp8
MKT=60 XA="--prompt-len 8192" mk q8k0 qwen3-30b-a3b fp8 KIE_ATTN_LONG_BLOCK_T=0   # the long blocks' A/B
MKT=60 XA="--prompt-len 3072" mk q3k qwen3-30b-a3b fp8
MKT=60 XA="--prompt-len 3072" mk q3kl qwen3-30b-a3b fp8 KIE_ATTN_LONG_FROM=2048
pk

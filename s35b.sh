#!/bin/bash
# Session 35's second call (warm machine): nvfp4 / bf16 qwen3 with the fold, llama bf16, 8K with and without the
# long-context blocks, 3K with the threshold at 2,048, a trace with ieee attention dots.
R=/tmp/s35b LIMIT=${LIMIT:-560}; . scripts/device-steps.sh
mk qn qwen3-30b-a3b nvfp4
mk qn0 qwen3-30b-a3b nvfp4 KIE_ROUTER_FOLD=0
mk qb qwen3-30b-a3b bf16
mk l llama-3.2-1b bf16
MKT=60 XA="--prompt-len 8192" mk q8k qwen3-30b-a3b fp8
MKT=60 XA="--prompt-len 8192" mk q8k0 qwen3-30b-a3b fp8 KIE_ATTN_LONG_BLOCK_T=0   # the long blocks' A/B
MKT=60 XA="--prompt-len 3072" mk q3k qwen3-30b-a3b fp8
MKT=60 XA="--prompt-len 3072" mk q3kl qwen3-30b-a3b fp8 KIE_ATTN_LONG_FROM=2048
MKT=60 XA="--trace 4" mk tqi qwen3-30b-a3b fp8 KIE_ATTN_DOT=ieee
pk

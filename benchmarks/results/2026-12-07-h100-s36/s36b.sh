#!/bin/bash
# Next session's second call (warm machine), after s36a: KIE_ATTN_NOINLINE=1 on the other models and formats, and
# with bf16x2 dots on the Laneformer (which keeps ieee: bf16x2 cost it 2.4% inlined), and at 8K context. A/Bs
# against the default in the same call.
R=/tmp/s36b LIMIT=${LIMIT:-540}; . scripts/device-steps.sh
mk l0 llama-3.2-1b bf16
mk ln llama-3.2-1b bf16 KIE_ATTN_NOINLINE=1
mk qb0 qwen3-30b-a3b bf16
mk qbn qwen3-30b-a3b bf16 KIE_ATTN_NOINLINE=1
mk qv0 qwen3-30b-a3b nvfp4
mk qvn qwen3-30b-a3b nvfp4 KIE_ATTN_NOINLINE=1
mk f0 laneformer-2b fp16
mk fn laneformer-2b fp16 KIE_ATTN_NOINLINE=1 KIE_ATTN_DOT=bf16x2
MKT=60 XA="--prompt-len 8192" mk q8k qwen3-30b-a3b fp8
MKT=60 XA="--prompt-len 8192" mk q8kn qwen3-30b-a3b fp8 KIE_ATTN_NOINLINE=1
pk

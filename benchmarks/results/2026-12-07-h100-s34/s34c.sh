#!/bin/bash
# Session 34's third call (warm machine): s34b's one-wave expert tasks (exp_up:256, +5.8% against s34a's base) again
# beside the base in one call, with 384 KB, with bf16 / bf16x2 attention, traced; 8K context with bf16x2 attention
# and 64-position blocks (s34b's micro: 2,621 -> 219 us per task at 8,192 positions).
R=/tmp/s34c LIMIT=${LIMIT:-500}; . scripts/device-steps.sh
mk base qwen3-30b-a3b fp8
mk k256 qwen3-30b-a3b fp8 KIE_TASK_KB=exp_up:256
mk kb1 qwen3-30b-a3b fp8 KIE_TASK_KB=exp_up:256 KIE_ATTN_DOT=bf16
mk kb2 qwen3-30b-a3b fp8 KIE_TASK_KB=exp_up:256 KIE_ATTN_DOT=bf16x2
MKT=60 XA="--prompt-len 8192" mk q8b2 qwen3-30b-a3b fp8 KIE_ATTN_DOT=bf16x2
MKT=60 XA="--prompt-len 8192 --block-t 64" mk q8b2t qwen3-30b-a3b fp8 KIE_ATTN_DOT=bf16x2
MKT=50 XA="--prompt-len 8192 --block-t 64" mk l8b2t llama-3.2-1b bf16 KIE_ATTN_DOT=bf16x2
mk k384 qwen3-30b-a3b fp8 KIE_TASK_KB=exp_up:384
MKT=60 XA="--trace 4" mk tk256 qwen3-30b-a3b fp8 KIE_TASK_KB=exp_up:256
pk

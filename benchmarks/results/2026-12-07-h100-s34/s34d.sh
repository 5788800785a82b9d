#!/bin/bash
# Session 34's fourth call (warm machine): what the one-wave expert tasks (exp_up:256) and bf16x2 attention with
# 64-position blocks do on the other issue-6 shapes before they become defaults.
R=/tmp/s34d LIMIT=${LIMIT:-380}; . scripts/device-steps.sh
XA="--block-t 64" mk kb2t qwen3-30b-a3b fp8 KIE_TASK_KB=exp_up:256 KIE_ATTN_DOT=bf16x2
mk nbase qwen3-30b-a3b nvfp4
mk nk256 qwen3-30b-a3b nvfp4 KIE_TASK_KB=exp_up:256
mk lbf llama-3.2-1b bf16
XA="--block-t 64" mk lbfb2t llama-3.2-1b bf16 KIE_ATTN_DOT=bf16x2
mk fbase laneformer-2b fp16
XA="--block-t 64" mk fb2t laneformer-2b fp16 KIE_ATTN_DOT=bf16x2
mk bbase qwen3-30b-a3b bf16
mk bk256 qwen3-30b-a3b bf16 KIE_TASK_KB=exp_up:256
pk

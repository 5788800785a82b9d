#!/bin/bash
# Session 34's fifth call (warm machine): bf16x2 attention without 64-position blocks on laneformer-2b and llama
# (s34d: with them laneformer -7.9%, llama +3.5%), and the candidate defaults (exp_up:256 + bf16x2) at 8K context.
R=/tmp/s34e LIMIT=${LIMIT:-200}; . scripts/device-steps.sh
mk fb2 laneformer-2b fp16 KIE_ATTN_DOT=bf16x2
mk lbfb2 llama-3.2-1b bf16 KIE_ATTN_DOT=bf16x2
MKT=50 XA="--prompt-len 8192" mk q8kb2 qwen3-30b-a3b fp8 KIE_TASK_KB=exp_up:256 KIE_ATTN_DOT=bf16x2
MKT=40 XA="--prompt-len 8192" mk l8b2 llama-3.2-1b bf16 KIE_ATTN_DOT=bf16x2
mk fb1 laneformer-2b fp16 KIE_ATTN_DOT=bf16
pk

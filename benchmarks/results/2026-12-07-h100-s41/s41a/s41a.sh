#!/bin/bash
# Session 41, first call (predictions: NOTES, "session 41 ... router inside o_proj" and "... top-k by ranks").
# KIE_ROUTE_IN_O (off): the router's phase folded into the o_proj tasks; KIE_TOPK_RANK (off): the top-k from one
# comparison matrix. A/B on qwen3-30b-a3b fp8 (and nvfp4 with both) in the same call, the GPU parity tests with both
# flags, a trace of the fp8 step with both. Carry .whl.
R=/tmp/s41a LIMIT=${LIMIT:-540}; . scripts/device-steps.sh
MKT=90 mk q8 qwen3-30b-a3b fp8
mk q8r qwen3-30b-a3b fp8 KIE_ROUTE_IN_O=1
mk q8rk qwen3-30b-a3b fp8 KIE_ROUTE_IN_O=1 KIE_TOPK_RANK=1
mk q8k qwen3-30b-a3b fp8 KIE_TOPK_RANK=1
mk qn qwen3-30b-a3b nvfp4
mk qnrk qwen3-30b-a3b nvfp4 KIE_ROUTE_IN_O=1 KIE_TOPK_RANK=1
T=tests/monokernel/test_monokernel_gpu.py
export KIE_ROUTE_IN_O=1 KIE_TOPK_RANK=1; gt rino 130 -k "router_inside or tiny_families" -n 4
MKT=70 XA="--trace 4" mk tq8rk qwen3-30b-a3b fp8
unset KIE_ROUTE_IN_O KIE_TOPK_RANK

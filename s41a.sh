#!/bin/bash
# Session 41, first call (predictions: NOTES, "session 41 ... router inside o_proj"). KIE_ROUTE_IN_O (off): the
# router's phase folded into the o_proj tasks; A/B on qwen3-30b-a3b fp8 and nvfp4 in the same call, a trace of each
# side (fp8), the GPU parity tests of the new path. Carry .whl.
R=/tmp/s41a LIMIT=${LIMIT:-540}; . scripts/device-steps.sh
MKT=90 mk q8 qwen3-30b-a3b fp8
mk q8r qwen3-30b-a3b fp8 KIE_ROUTE_IN_O=1
mk qn qwen3-30b-a3b nvfp4
mk qnr qwen3-30b-a3b nvfp4 KIE_ROUTE_IN_O=1
T=tests/monokernel/test_monokernel_gpu.py
KIE_ROUTE_IN_O=1 gt rino 130 -k "router_inside or tiny_families" -n 4
MKT=70 XA="--trace 4" mk tq8r qwen3-30b-a3b fp8 KIE_ROUTE_IN_O=1
MKT=70 XA="--trace 4" mk tq8 qwen3-30b-a3b fp8

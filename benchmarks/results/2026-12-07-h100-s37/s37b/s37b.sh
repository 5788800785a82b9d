#!/bin/bash
# Session 37's second call: x staged before the router's wait in the expert gate / up tasks (KIE_EXP_X_EARLY=1),
# the gate / up bulk prefetch off (KIE_EXP_UP_L2=0) and both, A/B against the default in the same call; a trace of
# x-early; GPU parity with it (real-size fp8 / fp8-block), the three real-size sampling tests s37a did not reach.
# Carry .whl.
R=/tmp/s37b LIMIT=${LIMIT:-540}; . scripts/device-steps.sh
mk q qwen3-30b-a3b fp8
mk xe qwen3-30b-a3b fp8 KIE_EXP_X_EARLY=1
mk np qwen3-30b-a3b fp8 KIE_EXP_UP_L2=0
mk xn qwen3-30b-a3b fp8 KIE_EXP_X_EARLY=1 KIE_EXP_UP_L2=0
mk q2 qwen3-30b-a3b fp8                          # the default again: the run-to-run spread of this call
MKT=60 XA="--trace 4" mk txe qwen3-30b-a3b fp8 KIE_EXP_X_EARLY=1
T="tests/monokernel/test_monokernel_gpu.py"
KIE_EXP_X_EARLY=1 gt xreal 70 -k "quantized_parity and fp8"
gt samp $(( $(left) - 5 )) -k "top_k_top_p"
pk

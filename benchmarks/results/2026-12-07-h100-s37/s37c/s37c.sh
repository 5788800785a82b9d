#!/bin/bash
# Session 37's third call: the expert gate / up task's bulk L2 prefetches in larger chunks (KIE_EXP_L2_CHUNK: 16 KB
# and 4 KB instead of 1 KB; its expert rows and KIE_DOWN_L2's down rows), A/B against the default in the same call,
# and a trace of the 16 KB one (is the ~4.3 us between the expert id and the loop the prefetches' issue?). Carry .whl.
R=/tmp/s37c LIMIT=${LIMIT:-300}; . scripts/device-steps.sh
mk q qwen3-30b-a3b fp8
mk c16 qwen3-30b-a3b fp8 KIE_EXP_L2_CHUNK=16384
mk c4 qwen3-30b-a3b fp8 KIE_EXP_L2_CHUNK=4096
mk q2 qwen3-30b-a3b fp8
MKT=60 XA="--trace 4" mk tc16 qwen3-30b-a3b fp8 KIE_EXP_L2_CHUNK=16384
pk

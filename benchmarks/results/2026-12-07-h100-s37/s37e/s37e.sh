#!/bin/bash
# Session 37's last call: the expert gate / up task in steps of 4 pieces (KIE_MMA8_GLU_PIECES=4), A/B against the
# default in the same call, and its trace. Carry .whl.
R=/tmp/s37e LIMIT=${LIMIT:-200}; . scripts/device-steps.sh
mk q qwen3-30b-a3b fp8
mk g4 qwen3-30b-a3b fp8 KIE_MMA8_GLU_PIECES=4
mk q2 qwen3-30b-a3b fp8
MKT=60 XA="--trace 4" mk tg4 qwen3-30b-a3b fp8 KIE_MMA8_GLU_PIECES=4
pk

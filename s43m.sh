#!/bin/bash
# Session 42's short call (what the device time left allows; predictions: NOTES, "session 42 ... KIE_FUSE_DOWN=1"):
# qwen3-30b-a3b fp8, the default against a routed expert's down inside its gate / up tasks, then the fused build's
# GPU parity test at real widths (fp8 codes). s43a.sh has the full set. Carry .whl.
R=/tmp/s43m LIMIT=${LIMIT:-280}; . scripts/device-steps.sh
MKT=85 mk q8 qwen3-30b-a3b fp8
MKT=85 mk q8f qwen3-30b-a3b fp8 KIE_FUSE_DOWN=1
T=tests/monokernel/test_monokernel_gpu.py; t=$(left); [ $t -gt 60 ] && gt fused $t -k "fused_down and fp8-1024"

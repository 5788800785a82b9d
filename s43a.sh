#!/bin/bash
# Prepared in session 42 (no device lent) for the next session's first call (predictions: NOTES, "session 42 ...
# KIE_FUSE_DOWN=1"). qwen3-30b-a3b fp8: the default against a routed expert's down inside its gate / up tasks (the
# 1024 x 3-stage walk, traced, and the 512 x 0 one), the fused build's GPU parity tests, then session 41's merged
# top-k (KIE_TOPK_MERGE, traced). Carry .whl. Second call: `bash s42a.sh` (the issue 6 rows with graph peers).
R=/tmp/s43a LIMIT=${LIMIT:-545}; . scripts/device-steps.sh
MKT=90 mk q8 qwen3-30b-a3b fp8
MKT=90 mk q8f qwen3-30b-a3b fp8 KIE_FUSE_DOWN=1
MKT=70 XA="--trace 4" mk tq8f qwen3-30b-a3b fp8 KIE_FUSE_DOWN=1
T=tests/monokernel/test_monokernel_gpu.py; t=$(left); [ $t -gt 150 ] && t=150
[ $t -gt 60 ] && gt fused $t -k "fused_down and (fp8-1024 or gpt)"
MKT=80 mk q8f5 qwen3-30b-a3b fp8 KIE_FUSE_DOWN=1 KIE_FD_BD=512 KIE_FD_NS=0
MKT=60 XA="--trace 4" mk tq8m qwen3-30b-a3b fp8 KIE_TOPK_MERGE=1

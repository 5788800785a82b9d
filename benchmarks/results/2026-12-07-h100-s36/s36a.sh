#!/bin/bash
# Next session's first call (prepared in session 35, which had no device time left for it), qwen3-30b-a3b fp8, all
# A/Bs against the default in the same call:
# - KIE_ATTN_NOINLINE=1 (off): the attention task compiled as a called function; offline sm_90 the default build's
#   96 B of stack / 48 spill instructions go to 0 (s35a's trace had qkv / expert-down work 1.4-1.6 us per task
#   above session 34's ieee trace, whose build had no spills);
# - KIE_ROUTER_FOLD=1 (off: s35a 269.7 vs 270.8 tok/s): o_proj now sized over the programs its W_f tasks leave
#   (114 + 16 <= 132: one wave); with the noinline attention (120 B of stack -> 8);
# - the noinline attention with 64-position blocks at 32 positions (offline 0 spills; inlined: 120 B, -2.8% in s34);
# - traces of the defaults, of noinline, of ieee attention and of the fold (trace.py names its three kinds of
#   tasks); then the one tiny GPU test s35a did not reach. Carry .whl.
R=/tmp/s36a LIMIT=${LIMIT:-540}; . scripts/device-steps.sh
mk q0 qwen3-30b-a3b fp8
mk qn qwen3-30b-a3b fp8 KIE_ATTN_NOINLINE=1
mk qf qwen3-30b-a3b fp8 KIE_ROUTER_FOLD=1
mk qfn qwen3-30b-a3b fp8 KIE_ROUTER_FOLD=1 KIE_ATTN_NOINLINE=1
mk qnm qwen3-30b-a3b fp8 KIE_NOINLINE=attention,mma8_glu,mma8_down   # (session 36) the expert tasks called too
MKT=60 XA="--trace 4" mk tq0 qwen3-30b-a3b fp8
MKT=60 XA="--trace 4" mk tqn qwen3-30b-a3b fp8 KIE_ATTN_NOINLINE=1
mk qn64 qwen3-30b-a3b fp8 KIE_ATTN_NOINLINE=1 KIE_ATTN_LONG_FROM=0   # 64-position blocks from the start: 0 spills too
MKT=60 XA="--trace 4" mk tqi qwen3-30b-a3b fp8 KIE_ATTN_DOT=ieee
MKT=60 XA="--trace 4" mk tqf qwen3-30b-a3b fp8 KIE_ROUTER_FOLD=1
T="tests/monokernel/test_laneformer_gpu.py"   # the one tiny GPU test s35a's 110 s stage did not reach
gt lane $(( $(left) - 5 )) -k "test_laneformer_2b_width_parity"
pk

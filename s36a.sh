#!/bin/bash
# Next session's first call (prepared in session 35, which had no device time left for it). The folded router
# (KIE_ROUTER_FOLD=1, off: in s35a 269.7 vs 270.8 tok/s, two GPU parity tests over their tolerance) now sizes o_proj's
# tasks over the programs its W_f tasks leave (114 + 16 <= 132: one wave; s35a had 128 + 16): A/B against the
# defaults, and with 32 W_f tasks; traces of the defaults (bf16x2 attention, no fold), of ieee attention (same
# machine: s35a's trace had qkv / expert-down work 1.4-1.6 us per task above session 34's ieee trace) and of the
# fold (trace.py now names its three kinds of tasks); then the one tiny GPU test s35a did not reach. Carry .whl.
R=/tmp/s36a LIMIT=${LIMIT:-420}; . scripts/device-steps.sh
mk q0 qwen3-30b-a3b fp8
mk qf qwen3-30b-a3b fp8 KIE_ROUTER_FOLD=1
MKT=60 XA="--trace 4" mk tq0 qwen3-30b-a3b fp8
MKT=60 XA="--trace 4" mk tqi qwen3-30b-a3b fp8 KIE_ATTN_DOT=ieee   # do bf16x2's registers slow qkv / down?
mk qf0 qwen3-30b-a3b fp8 KIE_ROUTER_FOLD=1 KIE_TASK_KB=router:32   # 32 W_f tasks of 4 experts
MKT=60 XA="--trace 4" mk tqf qwen3-30b-a3b fp8 KIE_ROUTER_FOLD=1   # (trace.py names its three kinds of tasks)
T="tests/monokernel/test_laneformer_gpu.py"   # the one tiny GPU test s35a's 110 s stage did not reach
gt lane $(( $(left) - 5 )) -k "test_laneformer_2b_width_parity"
pk

#!/bin/bash
# Next session's first call (prepared in session 35; no device time was left for it): the folded router (now off: s35a no gain, two GPU parity tests over their tolerance)
# with o_proj's tasks sized so o_proj + the 16 W_f tasks fit one wave (114 + 16 <= 132 programs), beside
# the same o tasks without the fold and the default; a trace of the defaults (bf16x2 attention, no fold) and of the
# fold in one wave.
R=/tmp/s36a LIMIT=${LIMIT:-420}; . scripts/device-steps.sh
mk q0 qwen3-30b-a3b fp8
mk qf qwen3-30b-a3b fp8 KIE_ROUTER_FOLD=1
MKT=60 XA="--trace 4" mk tq0 qwen3-30b-a3b fp8
mk qf0 qwen3-30b-a3b fp8 KIE_ROUTER_FOLD=1 KIE_TASK_KB=router:32   # 32 W_f tasks of 4 experts
MKT=60 XA="--trace 4" mk tqf qwen3-30b-a3b fp8 KIE_ROUTER_FOLD=1   # (trace.py names its three kinds of tasks)
T="tests/monokernel/test_monokernel_gpu.py"   # the tiny tests the 110 s stage of s35a did not reach
gt tiny $(( $(left) - 5 )) -k "not real_size and not test_tiny_families_match_reference and not laneformer"
pk

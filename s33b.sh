#!/bin/bash
# Next session's second call (prepared in session 32): task sizes under the late claim (LM head 512 KB, expert
# gate / up 256 KB, all 64 KB), llama-3.2-1b fp8 with
# KIE_NEXT_L2 / KIE_STOP_EARLY, 8K context (issue 6), attention's tf32x3 dots on the late-claim base, and the graph
# backend on qwen3 fp8 in the same call (issue 6's ratio). Fold call 1's winners into the defaults first.
R=/tmp/s33b LIMIT=560; . scripts/device-steps.sh
mk lm512 qwen3-30b-a3b fp8 KIE_TASK_KB=lm:512
mk k256 qwen3-30b-a3b fp8 KIE_TASK_KB=exp_up:256   # one wave of 48-row expert tasks (-5.9% with claim-ahead)
XA="--max-task-kb 64" mk kb64 qwen3-30b-a3b fp8   # smaller tasks: finer balance, more claims
mk lbase llama-3.2-1b fp8
mk lnext llama-3.2-1b fp8 KIE_NEXT_L2=1
mk lstop llama-3.2-1b fp8 KIE_STOP_EARLY=1
MKT=150 XA="--prompt-len 8192" mk q8k qwen3-30b-a3b fp8
MKT=120 XA="--prompt-len 8192" mk l8k llama-3.2-1b bf16
XA="--trace 4" mk t3 qwen3-30b-a3b fp8 KIE_ATTN_DOT=tf32x3   # (128 B of spills offline on the late-claim base)
tail -14 $R/mk-t3.log | grep -v '^{' | cut -c1-160
t=$(left); if [ $t -gt 50 ]; then [ $t -gt 80 ] && t=80
  timeout $t python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:fp8 --backends graph --out $R/graph-q.json >$R/graph-q.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph-q.log | cut -c1-160; pk; fi
pk

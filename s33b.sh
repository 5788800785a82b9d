#!/bin/bash
# Session 33's second call: attention's dots as 16-bit tensor-core products (KIE_ATTN_DOT=bf16x2 / bf16, NOTES
# prediction) in the whole step and alone (attention_task_micro), 8K context (issue 6), the expert gate / up in one
# wave (exp_up:256) and llama-3.2-1b fp8 with KIE_NEXT_L2 / KIE_STOP_EARLY. Fold call 1's winners into the defaults
# first (the base here is the tree's defaults).
R=/tmp/s33b LIMIT=560; . scripts/device-steps.sh
mk qbase qwen3-30b-a3b fp8
mk a2 qwen3-30b-a3b fp8 KIE_ATTN_DOT=bf16x2
mk a1 qwen3-30b-a3b fp8 KIE_ATTN_DOT=bf16
t=$(left); if [ $t -gt 50 ]; then [ $t -gt 90 ] && t=90
  timeout $t python3 benchmarks/attention_task_micro.py --contexts 36 8192 --out $R/attn-micro.json >$R/attn-micro.log 2>&1; echo "micro rc=$?"
  python3 -c "import json,sys
for l in open(sys.argv[1]):
    if l.startswith('{'): r=json.loads(l); print(r['pos'], r['prec'], r['block_t'], r['n_splits'], r.get('us_per_task', r.get('error', '')))" $R/attn-micro.log; pk; fi
MKT=150 XA="--prompt-len 8192" mk q8k qwen3-30b-a3b fp8
MKT=120 XA="--prompt-len 8192" mk l8k llama-3.2-1b bf16
mk k256 qwen3-30b-a3b fp8 KIE_TASK_KB=exp_up:256   # one wave of 48-row expert tasks (-5.9% with claim-ahead)
mk lbase llama-3.2-1b fp8
mk lnext llama-3.2-1b fp8 KIE_NEXT_L2=1
mk lstop llama-3.2-1b fp8 KIE_STOP_EARLY=1
pk

#!/bin/bash
# Session 34's second call (warm machine after s34a): the monokernel GPU tests (tiny on 4 pytest-xdist workers, the
# real-size ones in one process), the graph backend at 8K context (issue 6's peer for s34a's 8K monokernel rows),
# attention alone with bf16 / bf16x2 dots, one-wave expert tasks under the late claim, KIE_NEXT_L2 on llama fp8.
R=/tmp/s34b LIMIT=${LIMIT:-560}; . scripts/device-steps.sh
XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
T="tests/monokernel/test_monokernel_gpu.py tests/monokernel/test_trace.py"
KIE_GPU_TESTS=1 timeout -s INT 120 python3 -m pytest $T -q --tb=short -rA $XD -p no:cacheprovider -o addopts="" -m gpu -k "not real_size" >$R/test-tiny.log 2>&1; echo "tiny tests rc=$? ($XD)"
grep -cE "^PASSED" $R/test-tiny.log; grep -E "^(FAILED|ERROR)" $R/test-tiny.log | head -8 | cut -c1-200; pk
KIE_GPU_TESTS=1 timeout -s INT 170 python3 -m pytest $T -q --tb=short -rA -p no:cacheprovider -o addopts="" -m gpu -k "real_size" >$R/test-real.log 2>&1; echo "real-size tests rc=$?"
grep -cE "^PASSED" $R/test-real.log; grep -E "^(FAILED|ERROR)" $R/test-real.log | head -8 | cut -c1-200; pk
for a in "qwen3-30b-a3b fp8" "llama-3.2-1b bf16"; do set -- $a; t=$(left); [ $t -gt 50 ] || break; [ $t -gt 75 ] && t=75
  timeout $t python3 -m kie_moe.cli bench $1 --scheme $2 --backend graph --prompt-len 8192 --runs 3 --json --out $R/g8k-$1.json >$R/g8k-$1.log 2>&1; echo "graph 8k $1 rc=$?"
  grep -o '"tok_per_s": [0-9.]*\|"pct_of_roofline": [0-9.]*' $R/g8k-$1.json 2>/dev/null | tr '\n' ' '; echo; pk; done
t=$(left); if [ $t -gt 50 ]; then [ $t -gt 60 ] && t=60
  timeout $t python3 benchmarks/attention_task_micro.py --contexts 36 8192 --out $R/attn-micro.json >$R/attn-micro.log 2>&1; echo "micro rc=$?"
  python3 -c "import json,sys
for l in open(sys.argv[1]):
    if l.startswith('{'): r=json.loads(l); print(r.get('pos'), r.get('prec'), r.get('block_t'), r.get('n_splits'), r.get('us_per_task', r.get('error', '')))" $R/attn-micro.log; pk; fi
mk k256 qwen3-30b-a3b fp8 KIE_TASK_KB=exp_up:256
mk lbase llama-3.2-1b fp8
mk lnext llama-3.2-1b fp8 KIE_NEXT_L2=1
pk

#!/bin/bash
# Next session's second call (prepared in session 33): the rest of the monokernel GPU tests with the defaults (the
# tiny ones on 4 pytest-xdist workers, the real-size ones in one process: s33a's three failures came while four
# workers held real-size models, cause unknown), KIE_NEXT_L2 on llama-3.2-1b fp8 (+1.2% on qwen3 fp8, s33a), the
# expert gate / up in one wave (exp_up:256) under the late claim, the graph backend on llama (issue 6's ratio).
R=/tmp/s34b LIMIT=560; . scripts/device-steps.sh
XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
T="tests/monokernel/test_monokernel_gpu.py tests/monokernel/test_trace.py"
KIE_GPU_TESTS=1 timeout -s INT 120 python3 -m pytest $T -q --tb=short -rA $XD -p no:cacheprovider -o addopts="" -m gpu -k "not real_size" >$R/test-tiny.log 2>&1; echo "tiny tests rc=$? ($XD)"
grep -cE "^PASSED" $R/test-tiny.log; grep -E "^(FAILED|ERROR)" $R/test-tiny.log | head -8 | cut -c1-200; pk
KIE_GPU_TESTS=1 timeout -s INT 200 python3 -m pytest $T -q --tb=short -rA -p no:cacheprovider -o addopts="" -m gpu -k "real_size" >$R/test-real.log 2>&1; echo "real-size tests rc=$?"
grep -cE "^PASSED" $R/test-real.log; grep -E "^(FAILED|ERROR)" $R/test-real.log | head -8 | cut -c1-200; pk
mk lbase llama-3.2-1b fp8
mk lnext llama-3.2-1b fp8 KIE_NEXT_L2=1
mk k256 qwen3-30b-a3b fp8 KIE_TASK_KB=exp_up:256   # one wave of 48-row expert tasks (-5.9% with claim-ahead)
t=$(left); if [ $t -gt 50 ]; then [ $t -gt 70 ] && t=70
  timeout $t python3 benchmarks/graph_bench.py --runs llama-3.2-1b:fp8,llama-3.2-1b:bf16 --backends graph --out $R/graph-l.json >$R/graph-l.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph-l.log | cut -c1-160; pk; fi
pk

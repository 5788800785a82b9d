#!/bin/bash
# Next session's first call (prepared in session 34): the monokernel GPU suite with session 34's new defaults (bf16x2
# attention except the Laneformer, 256 KB expert gate / up tasks; tiny tests on 4 pytest-xdist workers, real-size in
# one process), then issue 6's ratio with the graph backend in the same call at 32 positions; 8K with and without the
# long-context 64-position blocks (session 34), and at 3K the threshold moved down to 2,048; a trace of the defaults.
# Carry .whl (compressed-tensors' wheels, pytest-xdist, execnet).
R=/tmp/s35a LIMIT=${LIMIT:-560}; . scripts/device-steps.sh
XD=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
T="tests/monokernel/test_monokernel_gpu.py tests/monokernel/test_trace.py tests/monokernel/test_laneformer_gpu.py"
gt tiny 120 -k "not real_size" $XD
gt real 170 -k "real_size"
mk q qwen3-30b-a3b fp8
MKT=60 XA="--trace 4" mk tq qwen3-30b-a3b fp8   # bf16x2 gained qwen3 only 0.4% at 32 positions though the task alone is 2.6x faster
MKT=60 XA="--trace 4" mk tqi qwen3-30b-a3b fp8 KIE_ATTN_DOT=ieee   # the same trace with ieee dots
mk l llama-3.2-1b bf16
t=$(left); if [ $t -gt 50 ]; then [ $t -gt 80 ] && t=80
  timeout $t python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:fp8,llama-3.2-1b:bf16 --backends graph --out $R/graph.json >$R/graph.log 2>&1; echo "graph rc=$?"; grep "tok/s" $R/graph.log | cut -c1-160; pk; fi
MKT=60 XA="--prompt-len 8192" mk q8k qwen3-30b-a3b fp8
MKT=60 XA="--prompt-len 8192" mk q8k0 qwen3-30b-a3b fp8 KIE_ATTN_LONG_BLOCK_T=0   # the long blocks' A/B
MKT=60 XA="--prompt-len 3072" mk q3k qwen3-30b-a3b fp8
MKT=60 XA="--prompt-len 3072" mk q3kl qwen3-30b-a3b fp8 KIE_ATTN_LONG_FROM=2048
pk

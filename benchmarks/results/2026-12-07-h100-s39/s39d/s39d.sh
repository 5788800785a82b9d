#!/bin/bash
# Session 39: the GPU-marked tests of the files the packed experts touched, then where the monokernel's qwen3-30b-a3b
# nvfp4 step goes (full / sync-only / no-wait breakdown) and its tile / launch grid (--sweep, first measured on fp4:
# the sweep ran bf16 whatever --formats said until this session). Carry .whl.
R=/tmp/s39d LIMIT=${LIMIT:-450}; . scripts/device-steps.sh
T="tests/kernels/test_fp4_mma_experts.py tests/kernels/test_fp4_mma.py tests/kernels/test_moe.py tests/kernels/test_graph_backend.py tests/kernels/test_gpu_kernels.py"
gt k 120 -k "not cpu" -n 4
t=$(left); if [ $t -gt 60 ]; then
  timeout $((t - 5)) python3 benchmarks/monokernel_bench.py --archs qwen3-30b-a3b --formats nvfp4 --reps 3 --sweep \
    --out $R/mk-qn-sweep.json >$R/mk-qn-sweep.log 2>&1; echo "sweep rc=$?"
  python3 -c "import json,sys
for l in open(sys.argv[1]):
    if l.startswith('{\"arch'):
        r = json.loads(l); o = {k: r.get(k) for k in ('num_warps', 'programs_per_sm', 'num_stages', 'block_k', 'tile_elems', 'max_task_kb', 'x_bcast')}
        print(round(r.get('tok_per_s', 0), 1), round(r.get('pct_of_probe', 0), 1), r.get('sync_only', {}).get('pct_of_probe'), r.get('no_wait', {}).get('pct_of_probe'), o, r.get('error', '')[:80])" $R/mk-qn-sweep.log; pk; fi

#!/bin/bash
# Prepared in session 37 for the next session's first call: does one 8-warp program per SM stream a phase faster
# when its weight tiles come by the TMA? stream_probe's TMA gate / up points with a codes-only consumer (tmasum: the
# TMA's own rate) and a tensor-core one (tmadot), free-running, from L2 and phased, beside fp8_mma's free / phased
# points and the CUDA-core TMA consumer from L2 (session 37: 12.7 GB/s per program, the limit of its tma points);
# then the default qwen3 fp8 monokernel as the day's anchor and three of its defaults re-checked on today's build
# (the attention called, session 36): the down rows prefetched by the gate / up tasks, the top-k once per layer, the
# late claim. NOTES session 37 has the predictions. Carry .whl.
R=/tmp/s38a LIMIT=${LIMIT:-330}; . scripts/device-steps.sh
timeout 150 python3 benchmarks/stream_probe.py --only 81,82,83,84,85,86,87,88,89,90,91,92,93,67,71,77 --out $R/stream-probe.json \
  >$R/stream-probe.log 2>&1; echo "probe rc=$?"; cut -c1-200 $R/stream-probe.log | tail -17; pk
mk q qwen3-30b-a3b fp8
mk nd qwen3-30b-a3b fp8 KIE_DOWN_L2=0
mk nr qwen3-30b-a3b fp8 KIE_ROUTE_ONCE=0
mk cw qwen3-30b-a3b fp8 KIE_CLAIM=wait
pk

#!/bin/bash
# Session 37's last call (~300 s of device time left): stream_probe's TMA gate / up points beside fp8_mma's
# free-running and phased points (session 29's) in the same process. Carry .whl.
R=/tmp/s37f LIMIT=${LIMIT:-150}; . scripts/device-steps.sh
timeout $(left) python3 benchmarks/stream_probe.py --only 74,75,76,77,78,79,80,81,66,67,70,71 --out $R/stream-probe.json \
  >$R/stream-probe.log 2>&1; echo "probe rc=$?"; cut -c1-230 $R/stream-probe.log | grep -v "^$" | tail -14; pk

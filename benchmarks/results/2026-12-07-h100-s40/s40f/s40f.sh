#!/bin/bash
# Session 40: the graph backend's qwen3-30b-a3b mxfp4 (s40a's stage ran out of time), the peer of the monokernel's
# mxfp4 figure. Carry .whl.
R=/tmp/s40f LIMIT=200; . scripts/device-steps.sh; timeout 170 python3 benchmarks/graph_bench.py --runs qwen3-30b-a3b:mxfp4 --backends graph --out $R/graph.json >$R/graph.log 2>&1; pk

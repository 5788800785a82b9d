#!/bin/bash
# Session 36's third and fourth device commands, run inline on the warm machine after s36b (the attention task
# called, KIE_ATTN_NOINLINE=1, was still off by default in that working tree):
#   s36c (after `LIMIT=470 bash s36b.sh` in the same command): the tiny monokernel GPU tests with it, 50 s
R=/tmp/s36c LIMIT=60; . scripts/device-steps.sh; export KIE_ATTN_NOINLINE=1; T=tests/monokernel/test_monokernel_gpu.py
gt nin 50 -k "tiny"
#   s36d: the whole test_monokernel_gpu.py with it (real-size parity, then the rest on 4 workers)
R=/tmp/s36d LIMIT=380; . scripts/device-steps.sh; export KIE_ATTN_NOINLINE=1; T=tests/monokernel/test_monokernel_gpu.py
gt real 200 -k "real_size"; gt tiny 150 -n 4 -k "not real_size"

import os
import sys

import pytest

# Kernel tests run on CPU through Triton's interpreter unless a GPU run asked otherwise.
if os.environ.get("KIE_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    import kie_moe.kernels  # noqa: F401  (installs kernels/interpreter_speedups.py before any test launches)


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (scripts/gpu-check runs these on the device machine)")
    for it in items:
        if "gpu" in it.keywords:
            it.add_marker(skip)

import os

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


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    """After each GPU test: drop its tensors and the caching allocator's reserve, so a worker (pytest-xdist runs
    several per GPU) does not keep a finished real-size test's ~10-20 GB while the next one allocates (session 33:
    three real-size tests failed on 4 workers of an 80 GB H100, cause not known: memory is one suspect)."""
    yield
    if "gpu" in request.keywords:
        import gc

        import torch
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

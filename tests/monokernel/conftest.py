"""Tiny HF checkpoints (tests/models/hf_tiny) shared by the monokernel tests, made once per session."""
import pytest
import torch

from kie_moe.models.registry import load_model

from ..models.hf_tiny import make_checkpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    made = {}

    def get(case: str, dtype=torch.float32):
        key = (case, dtype)
        if key not in made:
            d = tmp_path_factory.mktemp(f"mk_{case}_{str(dtype).split('.')[-1]}")
            make_checkpoint(case, str(d), dtype)
            made[key] = load_model(str(d))
        return made[key]
    return get

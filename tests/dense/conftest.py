"""Fixtures of the Laneformer tests; the configs live in laneformer_helpers.py."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))           # laneformer_helpers, laneformer_oracle

from kie_moe.dense.preset import write_checkpoint  # noqa: E402


@pytest.fixture
def make_model(tmp_path):
    """config dict -> checkpoint directory (float32, so both implementations read identical weights)."""
    count = [0]

    def make(cfg: dict, seed: int = 1, **kw) -> str:
        count[0] += 1
        d = str(tmp_path / f"model{count[0]}")
        kw = {"dtype": torch.float32, "init_std": 0.3, "norm_jitter": 0.2, **kw}
        write_checkpoint(cfg, d, seed=seed, **kw)
        return d

    return make

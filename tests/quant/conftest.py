"""Fixtures of the converter / ingest tests: tiny bf16 checkpoints of every family and their conversions, made
once per session (each is a few hundred KB and takes well under a second to convert)."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # quant_ckpt_helpers

from quant_ckpt_helpers import make_any  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """case name (hf_tiny.CASES, "laneformer" or a BLOCK128_CASES name) -> bf16 checkpoint directory."""
    made = {}

    def get(case: str) -> str:
        if case not in made:
            made[case] = make_any(case, str(tmp_path_factory.mktemp(f"src_{case}")))
        return made[case]

    return get


@pytest.fixture(scope="session")
def converted(tiny, tmp_path_factory):
    """(case, scheme) -> (directory, ConvertReport, warnings), converted through the API."""
    from kie_moe.models.quantizable import convert_checkpoint

    made = {}

    def get(case: str, scheme: str):
        if (case, scheme) not in made:
            dst = str(tmp_path_factory.mktemp(f"{case}_{scheme}") / "out")
            seen = []
            rep = convert_checkpoint(tiny(case), dst, scheme, progress=False, on_warning=seen.append)
            made[(case, scheme)] = (dst, rep, seen)
        return made[(case, scheme)]

    return get

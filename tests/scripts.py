"""Import a repository script that is not part of the package (benchmarks/*.py, scripts/*.py) by its path."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(rel: str):
    """`rel`: path from the repository root, e.g. "benchmarks/peers.py"; returns the executed module."""
    path = ROOT / rel
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

import os

if os.environ.get("TRITON_INTERPRET") == "1":   # the CPU path (CI, `kie ... --device cpu`): Triton's interpreter
    from .interpreter_speedups import install as _install

    _install()

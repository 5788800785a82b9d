import os

if os.environ.get("TRITON_INTERPRET") == "1":   # the CPU path (CI, `kie ... --device cpu`): Triton's interpreter
    from .interpret_patch_once import install as _install

    _install()

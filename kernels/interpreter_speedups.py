"""Two speed-ups of Triton's interpreter (the CPU path: CI, `TRITON_INTERPRET=1 kie ... --device cpu`).

1. triton.language patched once per kernel launch instead of once per device-function call.

triton 3.6's interpreter re-patches triton.language (inspect.getmembers over tl, tl.tensor, tl.math: ~0.2 ms) at
every call of a @triton.jit device function, although the launch already patched the same modules and the patches
stay until the launch ends. Our kernels call small device functions in their inner loops (tiles.py's fp4 decode:
~19k calls in a 3-step tiny-Qwen3 nvfp4 decode), so that re-patching was ~37% of the interpreter's time (cProfile,
session 18; the CLI's `TRITON_INTERPRET=1 ... --device cpu` path and the CPU tests pay it alike).

Installed by kie_moe.kernels' import when TRITON_INTERPRET=1: a device-function call skips the patch when every
language module its globals see is already patched for the running launch; anything else (a module not yet
patched, no launch running) takes triton's own path. What runs is unchanged: the same patched builtins, bound to
the same interpreter builder.

2. No dead int32 overflow checks. With sanitize_overflow on (InterpreterOptions' default) the interpreter casts both
sides of every 32-bit integer add / sub / mul to int64 and builds a range check, then hands it to device_assert,
which drops it unless options.debug is set, and the interpreter never sets it. That dead work was ~28% of a tiny
Qwen3 graph decode step (session 18). Off here whenever debug is off: nothing observable changes."""
import inspect

_patched: set[int] | None = None       # ids of the language modules patched by the launch now running


def _lang_ids(fn, tl) -> set[int]:
    return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}


class _NoScope:
    def restore(self):
        pass


def install() -> bool:
    """Both speed-ups; False where this triton's interpreter has no _patch_lang / GridExecutor to wrap (or they are
    wrapped already)."""
    import dataclasses

    import triton.language as tl
    from triton.runtime import interpreter as I
    b = getattr(I, "interpreter_builder", None)
    if b is not None and dataclasses.is_dataclass(getattr(b, "options", None)) \
            and hasattr(b.options, "sanitize_overflow"):
        b.options = dataclasses.replace(b.options, sanitize_overflow=bool(getattr(b.options, "debug", True)))
    orig = getattr(I, "_patch_lang", None)
    if orig is None or getattr(orig, "_kie_patch_once", False) or not hasattr(I, "GridExecutor"):
        return False

    def _patch_lang(fn):
        global _patched
        ids = _lang_ids(fn, tl)
        if _patched is not None and ids <= _patched:   # a device function inside a launch: nothing new to patch
            return _NoScope()
        if _patched is not None:
            _patched |= ids
        return orig(fn)             # as triton does (a device call's scope is dropped: the launch's restores)

    run = I.GridExecutor.__call__

    def __call__(self, *args, **kwargs):
        global _patched
        outer, _patched = _patched, set()       # the launch's own _patch_lang call fills it
        try:
            return run(self, *args, **kwargs)
        finally:
            _patched = outer

    _patch_lang._kie_patch_once = True
    I._patch_lang = _patch_lang
    I.GridExecutor.__call__ = __call__
    return True

"""The PDL contract of kernels/pdl.py, checked on the source: a kernel launched with **launch_kw() may start before
its predecessor has finished, so it must call pdl_begin() before touching memory. A launch site added without the
wait (or a wait moved below a load) is a data race that only shows on the GPU, sometimes: this test fails first."""
import ast
from pathlib import Path

import kie_moe.kernels as K

SRC = Path(K.__file__).parent


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value,
                                                                                                  str):
        body = body[1:]                                              # the docstring
    return body[0]


def _pdl_launches(tree: ast.Module) -> set[str]:
    """Names of kernels launched as NAME[grid](..., **launch_kw())."""
    out = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
                and any(k.arg is None and isinstance(k.value, ast.Call)
                        and getattr(k.value.func, "id", "") == "launch_kw" for k in node.keywords)):
            out.add(node.func.value.id)
    return out


def _waits_first(fn: ast.FunctionDef) -> bool:
    """fn's first statement (after its docstring) is pdl_begin(PDL)."""
    first = _first_statement(fn)
    return (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
            and getattr(first.value.func, "id", "") == "pdl_begin"
            and [getattr(a, "id", None) for a in first.value.args] == ["PDL"])


def test_every_pdl_launch_waits_first():
    checked = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        kernels = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
        for name in sorted(_pdl_launches(tree)):
            assert name in kernels, f"{path.name}: {name} is launched with launch_kw() but not defined there"
            assert _waits_first(kernels[name]), \
                f"{path.name}:{kernels[name].lineno}: {name} is launched with PDL but does not wait first (pdl_begin)"
            params = [a.arg for a in kernels[name].args.args]
            assert "PDL" in params, f"{path.name}: {name} has no PDL constexpr for launch_kw to set"
            checked.append(name)
    # the graph backend's decode kernels: GEMV / GLU / x8, router and experts, attention, RoPE + append, sampler
    assert {"_gemv_kernel", "_glu_kernel", "_x8_kernel", "_router_kernel", "_expert_glu_kernel",
            "_expert_down_kernel", "_gqa_split_kernel", "_gqa_combine_kernel", "_rope_append_kernel",
            "_sample_tile_kernel", "_sample_final_kernel"} <= set(checked), checked


def test_the_check_catches_a_missing_wait():
    """The predicate the contract test uses: a wait after a load, or one without the PDL constexpr, fails."""
    late = ('@triton.jit\ndef k(x, PDL: tl.constexpr = False):\n    """doc"""\n    y = tl.load(x)\n'
            '    pdl_begin(PDL)\n\ndef launch(x):\n    k[(1,)](x, **launch_kw(x.device))\n')
    tree = ast.parse(late)
    assert _pdl_launches(tree) == {"k"}
    assert not _waits_first(tree.body[0])
    assert not _waits_first(ast.parse("def k(x):\n    pdl_begin()\n").body[0])
    assert _waits_first(ast.parse('def k(x, PDL):\n    """doc"""\n    pdl_begin(PDL)\n    y = 1\n').body[0])


def test_enabled_only_on_sm90_cuda(monkeypatch):
    """griddepcontrol is sm_90 PTX: an A100 (8.0) or L40S (8.9) must get plain launches, and the kernels must not
    even compile the wait there (PDL constexpr False)."""
    import torch
    from kie_moe.kernels import pdl
    monkeypatch.setattr(pdl, "_INTERPRET", False)
    monkeypatch.setattr(pdl, "_CAPABLE", {})
    caps = {0: (9, 0), 1: (8, 0), 2: (8, 9), 3: (10, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: caps[i])
    got = {i: pdl.launch_kw(torch.device("cuda", i)) for i in caps}
    assert got == {0: {"launch_pdl": True, "PDL": True}, 1: {"launch_pdl": False, "PDL": False},
                   2: {"launch_pdl": False, "PDL": False}, 3: {"launch_pdl": True, "PDL": True}}
    assert pdl.launch_kw(torch.device("cpu")) == {"launch_pdl": False, "PDL": False}
    monkeypatch.setattr(pdl, "PDL", False)                           # KIE_PDL=0
    assert pdl.launch_kw(torch.device("cuda", 0)) == {"launch_pdl": False, "PDL": False}

"""The PDL contract of kernels/pdl.py, checked on the source: a kernel launched with **launch_kw() (or
**prefetch_kw()) may start before its predecessor has finished, so it must call pdl_begin() before touching memory;
the one thing allowed before it is an `if PREFETCH:` call of an L2-prefetch helper (weights, read-only), and those
helpers may not load, store or use atomics. A launch site added without the wait (or a wait moved below a load) is
a data race that only shows on the GPU, sometimes: this test fails first."""
import ast
from pathlib import Path

import kie_moe.kernels as K

SRC = Path(K.__file__).parent


def _statements(fn: ast.FunctionDef) -> list[ast.stmt]:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value,
                                                                                                  str):
        body = body[1:]                                              # the docstring
    return body


def _is_prefetch_name(name: str) -> bool:
    return name.endswith("_prefetch") or name.startswith("l2_prefetch")


def _prefetch_block(stmt: ast.stmt) -> bool:
    """`if PREFETCH:` whose body is only calls of L2-prefetch helpers."""
    return (isinstance(stmt, ast.If) and getattr(stmt.test, "id", None) == "PREFETCH" and not stmt.orelse
            and all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                    and _is_prefetch_name(getattr(s.value.func, "id", "")) for s in stmt.body))


def _pdl_launches(tree: ast.Module) -> set[str]:
    """Names of kernels launched as NAME[grid](..., **launch_kw())."""
    out = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
                and any(k.arg is None and isinstance(k.value, ast.Call)
                        and getattr(k.value.func, "id", "") in ("launch_kw", "prefetch_kw") for k in node.keywords)):
            out.add(node.func.value.id)
    return out


def _waits_first(fn: ast.FunctionDef) -> bool:
    """fn's first statement (after its docstring) is pdl_begin(PDL), or the second one after a _prefetch_block."""
    body = _statements(fn)
    first = body[1] if _prefetch_block(body[0]) and len(body) > 1 else body[0]
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
            if _prefetch_block(_statements(kernels[name])[0]):
                assert "PREFETCH" in params, f"{path.name}: {name} has no PREFETCH constexpr for prefetch_kw to set"
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


def test_prefetch_helpers_only_prefetch():
    """What may run before the wait: the L2-prefetch helpers (and the helpers they call) hold no load, store or
    atomic; the kernels with a prefetch block are the o_proj ones (gemv, gemv_route)."""
    trees = {p.name: ast.parse(p.read_text()) for p in sorted(SRC.rglob("*.py"))}
    helpers = {n.name: (f, n) for f, t in trees.items() for n in t.body
               if isinstance(n, ast.FunctionDef) and _is_prefetch_name(n.name)}
    assert {"l2_prefetch_rows", "_gemv_prefetch", "_gemv_route_prefetch"} <= set(helpers), sorted(helpers)
    for name, (f, fn) in helpers.items():
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                assert not (node.func.attr in ("load", "store") or node.func.attr.startswith("atomic")), \
                    f"{f}: {name} calls tl.{node.func.attr} (only prefetches may run before the PDL wait)"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id[0] == "_":
                assert _is_prefetch_name(node.func.id), f"{f}: {name} calls {node.func.id}, not a prefetch helper"
    with_block = {n.name for t in trees.values() for n in t.body if isinstance(n, ast.FunctionDef)
                  and n.body and _prefetch_block(_statements(n)[0])}
    assert with_block == {"_gemv_kernel", "_gemv_route_kernel"}, with_block


def test_the_check_allows_only_a_prefetch_before_the_wait():
    ok = ('def k(w, PDL, PREFETCH):\n    """doc"""\n    if PREFETCH:\n        _w_prefetch(w)\n    pdl_begin(PDL)\n')
    load = 'def k(w, PDL, PREFETCH):\n    if PREFETCH:\n        y = tl.load(w)\n    pdl_begin(PDL)\n'
    other = 'def k(w, PDL, PREFETCH):\n    if PREFETCH:\n        _reduce(w)\n    pdl_begin(PDL)\n'
    late = 'def k(w, PDL, PREFETCH):\n    if PREFETCH:\n        _w_prefetch(w)\n    y = 1\n    pdl_begin(PDL)\n'
    assert _waits_first(ast.parse(ok).body[0])
    assert not any(_waits_first(ast.parse(src).body[0]) for src in (load, other, late))


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

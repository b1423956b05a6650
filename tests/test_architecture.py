"""The package's shape, checked: no import cycles anywhere (function-local imports included: a cycle
hidden inside a function is still a cycle), and dependencies point one way, gateway -> engine -> kernels."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "engine", "kernels", "loadgen")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Project modules this file imports at run time (anywhere in it; not under `if TYPE_CHECKING`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                found.add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:  # `from pkg import mod` imports pkg.mod; `from mod import name`, mod
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out = set()
    for name in found:
        while name and name not in modules:  # `from pkg import name`: the module, or the package
            name = name.rpartition(".")[0]
        if name and name != me:
            out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) for p in files}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    graph = _graph()
    assert len(graph) > 40  # the walk found the package
    for comp in _cycles(graph):
        raise AssertionError(f"import cycle: {' <-> '.join(comp)}")


def test_dependencies_point_one_way():
    graph = _graph()
    for mod, deps in graph.items():
        top = mod.split(".")[0]
        for d in deps:
            dtop = d.split(".")[0]
            if top == "engine":
                assert dtop != "gateway", f"{mod} imports {d}: the engine knows nothing of the gateway"
            if top == "kernels":
                assert dtop == "kernels", f"{mod} imports {d}: kernels are leaves"


def test_the_bench_client_is_a_plain_client():
    """loadgen (`sluice bench`) measures any server over HTTP: it imports no server code, and only the
    command line's dispatch (gateway.cli) imports it."""
    for mod, deps in _graph().items():
        for d in deps:
            top, dtop = mod.split(".")[0], d.split(".")[0]
            if top == "loadgen":
                assert dtop == "loadgen", f"{mod} imports {d}: the bench client imports no gateway, engine or kernels"
            elif dtop == "loadgen":
                assert mod == "gateway.cli", f"{mod} imports {d}: only `sluice bench`'s dispatch loads the client"


def test_the_checker_sees_a_cycle(tmp_path):
    """The cycle finder itself works (else the tests above could never fail)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []

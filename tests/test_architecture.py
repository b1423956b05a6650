"""The package's shape, checked: no import cycles anywhere (function-local imports included: a cycle
hidden inside a function is still a cycle), dependencies point one way, gateway -> engine -> kernels,
and inside the gateway its layers point down: each module sits on a floor (`GATEWAY_FLOORS`, read from
its path) and imports nothing on a higher one, type-only imports included (a type names its module's
layer as surely as a call does)."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gateway", "engine", "kernels", "loadgen")

# The gateway's floors, bottom to top: a module may import its own floor or a lower one, never a higher one.
GATEWAY_FLOORS: tuple[tuple[str, ...], ...] = (
    # 0: what every layer may use: errors and failure kinds, the typed messages, settings, the OpenAI
    # protocol (schema, tools, logprobs, the answer's encoders) and small helpers
    ("gateway.errors", "gateway.messages", "gateway.settings", "gateway.openai", "gateway.jsonio", "gateway.tasks",
     "gateway.omp"),
    # 1: who may ask and how much; the queue between gateways and engine workers; metrics, logs and the
    # dashboard's data (which reads the running gateway through a protocol); stored objects (responses)
    ("gateway.admission", "gateway.queue", "gateway.observability", "gateway.store"),
    ("gateway.backends",),  # 2: where a request is served: the local queue or the remote provider chain
    ("gateway.routing",),  # 3: which backend, the wait estimate, accounting, fallback, the sampler
    ("gateway.worker",),  # 4: drives an engine from the queue
    ("gateway.state",),  # 5: the app's typed state: every component above, wired once
    ("gateway.http",),  # 6: routes, middleware, lifecycle, the dashboard's routes, the server
    ("gateway.cli", "gateway.__main__"),  # 7: the command line
)


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: set[str], root: Path = ROOT, typing: bool = False) -> set[str]:
    """Project modules this file imports at run time (anywhere in it; under `if TYPE_CHECKING` only with
    `typing`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = _module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing:
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


def _graph(root: Path = ROOT, typing: bool = False) -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")]
    modules = {_module_name(p, root) for p in files}
    return {_module_name(p, root): _imports(p, modules, root, typing) for p in files}


def _floor(module: str) -> int:
    """The gateway module's floor, from its path (the package's own `__init__` is a docstring: floor 0)."""
    if module == "gateway":
        return 0
    for floor, prefixes in enumerate(GATEWAY_FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return floor
    raise AssertionError(f"{module} has no floor: add its folder to GATEWAY_FLOORS")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import inside the gateway that goes to a higher floor."""
    out = []
    for mod, deps in sorted(graph.items()):
        if mod.split(".")[0] != "gateway":
            continue
        for d in sorted(deps):
            if d.split(".")[0] == "gateway" and _floor(d) > _floor(mod):
                out.append(f"{mod} (floor {_floor(mod)}) imports {d} (floor {_floor(d)})")
    return out


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


def test_gateway_layers_point_down():
    graph = _graph(typing=True)
    assert sum(m.split(".")[0] == "gateway" for m in graph) > 40  # the walk found the gateway
    upward = _upward(graph)
    assert not upward, "imports that go up a floor:\n  " + "\n  ".join(upward)


def test_the_checker_sees_an_upward_import(tmp_path):
    """The floor rule itself works (else the test above could never fail): on a synthetic graph, and on a
    copy of the gateway with an upward import planted at run time and one under `if TYPE_CHECKING`."""
    assert _upward({"gateway.routing.router": {"gateway.http.errors", "gateway.errors"}, "gateway.errors": set()}) \
        == ["gateway.routing.router (floor 3) imports gateway.http.errors (floor 6)"]
    assert _upward({"gateway.http.routes": {"gateway.state", "gateway.openai.schema"}}) == []

    shutil.copytree(ROOT / "gateway", tmp_path / "gateway", ignore=shutil.ignore_patterns("__pycache__", "static"))
    router = tmp_path / "gateway" / "routing" / "router.py"
    router.write_text(router.read_text() + "\nfrom gateway.state import GatewayState  # noqa\n")
    messages = tmp_path / "gateway" / "messages.py"
    messages.write_text(messages.read_text().replace(
        "if TYPE_CHECKING:\n", "if TYPE_CHECKING:\n    from gateway.http.routes import chat_completions\n", 1))
    at_run_time = "gateway.routing.router (floor 3) imports gateway.state (floor 5)"
    type_only = "gateway.messages (floor 0) imports gateway.http.routes (floor 6)"
    assert _upward(_graph(tmp_path, typing=True)) == [type_only, at_run_time]
    assert _upward(_graph(tmp_path, typing=False)) == [at_run_time]


def _behind_the_front_door(graph: dict[str, set[str]]) -> list[str]:
    """Every gateway import of an engine module other than the `engine` package itself."""
    return [f"{mod} imports {d}" for mod, deps in sorted(graph.items()) if mod.split(".")[0] == "gateway"
            for d in sorted(deps) if d.split(".")[0] == "engine" and d != "engine"]


def test_the_gateway_uses_only_the_engines_front_door():
    """The gateway imports the `engine` package itself, never its submodules (type-only imports included):
    what `engine/__init__.py` exports is the engine's whole surface, so the engine may rearrange the rest."""
    graph = _graph(typing=True)
    assert any("engine" in deps for mod, deps in graph.items() if mod.startswith("gateway."))  # it does use it
    inside = _behind_the_front_door(graph)
    assert not inside, "imports past engine/__init__.py:\n  " + "\n  ".join(inside)


def test_the_checker_sees_an_engine_submodule_import(tmp_path):
    """The front-door rule itself works: on a synthetic graph, and on a copy of the gateway and the engine
    with `from engine.loader import ...` planted in a gateway module."""
    synthetic = {"gateway.worker.factory": {"engine.loader", "engine", "gateway.settings"},
                 "engine.engine": {"engine.loader"}}
    assert _behind_the_front_door(synthetic) == ["gateway.worker.factory imports engine.loader"]
    assert _behind_the_front_door({"gateway.messages": {"engine"}}) == []

    for pkg in ("gateway", "engine"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "static"))
    factory = tmp_path / "gateway" / "worker" / "factory.py"
    factory.write_text(factory.read_text() + "\nfrom engine.loader import load_model  # noqa\n")
    assert _behind_the_front_door(_graph(tmp_path)) == ["gateway.worker.factory imports engine.loader"]

"""The layout rules of DESIGN.md §14, read from the code's imports (no module is run): the runtime
packages' imports form no cycle, layers point down (cluster -> replicas -> kernels, router
beside), no runtime module imports a tool, and Ray is imported only where DESIGN allows it.

Every import counts, a function's too (a lazy import is still an arrow between layers), except
those under `if TYPE_CHECKING:`, which run only for the type checker."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cluster", "replicas", "router", "kernels")  # the layers, chunkserve.<package>
# what each runtime package may import of the others (chunkserve/router/hashing.py and events.py are
# shared by the replicas' tree and the router, which runs beside them; frames.py by their TCP links)
MAY_IMPORT = {
    "cluster": {"chunkserve.replicas", "chunkserve.router", "chunkserve.kernels"},
    "replicas": {
        "chunkserve.kernels",
        "chunkserve.router.hashing",
        "chunkserve.router.events",
        "chunkserve.router.frames",
    },
    "router": set(),
    "kernels": set(),
}
RAY_ALLOWED = ("chunkserve.cluster.", "chunkserve.router.serve_router", "chunkserve.replicas.deployment")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_tool(module: str) -> bool:
    """Benchmarks, simulators, reports and the load test: apart from the runtime (DESIGN §14)."""
    return ".tools" in module or module.startswith("chunkserve.cluster.loadtest")


MODULES = {_module_name(p): p for p in sorted((ROOT / "chunkserve").rglob("*.py"))}


def _package(module: str) -> str:
    """chunkserve.replicas.engine.llm_engine -> replicas (chunkserve itself: its own)."""
    return module.split(".")[1] if module.count(".") else module


def _imports(path: Path) -> set[str]:
    """The dotted names a module imports at run time: modules, or a module's name for a name
    taken from it (`from a.b import c` is a.b.c where that is a module, else a.b)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only |= {id(n) for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


IMPORTS = {name: _imports(path) for name, path in MODULES.items()}
RUNTIME = sorted(name for name in MODULES if not _is_tool(name))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _within(module: str, allowed: set[str] | tuple[str, ...]) -> bool:
    return any(module == a or module.startswith(a + ".") or (a.endswith(".") and module.startswith(a)) for a in allowed)


def test_the_layout_is_read():
    # (a rule over no modules would pass whatever the code did)
    assert len(RUNTIME) > 50
    assert {"chunkserve.replicas.engine.llm_engine", "chunkserve.cluster.ingress", "chunkserve.kernels.tpp"} <= set(
        RUNTIME
    )
    assert {"chunkserve.router.policy", "chunkserve"} <= set(RUNTIME)
    assert "chunkserve.replicas.engine.distributed" in IMPORTS["chunkserve.replicas.engine.llm_engine"]
    assert any(_is_tool(m) for m in MODULES)


def test_no_import_cycle_among_runtime_modules():
    graph = {m: {i for i in IMPORTS[m] if i in MODULES and not _is_tool(i) and i != m} for m in RUNTIME}
    # a package's __init__ importing its own submodules is how packages are made, not a cycle
    graph = {m: {i for i in out if not m.startswith(i + ".")} for m, out in graph.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_runtime_module_imports_a_tool():
    assert [(m, i) for m in RUNTIME for i in IMPORTS[m] if i in MODULES and _is_tool(i)] == []


@pytest.mark.parametrize("package", PACKAGES)
def test_layers_point_down(package):
    upward = [
        (m, i)
        for m in RUNTIME
        if _package(m) == package
        for i in IMPORTS[m]
        if i in MODULES and _package(i) != package and not _within(i, MAY_IMPORT[package])
    ]
    assert upward == []


def test_ray_only_where_design_allows_it():
    assert [
        m for m in RUNTIME if any(i.split(".")[0] == "ray" for i in IMPORTS[m]) and not _within(m, RAY_ALLOWED)
    ] == []


def _children(package: Path) -> list[str]:
    """A package's modules and subpackages, by name (its __init__ and __main__ aside)."""
    mods = [p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    subs = [p.name for p in package.iterdir() if (p / "__init__.py").exists()]
    return sorted(mods + subs)


PACKAGE_DIRS = sorted(p.parent for p in (ROOT / "chunkserve").rglob("__init__.py"))


@pytest.mark.parametrize("package", PACKAGE_DIRS, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_docstring_names_its_files(package):
    """A package's docstring is the map of its folder: it names every module and subpackage in
    it (as a word), so the map stays true as files come and go."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", doc))
    assert [name for name in _children(package) if name not in words] == []


def test_each_test_file_says_what_it_tests():
    undocumented = [
        p.name for p in sorted((ROOT / "tests").glob("test_*.py")) if not ast.get_docstring(ast.parse(p.read_text()))
    ]
    assert undocumented == []


# Constructors still over the bound (issue 49 item 2), each to take a config or a small shape
# object (none now: the FlashInfer wrappers and fixed TPP plans take a kernels.heads.PagedHeads).
WIDE_CONSTRUCTORS: set[str] = set()


def _wide_constructors() -> dict[str, list[str]]:
    """Runtime classes whose __init__ takes more than 5 arguments besides configs (a parameter
    named *config) and the engine's shared counters."""
    wide = {}
    for name in RUNTIME:
        for cls in ast.walk(ast.parse(MODULES[name].read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    a = fn.args
                    params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs][1:]
                    params = [p for p in params if not p.endswith("config") and p != "counters"]
                    if len(params) > 5:
                        wide[f"{name}.{cls.name}"] = params
    return wide


def test_constructors_take_a_config_not_a_list_of_fields():
    wide = _wide_constructors()
    assert sorted(set(wide) - WIDE_CONSTRUCTORS) == [], "take a config (or a small shape object) instead"
    assert sorted(WIDE_CONSTRUCTORS - set(wide)) == [], "narrowed: take it off WIDE_CONSTRUCTORS"

"""Imports point one way (docs/design.md §8): no cycles, and pure modules stay pure.

Pure: the graph is read from the source with ``ast`` (nothing is imported), so a
cycle that only shows up under ``TYPE_CHECKING`` or inside a function counts too:
it is still a design dependency in both directions.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections.abc import Iterator, Mapping

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("proxy", "plugins")

# Sans-I/O modules (docs/design.md §8): fed bytes and scalars, they return values.
# They may import only each other within the project, and no I/O library.
PURE = frozenset(
    {
        "proxy._answer",
        "proxy._cluster.keys",
        "proxy._cluster.scripts",
        "proxy._coding",
        "proxy._emulator_frames",
        "proxy._emulator_script",
        "proxy._headers",
        "proxy._http1",
        "proxy._holders",
        "proxy._phases",
        "proxy._pool",
        "proxy._protocols",
        "proxy._session_ids",
        "proxy._shared",
        "proxy._sse",
        "proxy._stream",
        "proxy._structure",
        "proxy._tombstones",
        "proxy._wire",
    }
)
PURE_PACKAGES = frozenset({"proxy._protocols"})  # every submodule is pure as well

# The I/O edges: a pure module importing one of these is the bug this test is for.
IO_MODULES = frozenset(
    {
        "proxy._admin",
        "proxy._app",
        "proxy._body",
        "proxy._cli",
        "proxy._connect",
        "proxy._cluster.ledger",
        "proxy._cluster.node",
        "proxy._cluster.store",
        "proxy._demo",
        "proxy._emulator",
        "proxy._relay",
        "proxy._front",
        "proxy._listener",
        "proxy._request",
        "proxy._stream_answer",
        "proxy._state",
        "proxy._upstream",
    }
)
IO_LIBRARIES = frozenset(
    {"aiohttp", "asyncio", "redis", "selectors", "socket", "ssl", "subprocess", "threading"}
)


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> source file, for every module of the project's packages."""
    found: dict[str, pathlib.Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: pathlib.Path) -> Iterator[str]:
    """Every absolute module name ``name``'s source imports, anywhere in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            yield module
            yield from (f"{module}.{alias.name}" for alias in node.names)


def import_graph(files: Mapping[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports.

    ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
    ``pkg``; a module's own parent packages, imported by Python on the way, are not
    edges unless named.
    """
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for target in _imports(name, path):
            if target in files:
                deps.add(target)
        # `from . import wire` yields both "proxy" and "proxy._wire": keep only the module.
        for target in list(deps):
            parent = target.rpartition(".")[0]
            if parent in deps and _only_submodules_named(name, files[name], parent, files):
                deps.discard(parent)
        deps.discard(name)
        graph[name] = deps
    return graph


def _only_submodules_named(
    name: str, path: pathlib.Path, parent: str, files: Mapping[str, pathlib.Path]
) -> bool:
    """Whether every ``from <parent> import ...`` in ``name`` names submodules only."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name == parent for a in node.names):
            return False
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join([*base, node.module] if node.module else base)
        else:
            module = node.module or ""
        if module == parent and any(f"{parent}.{a.name}" not in files for a in node.names):
            return False
    return True


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def is_pure(name: str) -> bool:
    return name in PURE or any(name.startswith(package + ".") for package in PURE_PACKAGES)


def reachable(graph: Mapping[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` imports directly or through others -> the module importing it."""
    via: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop()
        for dep in graph.get(node, ()):
            if dep not in via and dep != start:
                via[dep] = node
                todo.append(dep)
    return via


def test_the_pure_and_io_lists_name_real_modules() -> None:
    files = module_files()
    missing = (PURE | IO_MODULES) - files.keys()
    assert not missing, f"listed modules that do not exist (renamed or removed?): {missing}"
    assert not PURE & IO_MODULES


def test_no_import_cycle_among_project_modules() -> None:
    found = cycles(import_graph(module_files()))
    assert found == [], f"import cycles: {found}"


def test_pure_modules_import_only_pure_modules_and_no_io_library() -> None:
    files = module_files()
    graph = import_graph(files)
    problems: list[str] = []
    for name in sorted(n for n in files if is_pure(n)):
        for dep, importer in sorted(reachable(graph, name).items()):
            if not is_pure(dep):
                kind = "an I/O module" if dep in IO_MODULES else "a non-pure module"
                problems.append(f"{name} reaches {kind} {dep} (imported by {importer})")
        for target in _imports(name, files[name]):
            if target.partition(".")[0] in IO_LIBRARIES:
                problems.append(f"{name} imports the I/O library {target}")
    assert problems == []


# Pure modules that import nothing of ours at all: the HTTP/1.1 core (its limits live in
# it) and the upstream pool's policy.
SELF_CONTAINED = frozenset({"proxy._http1", "proxy._pool"})


def test_the_http1_core_imports_nothing_of_ours() -> None:
    files = module_files()
    graph = import_graph(files)
    assert files.keys() >= SELF_CONTAINED
    assert {name: graph[name] for name in SELF_CONTAINED} == {n: set() for n in SELF_CONTAINED}


# Rooms kept apart (docs/design.md §8): ``(module, what it must not reach)``. The exchange
# holds and drops the buffers; running plugins on them is the preparer's job, and a
# preparer reachable from the exchange would let plugin code creep back in.
APART = frozenset({("proxy._exchange", "proxy._prepare")})


def test_rooms_kept_apart_do_not_reach_each_other() -> None:
    files = module_files()
    graph = import_graph(files)
    assert {name for pair in APART for name in pair} <= files.keys()
    reached = {
        (name, banned, reachable(graph, name).get(banned))
        for name, banned in sorted(APART)
        if banned in reachable(graph, name)
    }
    assert reached == set(), "(module, banned module, imported by)"


# The checks above are only as good as the graph: prove they see what they must.


def test_the_checker_finds_cycles_including_type_checking_only_ones(tmp_path: pathlib.Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
    )
    (pkg / "c.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "d.py").write_text("from . import a\n")  # imports into the cycle, not part of it
    files = {
        "pkg": pkg / "__init__.py",
        **{f"pkg.{m}": pkg / f"{m}.py" for m in "abcd"},
    }
    graph = import_graph(files)
    assert graph["pkg.a"] == {"pkg.b"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert reachable(graph, "pkg.d") == {"pkg.a": "pkg.d", "pkg.b": "pkg.a", "pkg.c": "pkg.b"}


def test_the_real_graph_has_the_edges_the_layout_promises() -> None:
    graph = import_graph(module_files())
    assert "proxy._wire" in graph["proxy._app"]  # `from . import protocols, wire`
    assert "proxy._sse" in graph["proxy._protocols._common"]  # `from ..sse import SSEEvent`
    assert "proxy" not in graph["proxy._app"]  # the package itself only via a named import


def test_the_emulator_shares_no_protocol_code_with_the_proxy() -> None:
    """The upstream emulator is an independent implementation: it must not agree with our bugs."""
    graph = import_graph(module_files())
    for name in ("proxy._emulator", "proxy._emulator_frames", "proxy._emulator_script"):
        reached = reachable(graph, name).keys()
        shared = {m for m in reached if m in {"proxy._sse", "proxy._protocols"} or is_pure(m)}
        shared -= {"proxy._emulator_frames", "proxy._emulator_script"}
        assert shared == set(), f"{name} reaches {sorted(shared)}"


# The built-in plugins are the examples plugin authors copy: they use the public API only.


def private_uses(path: pathlib.Path) -> list[str]:
    """Every use of the project's internals in ``path``: imports of a ``proxy`` submodule
    other than the public ones, imports of another plugin module, and ``proxy._name``
    attribute reads."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # a relative import reaches a sibling plugin module
                found.append(f"line {node.lineno}: relative import from {node.module or '.'}")
                continue
            modules = [node.module or ""]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "proxy"
            and node.attr.startswith("_")
        ):
            found.append(f"line {node.lineno}: proxy.{node.attr}")
            continue
        else:
            continue
        for module in modules:
            top = module.partition(".")[0]
            if top in PACKAGES and module != "proxy":
                found.append(f"line {node.lineno}: import of {module}")
    return found


def test_the_built_in_plugins_use_only_the_public_api() -> None:
    problems = {
        path.name: uses
        for path in sorted((ROOT / "plugins").glob("*.py"))
        if (uses := private_uses(path))
    }
    assert problems == {}, "plugins/ may import only `proxy` (and the stdlib, third parties)"


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("from proxy import Plugin\nimport json\nimport redis\n", []),
        ("import proxy\nx = proxy.Plugin\n", []),
        ("from proxy._cluster import RedisStore\n", ["line 1: import of proxy._cluster"]),
        ("import proxy._wire as w\n", ["line 1: import of proxy._wire"]),
        ("from proxy.testing import make_record\n", ["line 1: import of proxy.testing"]),
        ("import proxy\nx = proxy._plugins\n", ["line 2: proxy._plugins"]),
        ("from plugins.fold import FoldPlugin\n", ["line 1: import of plugins.fold"]),
        ("from .fold import FoldPlugin\n", ["line 1: relative import from fold"]),
    ],
)
def test_the_plugin_rule_sees_every_way_in(
    tmp_path: pathlib.Path, source: str, found: list[str]
) -> None:
    path = tmp_path / "plugin.py"
    path.write_text(source)
    assert private_uses(path) == found


def test_neither_proxy_nor_the_ledger_imports_redis_until_cluster_mode() -> None:
    """Redis is a cluster-mode dependency: importing the API and the plugins loads none of it."""
    code = (
        "import sys, proxy, plugins.ledger, plugins.fold, plugins.usage, plugins.jsonlog\n"
        "print(sorted(m for m in sys.modules if m == 'redis' or m.startswith('redis.')))\n"
        "proxy.open_ledger_gate('redis://127.0.0.1:1/0')\n"
        "print('redis' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "True"]

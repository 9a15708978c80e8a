"""The import graph, read from the source with `ast` (no module is imported).

- No import cycle between modules of agent_core. Every import counts, wherever it is written:
  module level, inside a function (the usual way to hide a cycle from the interpreter) or under
  `if TYPE_CHECKING:`. A cycle fails the test with its modules, each import's line and kind.
- Only agent_core.io imports pyarrow's file formats (pyarrow.parquet, .csv, ...): import-linter
  (`lint-imports`, the contracts in pyproject.toml) can forbid whole external packages only, and
  pyarrow itself is fine anywhere.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("agent_core", "tasks", "flows", "schemas")
PYARROW_FILE_FORMATS = ("pyarrow.parquet", "pyarrow.csv", "pyarrow.dataset", "pyarrow.feather", "pyarrow.orc")


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str  # the module named (a submodule where `from package import name` names one)
    line: int
    kind: str  # "module-level", "function-level" or "TYPE_CHECKING"


def module_files(package: str, root: Path = REPO_ROOT) -> dict[str, Path]:
    """Every module of `package` by dotted name (a package by its own name, for its __init__.py)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports_in(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement of a module with its kind, found at any depth."""
    found = []

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            child_kind = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == "module-level":
                child_kind = "function-level"
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, kind))
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.body:
                    visit_statement(statement, "TYPE_CHECKING")
                for statement in child.orelse:
                    visit_statement(statement, kind)
                continue
            visit(child, child_kind)

    def visit_statement(statement: ast.stmt, kind: str) -> None:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            found.append((statement, kind))
        else:
            holder = ast.Module(body=[statement], type_ignores=[])
            visit(holder, kind)

    visit(tree, "module-level")
    return found


def _absolute(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(importer: str, path: Path, known: set[str] | None = None) -> list[Import]:
    """The imports of one module. With `known` (module names), a `from package import name` that
    names a submodule is an import of that submodule."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    result = []
    for node, kind in _imports_in(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            module = _absolute(importer, is_package, node)
            targets = []
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                if known is not None and submodule in known:
                    targets.append(submodule)
                elif known is None:
                    targets.extend([module, submodule])  # for external packages: either may be meant
                else:
                    targets.append(module)
        result.extend(Import(importer, target, node.lineno, kind) for target in dict.fromkeys(targets))
    return result


def _nearest_known(name: str, known: set[str]) -> str | None:
    """`name` or its closest enclosing package among `known` (`import a.b.c` where c is a class)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def internal_graph(package: str, root: Path = REPO_ROOT) -> dict[str, dict[str, list[Import]]]:
    """importer -> imported -> the imports behind that edge, between modules of `package`."""
    files = module_files(package, root)
    known = set(files)
    graph: dict[str, dict[str, list[Import]]] = defaultdict(lambda: defaultdict(list))
    for importer, path in files.items():
        for item in imports_of(importer, path, known):
            target = _nearest_known(item.imported, known)
            if target is not None and target != importer:
                graph[importer][target].append(item)
    return graph


def strongly_connected_components(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components of more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    nodes = sorted(set(graph) | {t for targets in graph.values() for t in targets})
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def shortest_cycle(graph: dict[str, dict[str, list[Import]]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, {})):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # cannot happen in a strongly connected component


def describe_cycles(graph: dict[str, dict[str, list[Import]]]) -> list[str]:
    lines = []
    for component in strongly_connected_components(graph):
        cycle = shortest_cycle(graph, component)
        lines.append(f"cycle of {len(component)} module(s) {', '.join(component)}; for example:")
        lines.append(f"    {cycle[0]}")
        for importer, imported in zip(cycle, cycle[1:]):
            where = ", ".join(f"l.{i.line} {i.kind}" for i in graph[importer][imported])
            lines.append(f"      -> {imported}   ({importer} {where})")
        inside = [f"{importer} -> {imported} (l.{', l.'.join(str(i.line) for i in items)})"
                  for importer in component for imported, items in sorted(graph[importer].items()) if imported in component]
        lines.append("    every import inside it: " + "; ".join(inside))
    return lines


def test_no_import_cycle_inside_agent_core():
    graph = internal_graph("agent_core")
    assert graph, "no imports found: is the checkout layout right?"
    cycles = describe_cycles(graph)
    assert not cycles, ("import cycles between agent_core modules (function-level and TYPE_CHECKING imports "
                        "count: move the shared part to a lower module instead):\n" + "\n".join(cycles))


def test_only_agent_core_io_imports_pyarrow_file_formats():
    offenders = []
    for package in PACKAGES:
        for module, path in module_files(package).items():
            if module == "agent_core.io" or module.startswith("agent_core.io."):
                continue
            for item in imports_of(module, path):
                if item.imported in PYARROW_FILE_FORMATS or item.imported.startswith(
                        tuple(f"{name}." for name in PYARROW_FILE_FORMATS)):
                    offenders.append(f"{module} l.{item.line} ({item.kind}) imports {item.imported}")
    assert not offenders, ("only agent_core.io reads and writes table files; route these through it:\n  "
                           + "\n  ".join(offenders))


def test_the_cycle_finder_finds_function_level_cycles(tmp_path):
    """The checker itself: a cycle hidden in a function is found, a one-way import is not a cycle."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub.b import thing\n")
    (package / "a.py").write_text("from pkg import c\n\ndef f():\n    from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\nthing = 1\n")
    (package / "c.py").write_text("import os\n")
    graph = internal_graph("pkg", tmp_path)
    assert strongly_connected_components(graph) == [["pkg.a", "pkg.sub.b"]]
    text = "\n".join(describe_cycles(graph))
    assert "l.4 function-level" in text and "l.3 TYPE_CHECKING" in text and "pkg.c" not in text


def test_a_run_without_a_cluster_never_imports_ray():
    """docs/architecture.md: Ray, and the cluster modules that use it, are imported only when
    `cluster.address` is set; of agent_core/cluster only the placement (which decides it) is. Importing
    the training flow and the CLI must not load more (a fresh interpreter: this test process may have
    imported them for other tests)."""
    import subprocess
    import sys

    code = ("import sys, flows.train, flows.cli, flows.rerun; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'agent_core.cluster.')) "
            "and m != 'agent_core.cluster.placement'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"

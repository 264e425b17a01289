"""The package's import graph, parsed from the source (imports at module top and inside functions):
no cycles, no private name (``_x``) imported from another module, and every name imported from the
project exists where it is imported from. A cycle, or a name that moved, hides behind an import
placed inside a function until the day that function runs."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "rlhf_hpc"
# The layers, bottom first: a module imports only from its own layer and the ones before it (each
# folder of rlhf_hpc/ is a layer; cli, worker, preflight and bench sit on top). docs/architecture.md
# says what each holds.
LAYERS = ("config", "ops", "models", "distributed", "planning", "recipe", "rollout", "rewards", "data",
          "observability", "launch", "ppo", "top")
TOP = ("cli", "worker", "preflight", "bench")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """({module: modules of the package it imports}, [(module, imported from, private name)])."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    private = []
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
                if base in files and base != mod:
                    private += [(mod, base, a.name) for a in node.names
                                if a.name.startswith("_") and not a.name.startswith("__")]
            else:
                continue
            for target in targets:
                while target and target not in files:  # a name inside a module: that module
                    target = target.rpartition(".")[0]
                if target and target != mod and target != "rlhf_hpc":
                    graph[mod].add(target)
    return graph, private


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_the_package_has_no_import_cycles():
    graph, _ = import_graph()
    assert len(graph) > 40 and "rlhf_hpc.ppo.trainer" in graph["rlhf_hpc.worker"]  # the parse sees the package
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def defined_names(path: Path) -> set[str]:
    """The names a module binds at its top level (definitions, assignments, its own imports)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):  # e.g. a guarded import: count what its branches bind
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
                elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, ast.Assign):
                    names |= {n.id for t in sub.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def test_every_imported_project_name_exists():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    sources = list(PACKAGE.rglob("*.py")) + list((REPO / "tests").glob("*.py")) + [REPO / "launch.py"]
    defined = {m: defined_names(p) for m, p in files.items()}
    missing = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in files:
                missing += [f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                            if a.name not in defined[node.module] and f"{node.module}.{a.name}" not in files]
    assert missing == []


def layer(module: str) -> str:
    head = module.split(".")[1]
    return "top" if head in TOP else head


def test_every_module_sits_in_a_layer_and_imports_only_from_below():
    graph, _ = import_graph()
    modules = [m for m in graph if m != "rlhf_hpc"]
    assert sorted({layer(m) for m in modules} - set(LAYERS)) == []  # a new folder gets its place in LAYERS
    upward = sorted(f"{m} imports {d} ({layer(m)} < {layer(d)})" for m in modules for d in graph[m]
                    if d != "rlhf_hpc" and LAYERS.index(layer(d)) > LAYERS.index(layer(m)))
    assert upward == []


def test_no_private_name_is_imported_across_modules():
    _, private = import_graph()
    assert private == []

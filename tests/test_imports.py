"""The package's import graph, parsed from the source (imports at module top and inside functions):
no cycles, no private name (``_x``) imported from another module, and every name imported from the
project exists where it is imported from. A cycle, or a name that moved, hides behind an import
placed inside a function until the day that function runs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "rlhf_hpc"
# The layers, bottom first: a module imports only from its own layer and the ones before it (each
# folder of rlhf_hpc/ is a layer; cli, worker, preflight and hardware_checks sit on top). docs/architecture.md
# says what each holds.
LAYERS = (
    "config",
    "ops",
    "models",
    "distributed",
    "planning",
    "tools",
    "recipe",
    "rollout",
    "rewards",
    "data",
    "observability",
    "launch",
    "ppo",
    "top",
)
TOP = ("cli", "worker", "preflight", "hardware_checks")


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
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
                if base in files and base != mod:
                    private += [
                        (mod, base, a.name)
                        for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                    ]
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
    sources += list((REPO / "benchmarks").glob("*.py"))
    defined = {m: defined_names(p) for m, p in files.items()}
    missing = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in files:
                missing += [
                    f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name not in defined[node.module] and f"{node.module}.{a.name}" not in files
                ]
    assert missing == []


def layer(module: str) -> str:
    head = module.split(".")[1]
    return "top" if head in TOP else head


def test_every_module_sits_in_a_layer_and_imports_only_from_below():
    graph, _ = import_graph()
    modules = [m for m in graph if m != "rlhf_hpc"]
    assert sorted({layer(m) for m in modules} - set(LAYERS)) == []  # a new folder gets its place in LAYERS
    upward = sorted(
        f"{m} imports {d} ({layer(m)} < {layer(d)})"
        for m in modules
        for d in graph[m]
        if d != "rlhf_hpc" and LAYERS.index(layer(d)) > LAYERS.index(layer(m))
    )
    assert upward == []


def test_no_private_name_is_imported_across_modules():
    _, private = import_graph()
    assert private == []


# ------------------------------------------------------------------ registries: no catch-all
def registries():
    """Every registry of the package (each module that defines one imported)."""
    import importlib

    from rlhf_hpc.config.registry import REGISTRIES

    for module in (
        "rlhf_hpc.config.engines",
        "rlhf_hpc.config.trackers",
        "rlhf_hpc.ops.estimators",
        "rlhf_hpc.ops.policy_losses",
        "rlhf_hpc.rewards",
        "rlhf_hpc.planning.hardware",
    ):
        importlib.import_module(module)
    return {r.key: r for r in REGISTRIES}


def test_every_registry_refuses_an_unknown_name_with_its_key_and_names():
    import pytest

    from rlhf_hpc.config.errors import ConfigError

    found = registries()
    assert {
        "algorithm.adv_estimator",
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        "actor_rollout_ref.rollout.name",
        "trainer.logger",
        "data_source",
    } <= set(found)
    for key, registry in found.items():
        assert len(registry) > 0, key
        with pytest.raises(ConfigError) as e:
            registry["no_such_name"]
        assert key in str(e.value) and all(name in str(e.value) for name in registry), str(e.value)


def test_an_unknown_name_raises_where_each_registry_is_used(tmp_path):
    """The dispatch sites: an estimator, a policy loss, an engine, a tracker unknown to their registry
    raise (no if-chain whose last branch runs a default)."""
    import pytest
    import torch

    from rlhf_hpc.config.errors import ConfigError
    from rlhf_hpc.config.schema import ActorConfig, AlgorithmConfig
    from rlhf_hpc.observability.tracking import Tracker
    from rlhf_hpc.ops.estimators import AdvantageInputs, compute_advantages
    from rlhf_hpc.ppo.actor import Actor
    from rlhf_hpc.recipe.load import load_config
    from rlhf_hpc.rollout.factory import make_engine

    x = AdvantageInputs(torch.ones(4, 3), torch.ones(4, 3), torch.tensor([0, 0, 1, 1]), num_groups=2)
    with pytest.raises(ConfigError, match="algorithm.adv_estimator: unknown advantage estimator 'grpoo'.*grpo"):
        compute_advantages(AlgorithmConfig(adv_estimator="grpoo"), x)
    actor_cfg = ActorConfig()
    actor_cfg.policy_loss.loss_mode = "gspoo"
    with pytest.raises(ConfigError, match="policy_loss.loss_mode: unknown policy loss 'gspoo'.*vanilla"):
        Actor(torch.nn.Linear(1, 1), actor_cfg)
    cfg, _ = load_config("tiny_klppo", [])
    cfg.actor_rollout_ref.rollout.name = "sglang"
    with pytest.raises(ConfigError, match="rollout.name: unknown rollout engine 'sglang'.*vllm, hf"):
        make_engine(cfg, "tiny://qwen2", torch.device("cpu"))
    cfg.trainer.logger = ["console", "swanlab"]
    with pytest.raises(ConfigError, match="trainer.logger: unknown logger 'swanlab'.*console"):
        Tracker(cfg, tmp_path, is_main=True, total_steps=1)


def test_registry_entries_resolve_to_what_the_layers_above_call():
    """The tables kept below their implementations (engines, trackers) name classes that exist and
    have the interface their callers use; each estimator declares what the checks read."""
    from rlhf_hpc.config.engines import ENGINES
    from rlhf_hpc.config.trackers import TRACKERS
    from rlhf_hpc.observability.tracking import backend_class
    from rlhf_hpc.ops.estimators import ADV_ESTIMATORS
    from rlhf_hpc.rollout.base import RolloutEngine
    from rlhf_hpc.rollout.factory import engine_class

    for spec in ENGINES.values():
        cls = engine_class(spec)
        assert cls.name == spec.name
        for member in ("generate", "update_weights", "weight_spec", "release", "resume", "close"):
            assert callable(getattr(cls, member, None)), (spec.name, member)
        assert hasattr(cls, "adapter_rank")
        assert set(RolloutEngine.__annotations__) >= {"name", "dp_rank", "adapter_rank"}
    for spec in TRACKERS.values():
        cls = backend_class(spec)
        assert cls.name == spec.name and callable(cls.log) and callable(cls.close)
    assert ADV_ESTIMATORS["gae"].needs_critic and not ADV_ESTIMATORS["gae"].grouped
    assert ADV_ESTIMATORS["grpo"].grouped and not ADV_ESTIMATORS["grpo"].needs_critic


def test_no_name_of_a_registry_is_compared_outside_it():
    """A dispatch on an estimator, loss or engine name by comparison (``adv_estimator == "gae"``,
    ``rollout.name != "hf"``) is the catch-all the registries replace: what differs between entries
    is a field of the entry."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                named = [o.attr for o in operands if isinstance(o, ast.Attribute)]
                if (
                    {"adv_estimator", "loss_mode"} & set(named)
                    or any(
                        isinstance(o, ast.Attribute)
                        and o.attr == "name"
                        and "rollout" in (getattr(o.value, "attr", None), getattr(o.value, "id", None))
                        for o in operands
                    )
                    and any(isinstance(o, ast.Constant) and o.value in ("hf", "vllm") for o in operands)
                ):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []


# ------------------------------------------------------------------ imports inside functions
def inner_project_imports(path: Path) -> list[ast.stmt]:
    """The imports of the package's own modules that sit inside a function of ``path``."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                if getattr(child, "level", 0) or any(n == "rlhf_hpc" or n.startswith("rlhf_hpc.") for n in names):
                    found.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text()), False)
    return found


def test_an_import_inside_a_function_says_why():
    """An import of the package's own modules belongs at the top of the module (no cycle needs one
    inside a function: the graph above is acyclic counting them); one stays inside only to keep a
    heavy optional package (vLLM, submitit, ...) off the import path of a light entry point, and then
    a comment on its line or the line before says so (a block of imports under one comment counts)."""
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in inner_project_imports(path):
            row = node.lineno - 1
            # walk up a block of consecutive imports to the comment above it
            while "#" not in lines[row]:
                above = lines[row - 1].strip()
                if above.startswith(("import ", "from ")):
                    row -= 1
                elif above == "" and lines[row - 2].strip().startswith(("import ", "from ", "#")):
                    row -= 1  # the blank line the formatter puts between other packages' imports and ours
                else:
                    break
            if "#" not in lines[row] and not lines[row - 1].strip().startswith("#"):
                unexplained.append(f"{path.relative_to(REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert unexplained == []


def test_the_inner_import_finder_sees_imports_in_nested_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "import os\ndef f():\n    def g():\n        from rlhf_hpc.config import tree\n"
        "    import json\n    from . import x\n"
    )
    assert [n.lineno for n in inner_project_imports(source)] == [4, 6]


# ------------------------------------------------------------------ __all__: each module's public surface
def declared_all(path: Path) -> list[str] | None:
    """The names a module's top-level ``__all__`` lists (None: it has none)."""
    for node in ast.parse(path.read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            assert isinstance(node.value, (ast.List, ast.Tuple)), f"{path}: __all__ must be a literal list"
            return [e.value for e in node.value.elts]
    return None


def defines_anything(path: Path) -> bool:
    """Whether a module binds a name of its own at top level (a package's docstring-only
    ``__init__.py`` does not)."""
    return any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign))
        for n in ast.parse(path.read_text()).body
    )


def test_every_module_declares_its_public_surface():
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    missing = sorted(m for m, p in files.items() if defines_anything(p) and declared_all(p) is None)
    assert missing == []


def test_all_lists_only_names_the_module_defines():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        names = declared_all(path)
        if names is not None:
            defined = defined_names(path)
            wrong += [f"{path.relative_to(REPO)}: {n}" for n in names if n not in defined]
            wrong += [f"{path.relative_to(REPO)}: {n} twice" for n in set(names) if names.count(n) > 1]
    assert wrong == []


def test_a_name_imported_from_a_module_is_in_its_all():
    """Whatever another module, a test or launch.py imports from a module (a private ``_x`` aside) is
    part of its declared public surface (a re-export included)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    surface = {m: declared_all(p) for m, p in files.items()}
    sources = list(PACKAGE.rglob("*.py")) + list((REPO / "tests").glob("*.py")) + [REPO / "launch.py"]
    sources += list((REPO / "benchmarks").glob("*.py"))
    outside = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and node.module in files
                and surface[node.module] is not None
                and path != files[node.module]
            ):
                outside += [
                    f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name not in surface[node.module]
                    and f"{node.module}.{a.name}" not in files
                    and not a.name.startswith("_")
                ]  # a test may reach a private helper
    assert outside == []


def test_every_document_names_the_layers_in_one_order():
    """Where a README or a page of docs/ writes the layers as a chain (`config` -> `ops` -> ...), it is
    LAYERS' order, whole."""
    chains = []
    for path in [REPO / "README.md", PACKAGE / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for m in re.finditer(r"`\w+`(?:\s*->\s*`\w+`)+", path.read_text()):
            chains.append((path.relative_to(REPO), re.findall(r"`(\w+)`", m.group(0))))
    assert len(chains) >= 2
    assert [(p, names) for p, names in chains if names != list(LAYERS[:-1])] == []


def test_no_two_modules_share_a_file_name():
    """A file's name says what it holds and which layer (``ops/rollout_corr_helper.py`` beside
    ``ppo/rollout_correction.py``, not two ``rollout_correction.py``)."""
    names: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {n: paths for n, paths in names.items() if len(paths) > 1} == {}

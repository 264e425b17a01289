"""Recipes -> a validated ``Config``: YAML loading, inheritance, ``key=value`` overrides, checks.

The pipeline, in order:

1. ``load_recipe_tree``: read ``recipes/NAME.yaml`` (or a path); a ``base:`` key (a name/path or a
   list of them) is loaded first and this file is deep-merged over it (mappings merge, anything
   else replaces).
2. ``apply_overrides``: ``a.b.c=value`` strings (Hydra's ``+a.b.c=value`` and ``++a.b.c=value``
   alike), values parsed as YAML (``[1,2]``, ``null``, ``1e-6`` -- the last is a float here, unlike
   plain YAML 1.1).
3. ``build`` (``recipe/build.py``): the merged mapping fills the dataclass tree of
   ``rlhf_hpc.config.schema``; unknown keys and wrong types are collected with the exact dotted key.
4. ``resolve`` (``recipe/defaults.py``): ``${a.b}`` interpolation, then values that default to
   another key (critic batch sizes, clip ratios, FSDP shard size ...) are filled in, so the written
   config is explicit.
5. ``validate`` (``recipe/config_checks.py``): cross-field checks by topic (batch divisibility, meshes,
   tensor parallel size, files); verl keys of features not here: ``recipe/verl_compat.py``.

Every problem becomes one line of a ``ConfigError``; the CLI prints them without a traceback.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from rlhf_hpc.config.errors import ConfigError, did_you_mean
from rlhf_hpc.config.schema import Config
from rlhf_hpc.config.tree import deep_merge, dump_yaml, flatten, parse_yaml, to_dict
from rlhf_hpc.recipe.build import all_keys, build
from rlhf_hpc.recipe.config_checks import validate
from rlhf_hpc.recipe.defaults import resolve
from rlhf_hpc.recipe.verl_compat import drop_out_of_scope_keys

__all__ = [
    "apply_overrides",
    "list_recipes",
    "load_config",
    "load_recipe_tree",
    "load_resolved",
    "parse_override",
    "write_resolved",
]

RECIPE_META_KEYS = ("base", "description")
RECIPE_FILE = "recipe.yaml"  # in a run directory, beside config.yaml


# ---------------------------------------------------------------------------------------- YAML
def recipes_dir() -> Path:
    return Path(os.environ.get("RLHF_HPC_RECIPES", Path(__file__).resolve().parents[2] / "recipes"))


def list_recipes() -> dict[str, str]:
    """Recipe name -> its ``description`` line (empty when it has none)."""
    out = {}
    for path in sorted(recipes_dir().glob("*.yaml")):
        try:
            desc = (parse_yaml(path.read_text()) or {}).get("description", "")
        except yaml.YAMLError:
            desc = "(unreadable YAML)"
        out[path.stem] = str(desc).strip().splitlines()[0] if desc else ""
    return out


def find_recipe(name: str, relative_to: Optional[Path] = None) -> Path:
    """A recipe name (``recipes/NAME.yaml``) or a path to a YAML file."""
    candidates = []
    if name.endswith((".yaml", ".yml")) or os.sep in name:
        p = Path(name).expanduser()
        if relative_to is not None and not p.is_absolute():
            candidates.append(relative_to / p)
        candidates.append(p)
    else:
        if relative_to is not None:
            candidates.append(relative_to / f"{name}.yaml")
        candidates.append(recipes_dir() / f"{name}.yaml")
    for c in candidates:
        if c.is_file():
            return c.resolve()
    known = list(list_recipes())
    hint = did_you_mean(name, known)
    raise ConfigError(
        f"recipe '{name}' not found{hint}; available recipes: {', '.join(known) or 'none'}"
        f" (or give a path to a .yaml file)"
    )


def load_recipe_tree(name: str, relative_to: Optional[Path] = None, _chain: tuple[Path, ...] = ()) -> dict:
    """The recipe's mapping with all its bases merged in (bases first)."""
    path = find_recipe(name, relative_to)
    if path in _chain:
        cycle = " -> ".join(p.stem for p in (*_chain, path))
        raise ConfigError(f"recipe inheritance loops: {cycle}")
    try:
        data = parse_yaml(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"recipe {path}: not valid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"recipe {path}: expected a mapping of config keys at the top level, got {type(data).__name__}"
        )
    bases = data.pop("base", None) or []
    data.pop("description", None)
    if isinstance(bases, str):
        bases = [bases]
    merged: dict = {}
    for b in bases:
        merged = deep_merge(merged, load_recipe_tree(str(b), path.parent, (*_chain, path)))
    return deep_merge(merged, data)


OVERRIDE_ALIASES = {
    "cluster": "launcher.cluster",
    "trainer.profile_steps": "global_profiler.steps",
    # verl's names of keys this project has under its own
    "actor_rollout_ref.nccl_timeout": "trainer.dist_timeout_s",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": (
        "actor_rollout_ref.rollout.update_weights_bucket_mb"
    ),
}


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=[1, 2]"`` -> ``("a.b", [1, 2])``. Hydra's ``+a.b=v`` (add a key) and ``++a.b=v`` (add
    or override) are ``a.b=v`` here: every key exists in the schema with its default, so adding one
    and overriding it are the same; a key the schema lacks stays an unknown key, named without the
    plus."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if key.startswith("++"):
        key = key[2:].lstrip()
    elif key.startswith("+"):
        key = key[1:].lstrip()
    if not sep or not key or key.startswith("+"):
        raise ConfigError(f"override '{text}' is not of the form key.path=value")
    try:
        value = parse_yaml(raw)
    except yaml.YAMLError:
        raise ConfigError(
            f"override {key}: value '{raw}' is not valid YAML (quote strings with special characters)"
        ) from None
    return OVERRIDE_ALIASES.get(key, key), value


def apply_overrides(tree: dict, overrides: Iterable[str]) -> dict:
    tree = dict(tree)
    for text in overrides:
        key, value = parse_override(text)
        node = tree
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise ConfigError(f"override {key}: {prefix} is a value ({child!r}), not a section")
            else:
                child = dict(child)
            node[part] = child
            node = child
        node[parts[-1]] = value
    return tree


# ------------------------------------------------------------------------------------ validate
def cluster_profiles_dir() -> Path:
    return Path(os.environ.get("RLHF_HPC_CLUSTERS", Path(__file__).resolve().parents[2] / "slurm" / "clusters"))


def apply_cluster_profile(tree: dict) -> dict:
    """``launcher.cluster_profile=NAME``: slurm/clusters/NAME.yaml fills launcher keys the recipe
    and the command line left unset (they win over the profile)."""
    name = (tree.get("launcher") or {}).get("cluster_profile")
    if not name:
        return tree
    path = cluster_profiles_dir() / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in cluster_profiles_dir().glob("*.yaml"))
        raise ConfigError(
            f"launcher.cluster_profile: no profile '{name}'{did_you_mean(name, known)}; available: "
            f"{', '.join(known) or 'none'} (files in {cluster_profiles_dir()})"
        )
    cluster_profile = parse_yaml(path.read_text()) or {}
    if not isinstance(cluster_profile, dict):
        raise ConfigError(f"{path}: expected a mapping of launcher keys")
    # the nodes' hardware, for the time plan: a preset's name or a mapping of hardware keys
    hardware = cluster_profile.pop("hardware", None)
    if isinstance(hardware, str):
        hardware = {"preset": hardware}
    if hardware is not None and not isinstance(hardware, dict):
        raise ConfigError(f"{path}: hardware: expected a preset name (e.g. h100_sxm) or a mapping of hardware keys")
    return deep_merge({"launcher": cluster_profile, **({"hardware": hardware} if hardware else {})}, tree)


def load_config(
    recipe: Optional[str], overrides: Iterable[str] = (), check_files: bool = True
) -> tuple[Config, list[str]]:
    """Recipe name/path (None: the defaults alone, which are verl's) + overrides -> (resolved,
    validated Config, warnings)."""
    written = load_recipe_tree(recipe) if recipe else {}
    tree = apply_cluster_profile(apply_overrides(written, overrides))
    notes: list[str] = []  # verl values accepted here that change how the run looks
    cfg = resolve(build(drop_out_of_scope_keys(tree, set(all_keys()), notes)))
    cfg.recipe_tree = written
    cfg.recipe_keys = recipe_keys(written)
    warnings = validate(cfg, check_files=check_files)
    return cfg, notes + warnings


def recipe_keys(tree: dict) -> frozenset:
    return frozenset(k for k in flatten(tree) if k not in RECIPE_META_KEYS)


def load_resolved(path: str | Path, check_files: bool = True, checks: bool = True) -> Config:
    """Read a resolved ``config.yaml`` written by ``write_resolved`` (what workers start from).
    ``checks`` False: without the cross-field checks, for a node's job, whose ranks check it (the
    checks read the model's config through transformers: ~1.8 CPU-s at every start of every node,
    BENCHMARKS.md)."""
    tree = parse_yaml(Path(path).read_text()) or {}
    cfg = resolve(build(tree))
    written = Path(path).with_name(RECIPE_FILE)
    if written.is_file():
        cfg.recipe_keys = recipe_keys(parse_yaml(written.read_text()) or {})
    if checks:
        validate(cfg, check_files=check_files)
    return cfg


def write_resolved(cfg: Config, run_dir: str | Path) -> Path:
    """Write ``run_dir/config.yaml`` atomically. A different config already there is kept as
    ``config.prev-N.yaml``, so a re-launch never loses what an earlier run was started with."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "config.yaml"
    text = dump_yaml(to_dict(cfg))
    if target.exists() and target.read_text() != text:
        n = 1
        while (run_dir / f"config.prev-{n}.yaml").exists():
            n += 1
        target.rename(run_dir / f"config.prev-{n}.yaml")
    tmp = run_dir / f".config.yaml.tmp-{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, target)
    tree = getattr(cfg, "recipe_tree", None)
    if tree is not None:  # what the recipe chose, for advice that leaves it alone
        (run_dir / RECIPE_FILE).write_text(
            "# the recipe as its files wrote it (bases merged), before overrides and "
            "defaults; config.yaml is what runs\n" + dump_yaml(tree)
        )
    return target

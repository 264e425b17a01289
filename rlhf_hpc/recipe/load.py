"""Recipes -> a validated ``Config``: YAML loading, inheritance, ``key=value`` overrides, checks.

The pipeline, in order:

1. ``load_recipe_tree``: read ``recipes/NAME.yaml`` (or a path); a ``base:`` key (a name/path or a
   list of them) is loaded first and this file is deep-merged over it (mappings merge, anything
   else replaces).
2. ``apply_overrides``: ``a.b.c=value`` strings, values parsed as YAML (``[1,2]``, ``null``,
   ``1e-6`` -- the last is a float here, unlike plain YAML 1.1).
3. ``build``: the merged mapping fills the dataclass tree of ``rlhf_hpc.config``; unknown keys and
   wrong types are collected with the exact dotted key.
4. ``resolve``: ``${a.b}`` interpolation, then values that default to another key (critic batch
   sizes, clip ratios, FSDP shard size ...) are filled in, so the written config is explicit.
5. ``validate``: cross-field checks (batch divisibility, meshes, tensor parallel size, files).

Every problem becomes one line of a ``ConfigError``; the CLI prints them without a traceback.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shutil
import typing
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from rlhf_hpc.ops.batching import per_rank_mini_batch
from rlhf_hpc.config.schema import Config
from rlhf_hpc.config.errors import ConfigError, did_you_mean
from rlhf_hpc.config.tree import deep_merge, dump_yaml, flatten, get_key, parse_yaml, to_dict
from rlhf_hpc.recipe.checks import validate

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
    raise ConfigError(f"recipe '{name}' not found{hint}; available recipes: {', '.join(known) or 'none'}"
                      f" (or give a path to a .yaml file)")


def load_recipe_tree(name: str, relative_to: Optional[Path] = None,
                     _chain: tuple[Path, ...] = ()) -> dict:
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
        raise ConfigError(f"recipe {path}: expected a mapping of config keys at the top level, "
                          f"got {type(data).__name__}")
    bases = data.pop("base", None) or []
    data.pop("description", None)
    if isinstance(bases, str):
        bases = [bases]
    merged: dict = {}
    for b in bases:
        merged = deep_merge(merged, load_recipe_tree(str(b), path.parent, (*_chain, path)))
    return deep_merge(merged, data)


OVERRIDE_ALIASES = {"cluster": "launcher.cluster", "trainer.profile_steps": "global_profiler.steps"}


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=[1, 2]"`` -> ``("a.b", [1, 2])``."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override '{text}' is not of the form key.path=value")
    try:
        value = parse_yaml(raw)
    except yaml.YAMLError:
        raise ConfigError(f"override {key}: value '{raw}' is not valid YAML "
                          f"(quote strings with special characters)") from None
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


# --------------------------------------------------------------------------------------- build
def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is typing.Union:
        names = [_type_name(a) for a in args if a is not type(None)]
        tail = " or null" if type(None) in args else ""
        return " or ".join(names) + tail
    if origin is list:
        return f"a list of {_type_name(args[0])}" if args else "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"


def _coerce(tp: Any, value: Any, key: str, errors: list[str]) -> tuple[bool, Any]:
    """Check ``value`` against the annotation ``tp``; returns (ok, converted value)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return True, value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            errors.append(f"{key}: expected a mapping (a config section), got {_describe(value)}")
            return False, None
        return True, _build(tp, value, key, errors)
    if origin is typing.Union:
        if value is None:
            if type(None) in args:
                return True, None
        for arg in args:
            if arg is type(None):
                continue
            scratch: list[str] = []
            ok, out = _coerce(arg, value, key, scratch)
            if ok and not scratch:
                return True, out
        errors.append(f"{key}: expected {_type_name(tp)}, got {_describe(value)}")
        return False, None
    if origin is typing.Literal:
        if value in args and not isinstance(value, bool):
            return True, value
        hint = did_you_mean(str(value), [str(a) for a in args])
        errors.append(f"{key}: expected {_type_name(tp)}, got {_describe(value)}{hint}")
        return False, None
    if origin is list:
        if isinstance(value, str):
            value = [value]  # trainer.logger=console: a bare string is a one-item list (as in verl)
        if not isinstance(value, list):
            errors.append(f"{key}: expected {_type_name(tp)}, got {_describe(value)}")
            return False, None
        out, ok_all = [], True
        for i, item in enumerate(value):
            ok, conv = _coerce(args[0] if args else Any, item, f"{key}[{i}]", errors)
            ok_all &= ok
            out.append(conv)
        return ok_all, out
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{key}: expected a mapping, got {_describe(value)}")
            return False, None
        return True, dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return True, value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return True, value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
    elif tp is str:
        if isinstance(value, str):
            return True, value
        # a name like experiment_name=2024 arrives as an int from YAML; a string is meant
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, str(value)
    else:  # pragma: no cover - an annotation this builder does not know is a programming error
        raise TypeError(f"{key}: unsupported annotation {tp!r}")
    errors.append(f"{key}: expected {_type_name(tp)}, got {_describe(value)}")
    return False, None


def _build(cls: type, data: dict, prefix: str, errors: list[str]) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            errors.append(_unknown_key_message(key))
            continue
        ok, conv = _coerce(hints[k], v, key, errors)
        if ok:
            kwargs[k] = conv
    return cls(**kwargs)


def all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every leaf key of the dataclass tree as a dotted path."""
    out = []
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(all_keys(tp, key))
        else:
            out.append(key)
    return out


def _all_sections(cls: type = Config, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            key = f"{prefix}.{f.name}" if prefix else f.name
            out.append(key)
            out.extend(_all_sections(tp, key))
    return out


def _unknown_key_message(key: str) -> str:
    """Suggest the closest valid key: a sibling first, else a key of that name elsewhere."""
    parent, _, leaf = key.rpartition(".")
    known = all_keys() + _all_sections()
    siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == parent]
    match = [f"{parent}.{m}" if parent else m
             for m in difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.75)]
    if not match:
        # e.g. actor_rollout_ref.actor.lr -> actor_rollout_ref.actor.optim.lr: same leaf name,
        # prefer the candidate sharing the longest prefix with what was written
        leaves = {}
        for k in known:
            leaves.setdefault(k.rpartition(".")[2], []).append(k)
        close = difflib.get_close_matches(leaf, list(leaves), n=3, cutoff=0.75)
        cands = [k for name in close for k in leaves[name]]
        if cands:
            match = [max(cands, key=lambda c: (len(os.path.commonprefix([c, key])),
                                              difflib.SequenceMatcher(None, c, key).ratio()))]
    hint = f"; did you mean '{match[0]}'?" if match else ""
    where = f"section '{parent}'" if parent else "the top level"
    return f"unknown key '{key}' in {where}{hint}"


def build(tree: dict) -> Config:
    """Fill the dataclass tree from a merged mapping; raises ConfigError listing every problem."""
    errors: list[str] = []
    if not isinstance(tree, dict):
        raise ConfigError(f"expected a mapping of config keys, got {_describe(tree)}")
    cfg = _build(Config, tree, "", errors)
    if errors:
        raise ConfigError(errors)
    return cfg


# ------------------------------------------------------------------------------------- resolve
_INTERP = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def _interpolate(cfg: Config, errors: list[str]) -> None:
    def resolve_str(s: str, where: str, depth: int = 0) -> str:
        def sub(m: re.Match) -> str:
            ref = m.group(1)
            try:
                val = get_key(cfg, ref)
            except AttributeError:
                if depth == 0:  # reported once, at the key that holds the bad reference
                    errors.append(f"{where}: '${{{ref}}}' refers to an unknown key"
                                  f"{did_you_mean(ref, all_keys())}")
                return m.group(0)
            if isinstance(val, str) and depth < 10:
                return resolve_str(val, where, depth + 1)
            return str(val)
        return _INTERP.sub(sub, s)

    def walk(node: Any, prefix: str) -> None:
        for f in dataclasses.fields(node):
            key = f"{prefix}.{f.name}" if prefix else f.name
            val = getattr(node, f.name)
            if dataclasses.is_dataclass(val):
                walk(val, key)
            elif isinstance(val, str) and "${" in val:
                setattr(node, f.name, resolve_str(val, key))
            elif isinstance(val, list) and any(isinstance(v, str) and "${" in v for v in val):
                setattr(node, f.name, [resolve_str(v, key) if isinstance(v, str) else v for v in val])
    walk(cfg, "")


def resolve(cfg: Config) -> Config:
    """Interpolate ``${...}`` and fill keys that default to other keys (in place; returns cfg)."""
    errors: list[str] = []
    _interpolate(cfg, errors)
    if errors:
        raise ConfigError(errors)
    if cfg.launcher.cluster == "auto":
        # decided where the launch command runs (the login node), then fixed in the written config
        cfg.launcher.cluster = "slurm" if shutil.which("sbatch") else "local"
    arr, actor, critic = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor, cfg.critic
    if actor.clip_ratio_low is None:
        actor.clip_ratio_low = actor.clip_ratio
    if actor.clip_ratio_high is None:
        actor.clip_ratio_high = actor.clip_ratio
    if critic.enable is None:
        critic.enable = cfg.algorithm.adv_estimator == "gae"
    if critic.model.path is None:
        critic.model.path = arr.model.path
    if critic.model.tokenizer_path is None:
        critic.model.tokenizer_path = arr.model.tokenizer_path
    # keys verl interpolates from the actor's (or another key) when they are left unset
    for section, key, source in (
            (critic, "ppo_mini_batch_size", actor), (critic, "ppo_epochs", actor), (critic, "use_dynamic_bsz", actor),
            (critic, "shuffle", actor), (critic, "loss_agg_mode", actor),
            (critic.model, "trust_remote_code", arr.model), (critic.model, "external_lib", arr.model)):
        if getattr(section, key) is None:
            setattr(section, key, getattr(source, key))
    if critic.forward_max_token_len_per_gpu is None:
        critic.forward_max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
    if arr.ref.ulysses_sequence_parallel_size is None:
        arr.ref.ulysses_sequence_parallel_size = actor.ulysses_sequence_parallel_size
    # the reward model's keys are filled only when it runs: while disabled, a key set is a key ignored
    # (refused by reward_model_problems)
    rm = cfg.reward_model
    if rm.enable:
        for section, key, value in ((rm, "use_dynamic_bsz", critic.use_dynamic_bsz),
                                    (rm, "forward_max_token_len_per_gpu", critic.forward_max_token_len_per_gpu),
                                    (rm.model, "external_lib", arr.model.external_lib)):
            if getattr(section, key) is None:
                setattr(section, key, value)
    for section in (arr.rollout, arr.ref):
        if section.log_prob_use_dynamic_bsz is None:
            section.log_prob_use_dynamic_bsz = actor.use_dynamic_bsz
        if section.log_prob_max_token_len_per_gpu is None:
            section.log_prob_max_token_len_per_gpu = actor.ppo_max_token_len_per_gpu
    for optim in (actor.optim, critic.optim):
        if optim.warmup_style is not None:  # verl's deprecated name wins, as in verl
            optim.lr_scheduler_type, optim.warmup_style = optim.warmup_style, None
    # the actor's, reference's and critic's layout left at null is chosen where models are built
    # (rlhf_hpc.planning.layout: from the model size); the reward model shards inside a node
    if cfg.reward_model.model.fsdp_config.fsdp_size is None:
        cfg.reward_model.model.fsdp_config.fsdp_size = cfg.trainer.n_gpus_per_node
    n, world = arr.rollout.n, cfg.world_size
    if world > 0:
        if actor.ppo_micro_batch_size_per_gpu is None:
            actor.ppo_micro_batch_size_per_gpu = max(1, per_rank_mini_batch(actor.ppo_mini_batch_size, n, world))
        if critic.ppo_micro_batch_size_per_gpu is None:
            critic.ppo_micro_batch_size_per_gpu = max(1, per_rank_mini_batch(critic.ppo_mini_batch_size, n, world))
        # forward-only passes default to the training micro-batch: same activation budget, no grads
        if arr.rollout.log_prob_micro_batch_size_per_gpu is None:
            arr.rollout.log_prob_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
        if arr.ref.log_prob_micro_batch_size_per_gpu is None:
            arr.ref.log_prob_micro_batch_size_per_gpu = arr.rollout.log_prob_micro_batch_size_per_gpu
        if rm.enable and rm.micro_batch_size_per_gpu is None:
            rm.micro_batch_size_per_gpu = arr.ref.log_prob_micro_batch_size_per_gpu
    return cfg


# ------------------------------------------------------------------------------------ validate
def profiles_dir() -> Path:
    return Path(os.environ.get("RLHF_HPC_CLUSTERS", Path(__file__).resolve().parents[2] / "slurm" / "clusters"))


def apply_cluster_profile(tree: dict) -> dict:
    """``launcher.cluster_profile=NAME``: slurm/clusters/NAME.yaml fills launcher keys the recipe
    and the command line left unset (they win over the profile)."""
    name = (tree.get("launcher") or {}).get("cluster_profile")
    if not name:
        return tree
    path = profiles_dir() / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in profiles_dir().glob("*.yaml"))
        raise ConfigError(f"launcher.cluster_profile: no profile '{name}'{did_you_mean(name, known)}; available: "
                          f"{', '.join(known) or 'none'} (files in {profiles_dir()})")
    profile = parse_yaml(path.read_text()) or {}
    if not isinstance(profile, dict):
        raise ConfigError(f"{path}: expected a mapping of launcher keys")
    return deep_merge({"launcher": profile}, tree)


def load_config(recipe: Optional[str], overrides: Iterable[str] = (), check_files: bool = True
                ) -> tuple[Config, list[str]]:
    """Recipe name/path (None: the defaults alone, which are verl's) + overrides -> (resolved,
    validated Config, warnings)."""
    from rlhf_hpc.recipe.verl_compat import drop_out_of_scope_keys
    written = load_recipe_tree(recipe) if recipe else {}
    tree = apply_cluster_profile(apply_overrides(written, overrides))
    cfg = resolve(build(drop_out_of_scope_keys(tree, set(all_keys()))))
    cfg.recipe_tree = written
    cfg.recipe_keys = recipe_keys(written)
    warnings = validate(cfg, check_files=check_files)
    return cfg, warnings


def recipe_keys(tree: dict) -> frozenset:
    return frozenset(k for k in flatten(tree) if k not in RECIPE_META_KEYS)


def load_resolved(path: str | Path, check_files: bool = True) -> Config:
    """Read a resolved ``config.yaml`` written by ``write_resolved`` (what workers start from)."""
    tree = parse_yaml(Path(path).read_text()) or {}
    cfg = resolve(build(tree))
    written = Path(path).with_name(RECIPE_FILE)
    if written.is_file():
        cfg.recipe_keys = recipe_keys(parse_yaml(written.read_text()) or {})
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
        (run_dir / RECIPE_FILE).write_text("# the recipe as its files wrote it (bases merged), before overrides and "
                                           "defaults; config.yaml is what runs\n" + dump_yaml(tree))
    return target

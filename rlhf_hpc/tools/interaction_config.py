"""verl's interaction-config file (``multi_turn.interaction_config_path``): ``interaction:`` a list
of ``{name, class_name, config}``. Read and checked at the dry run, built on every rank.

``class_name`` is one of verl's interactions that has an equivalent here (``INTERACTION_CLASSES``:
its GSM8K interaction), a name of that registry, or the dotted path of the user's own class
implementing ``rlhf_hpc.tools.interaction.Interaction``. ``name`` (what rows give in
``extra_info.interaction_kwargs.name``) defaults as verl's: the class's name without
"Interaction", lower-cased."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.plugin_class import read_entry_list, resolve_class
from rlhf_hpc.config.registry import Registry
from rlhf_hpc.config.schema import Config
from rlhf_hpc.tools.interaction import Interaction

__all__ = [
    "INTERACTION_CLASSES",
    "InteractionEntry",
    "InteractionSpec",
    "build_interactions",
    "read_interaction_config",
    "run_interactions",
]

KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"


@dataclass(frozen=True)
class InteractionSpec:
    name: str
    entry: str
    verl_class: Optional[str] = None


INTERACTION_CLASSES: Registry[InteractionSpec] = Registry("interaction class", f"{KEY}: class_name")
INTERACTION_CLASSES.register(
    "gsm8k",
    InteractionSpec(
        "gsm8k",
        "rlhf_hpc.rewards.gsm8k_interaction:Gsm8kInteraction",
        "verl.interactions.gsm8k_interaction.Gsm8kInteraction",
    ),
)


@dataclass
class InteractionEntry:
    name: str
    cls: type
    config: dict = field(default_factory=dict)


def default_name(class_name: str) -> str:
    """verl's: the class's own name, "Interaction" dropped from its end, lower-cased."""
    simple = class_name.replace(":", ".").rsplit(".", 1)[-1]
    return (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def read_interaction_config(path: str) -> list[InteractionEntry]:
    """The file's interactions, each checked (a ConfigError names the file, the entry and the fix)."""
    items = read_entry_list(path, KEY, "interaction", "{name, class_name, config}")
    out, errors = [], []
    for i, item in enumerate(items):
        where = f"{path}, interaction[{i}]"
        try:
            if not isinstance(item, dict) or not isinstance(item.get("class_name"), str):
                raise ConfigError(f"{where}: no class_name")
            config = item.get("config") or {}
            if not isinstance(config, dict):
                raise ConfigError(f"{where}: config: expected a mapping, got {type(config).__name__}")
            _, cls = resolve_class(item["class_name"], INTERACTION_CLASSES, Interaction, "respond", where)
            name = item.get("name") or default_name(item["class_name"])
            if any(e.name == name for e in out):
                raise ConfigError(f"{where}: a second interaction named {name!r} (each needs its own name)")
            out.append(InteractionEntry(str(name), cls, dict(config, name=str(name))))
        except ConfigError as e:
            errors += e.errors
    if errors:
        raise ConfigError(errors)
    return out


def run_interactions(cfg: Config) -> list[InteractionEntry]:
    """The run's interactions (none unless a multi-turn run gives an interaction config)."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    return read_interaction_config(mt.interaction_config_path) if mt.enable and mt.interaction_config_path else []


def build_interactions(entries: list[InteractionEntry]) -> dict[str, Interaction]:
    return {e.name: e.cls(e.config) for e in entries}

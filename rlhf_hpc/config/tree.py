"""The configuration as a YAML tree: parse and dump (YAML 1.2 numbers), deep merge, flatten to
dotted keys, the dotted get, a Config back to a tree."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import yaml

__all__ = ["deep_merge", "dump_yaml", "flatten", "get_key", "parse_yaml", "to_dict"]


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's floats: ``1e-6`` is a float (YAML 1.1 needs a dot: ``1.0e-6``) and
    ``0.5_2`` a string (YAML 1.1 reads 0.52: a ``lower_upper`` threshold such as
    rollout_rs_threshold=0.5_2 would silently become one number). Integers keep ``1_000`` = 1000;
    sexagesimal ``1:30`` (YAML 1.1: 90) is a string."""


_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in _NUMBER_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)


# ------------------------------------------------------------------------------------- recipes


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


# ----------------------------------------------------------------------------------- overrides
# Command-line shorthands for keys that live deeper in the tree.


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def get_key(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)

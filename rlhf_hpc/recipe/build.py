"""The typed build: a merged recipe mapping fills the dataclass tree of ``rlhf_hpc.config.schema``.

Unknown keys (with the closest valid one) and wrong types (the expected type and the value given)
are collected with their exact dotted key, so one ``ConfigError`` lists every problem.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any

from rlhf_hpc.config.errors import ConfigError, did_you_mean
from rlhf_hpc.config.schema import Config

__all__ = ["all_keys", "build"]


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


def _build(cls: type, data: dict, prefix: str, errors: list[str], base: Any = None) -> Any:
    """``cls`` from ``data``; keys not given keep ``base``'s values (a section's default as its parent
    makes it, e.g. the reference's FSDP config), else the class defaults."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in fields:
            errors.append(_unknown_key_message(key))
            continue
        factory = fields[k].default_factory
        if dataclasses.is_dataclass(hints[k]) and isinstance(v, dict) and factory is not dataclasses.MISSING:
            kwargs[k] = _build(hints[k], v, key, errors, base=factory())
            continue
        ok, conv = _coerce(hints[k], v, key, errors)
        if ok:
            kwargs[k] = conv
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


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
    match = [f"{parent}.{m}" if parent else m for m in difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.75)]
    if not match:
        # e.g. actor_rollout_ref.actor.lr -> actor_rollout_ref.actor.optim.lr: same leaf name,
        # prefer the candidate sharing the longest prefix with what was written
        leaves = {}
        for k in known:
            leaves.setdefault(k.rpartition(".")[2], []).append(k)
        close = difflib.get_close_matches(leaf, list(leaves), n=3, cutoff=0.75)
        cands = [k for name in close for k in leaves[name]]
        if cands:
            match = [
                max(
                    cands,
                    key=lambda c: (len(os.path.commonprefix([c, key])), difflib.SequenceMatcher(None, c, key).ratio()),
                )
            ]
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

"""A class named in one of verl's config files (a tool's or an interaction's ``class_name``): a
class of verl (or of verl's recipes) that has an equivalent here, a name of the extension point's
registry, or the dotted path of the user's own subclass of the documented base class. Anything
else is refused with what is built in and how to write one's own."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Optional, Protocol

import yaml

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.registry import Registry

__all__ = ["BuiltinClass", "import_entry", "read_entry_list", "resolve_class"]

VERL_PACKAGES = ("verl.", "recipe.")  # verl's library and its recipes: they import verl, which is not here


class BuiltinClass(Protocol):
    """A registry entry: ``entry`` the class (``module:Class``, imported when resolved), ``verl_class``
    verl's class it stands for (None: this project's own)."""

    name: str
    entry: str
    verl_class: Optional[str]


def import_entry(entry: str) -> type:
    module, _, name = entry.partition(":") if ":" in entry else entry.rpartition(".")
    return getattr(importlib.import_module(module), name)


def read_entry_list(path: str, key: str, section: str, shape: str) -> list:
    """The non-empty list under ``section:`` of the YAML file at ``path`` (the config ``key`` that
    names it), each entry still to check; a ConfigError names the file and what it should hold."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"{key}={path}: no such file")
    try:
        doc = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}={path}: not YAML ({' '.join(str(e).split())[:200]})") from None
    items = doc.get(section) if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{key}={path}: expected '{section}:' with a list of {shape}")
    return items


def resolve_class(
    class_name: str, registry: Registry, base: type, method: str, where: str
) -> tuple[Optional[BuiltinClass], type]:
    """(the built-in entry, None for the user's own class; the class). ``base`` is the interface a
    user's class subclasses and ``method`` the one it implements (synchronous: called in threads)."""
    spec = next((s for s in registry.values() if s.verl_class == class_name), None) or registry.get(class_name)
    if spec is not None:
        return spec, import_entry(spec.entry)
    builtin = ", ".join(f"{s.name} (verl's {s.verl_class})" if s.verl_class else s.name for s in registry.values())
    interface = f"{base.__module__}.{base.__name__}"
    if class_name.startswith(VERL_PACKAGES):
        raise ConfigError(
            f"{where}: class_name {class_name}: verl's class has no equivalent here; built in: "
            f"{builtin}, or name your own class implementing {interface}"
        )
    try:
        cls = import_entry(class_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(
            f"{where}: class_name {class_name} does not import ({type(e).__name__}: {e}); built in: {builtin}"
        ) from None
    if not (inspect.isclass(cls) and issubclass(cls, base)) or inspect.iscoroutinefunction(getattr(cls, method)):
        raise ConfigError(
            f"{where}: class_name {class_name} is not a {registry.kind} here: subclass {interface} and "
            f"implement {method}(...) (a plain method, not async)"
        )
    return None, cls

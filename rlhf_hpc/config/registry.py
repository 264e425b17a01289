"""One registry per extension point (estimators, policy losses, rollout engines, trackers, reward
functions, hardware): a name -> entry table whose lookup of an unknown name raises a ConfigError
that names the config key and every registered name (no catch-all ``else``). Entries are added
where they are implemented, by ``register`` or a decorator; docs/extending.md lists the points."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

from rlhf_hpc.config.errors import ConfigError, did_you_mean

__all__ = ["REGISTRIES", "Registry"]

T = TypeVar("T")


class Registry(dict, Generic[T]):
    """``registry[name]`` is the entry or a ConfigError naming ``key`` and the registered names;
    ``registry.get(name)`` is the entry or None. ``kind`` says what an entry is, in messages."""

    def __init__(self, kind: str, key: str):
        super().__init__()
        self.kind, self.key = kind, key
        REGISTRIES.append(self)

    def register(self, name: str, entry: T) -> T:
        if name in self:
            raise ValueError(f"{self.kind} '{name}' is already registered")
        self[name] = entry
        return entry

    def decorator(self, name: str, wrap: Callable[[Callable], T] = lambda fn: fn) -> Callable[[Callable], Callable]:
        """``@registry.decorator(name)`` registers ``wrap(fn)`` under ``name`` and returns ``fn``."""

        def add(fn: Callable) -> Callable:
            self.register(name, wrap(fn))
            return fn

        return add

    def __missing__(self, name: str):
        raise ConfigError(
            f"{self.key}: unknown {self.kind} {name!r}{did_you_mean(str(name), self)}; registered: {', '.join(self)}"
        )


REGISTRIES: list[Registry] = []  # every registry, for the test that each refuses an unknown name

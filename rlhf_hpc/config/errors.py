"""The error every configuration problem raises: one message per problem, each naming its key."""

from __future__ import annotations

import difflib
from typing import Iterable

__all__ = ["ConfigError", "did_you_mean"]


class ConfigError(Exception):
    """A user error in a recipe or override; ``errors`` holds one message per problem."""

    def __init__(self, errors: list[str] | str):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__(str(self))

    def __str__(self) -> str:
        if len(self.errors) == 1:
            return f"invalid configuration: {self.errors[0]}"
        return "invalid configuration:\n" + "\n".join(f"  - {e}" for e in self.errors)


def did_you_mean(word: str, options: Iterable[str]) -> str:
    m = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{m[0]}'?)" if m else ""

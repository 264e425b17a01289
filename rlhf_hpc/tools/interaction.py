"""The interaction interface of the agent loop: what a class named in an interaction-config file
implements, built in or the user's own (docs/extending.md, "An interaction").

An interaction is verl's simulated user. Where a model turn calls no tool, the conversation's
interaction reads the conversation so far and answers as the user: a text the model reads next
(a user turn, out of the response mask like a tool's answer), whether the conversation ends
there, and a score for the turn (verl's turn score: logged, not added to the reward).

It is built once per trainer rank, ``Interaction(config)``, and called from worker threads, several
conversations at once: ``respond`` gets everything about its conversation as arguments (verl's
per-instance state is the conversation's messages and its row's ``interaction_kwargs``) and must not
keep per-call state on ``self``. A call that raises or runs past ``multi_turn.tool_timeout_s``
ends the conversation there, counted in ``interaction/errors``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Interaction", "UserTurn", "last_assistant_text"]


@dataclass(frozen=True)
class UserTurn:
    """verl's ``generate_response`` result: ``(should_terminate_sequence, response_content,
    current_turn_score, _)``."""

    text: str
    done: bool = False
    score: float = 0.0


class Interaction:
    """Subclass and implement ``respond``. ``config`` is the entry's ``config`` mapping with its
    ``name`` set (the name rows give in ``extra_info.interaction_kwargs.name``)."""

    def __init__(self, config: dict):
        self.config = dict(config or {})
        self.name = self.config.get("name", "interaction_agent")

    def respond(self, messages: list[dict], interaction_kwargs: dict[str, Any]) -> UserTurn:
        raise NotImplementedError(f"{type(self).__name__}.respond")


def last_assistant_text(messages: list[dict]) -> str:
    """The content of the conversation's last assistant message ("" if none), as verl's GSM8K interaction reads it."""
    return next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")

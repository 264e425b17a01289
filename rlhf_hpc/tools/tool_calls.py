"""Tool calls in a model's turn, by ``multi_turn.format`` (``TOOL_CALL_FORMATS``): the text of the
turn -> the calls it makes. ``hermes`` is Qwen2.5's and verl's default: ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`` blocks."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from rlhf_hpc.config.registry import Registry

__all__ = ["TOOL_CALL_FORMATS", "ParsedCalls", "ToolCall", "hermes_calls"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedCalls:
    """The well-formed calls of a turn; ``malformed``: blocks that were not (skipped, as verl)."""

    calls: list[ToolCall]
    malformed: int = 0


TOOL_CALL_FORMATS: Registry[Callable[[str], ParsedCalls]] = Registry(
    "tool-call format", "actor_rollout_ref.rollout.multi_turn.format"
)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@TOOL_CALL_FORMATS.decorator("hermes")
def hermes_calls(text: str) -> ParsedCalls:
    calls, bad = [], 0
    for block in _HERMES.findall(text):
        try:
            call = json.loads(block)
            name, arguments = call["name"], call.get("arguments", {})
            if isinstance(arguments, str):  # some models write the arguments as a JSON string
                arguments = json.loads(arguments)
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise TypeError("name must be a string and arguments an object")
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        calls.append(ToolCall(name, arguments))
    return ParsedCalls(calls, bad)

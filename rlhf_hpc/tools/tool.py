"""The tool interface of the agent loop (rlhf_hpc/rollout/agent_loop.py): what a class named in a
tool-config file implements, built-in or the user's own (docs/extending.md, "A tool").

A tool is built once per trainer rank from its entry in the tool config, ``Tool(config, schema)``,
and called from worker threads, several calls at once: ``execute`` must not keep per-call state on
``self``. ``create_kwargs`` are the row's ``extra_info.tools_kwargs.<tool name>.create_kwargs``
(verl's per-row arguments, e.g. the GSM8K tool's ``ground_truth``). A call that raises, or runs past
``multi_turn.tool_timeout_s``, answers the model with an error text; the run goes on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Tool", "ToolOutput", "TOOL_STATUSES"]

TOOL_STATUSES = ("ok", "error", "timeout")


@dataclass(frozen=True)
class ToolOutput:
    """What the model reads back (``text``), the call's reward (verl's tool reward: logged, not added
    to the score) and its outcome, one of ``TOOL_STATUSES`` (counted in the step's metrics)."""

    text: str
    reward: float = 0.0
    status: str = "ok"


class Tool:
    """Subclass and implement ``execute``. ``schema`` is the entry's ``tool_schema`` (an OpenAI
    function: its ``function.name`` is the name the model calls), ``config`` its ``config`` mapping."""

    def __init__(self, config: dict, schema: dict):
        self.config = dict(config or {})
        self.schema = schema
        self.name = schema["function"]["name"]

    @classmethod
    def config_problems(cls, config: dict) -> list[str]:
        """What is wrong with the entry's ``config`` (the dry run names each, with its file and entry)."""
        return []

    def execute(self, arguments: dict[str, Any], create_kwargs: dict[str, Any]) -> ToolOutput:
        raise NotImplementedError(f"{type(self).__name__}.execute")

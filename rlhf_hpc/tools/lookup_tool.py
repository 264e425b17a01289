"""The ``lookup`` tool of the built-in tool task (``synthetic://lookup``): a key's code, a digit the
prompt does not hold and the model cannot compute; only the tool knows it."""

from __future__ import annotations

from typing import Any

from rlhf_hpc.tools.tool import Tool, ToolOutput

__all__ = ["LOOKUP_SCHEMA", "LookupTool", "lookup_code"]

LOOKUP_SCHEMA = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "the code of a key",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


def lookup_code(key: str) -> int:
    return sum(ord(ch) * (i + 3) for i, ch in enumerate(key)) % 10


class LookupTool(Tool):
    def execute(self, arguments: dict[str, Any], create_kwargs: dict[str, Any]) -> ToolOutput:
        key = arguments.get("key")
        if not isinstance(key, str) or not key:
            return ToolOutput("Error: lookup needs a key (a string)", status="error")
        return ToolOutput(str(lookup_code(key)))

"""The code-interpreter tool (verl's ``SandboxFusionTool``, ReTool's ``code_interpreter``): the
model's program runs in the sandbox on the node (rlhf_hpc/tools/sandbox.py), or on a SandboxFusion
service where the tool's ``sandbox_fusion_url`` is set; the model reads back its output or the error."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from rlhf_hpc.config.sandbox_schema import SandboxConfig, SandboxFusionConfig
from rlhf_hpc.tools.code_runner import run_code
from rlhf_hpc.tools.tool import Tool, ToolOutput

__all__ = ["CodeInterpreterTool", "ReToolCodeInterpreterTool"]

# verl's SandboxFusionTool config keys read here (the rest tune verl's Ray workers: no effect here)
LANGUAGE = "python"


class CodeInterpreterTool(Tool):
    """``arguments["code"]`` run as a Python program. ``config``: verl's ``sandbox_fusion_url`` (the
    service; null or absent: the sandbox here), ``default_timeout`` (s) and ``memory_limit_mb``
    (default: the run's ``sandbox`` limits), ``default_language`` (python only)."""

    def __init__(
        self, config: dict, schema: dict, sandbox: SandboxConfig = None, sandbox_fusion: SandboxFusionConfig = None
    ):
        super().__init__(config, schema)
        language = self.config.get("default_language", LANGUAGE)
        if language != LANGUAGE:
            raise ValueError(f"tool {self.name}: default_language={language!r}; only python runs here")
        base = sandbox or SandboxConfig()
        self.sandbox = dataclasses.replace(
            base,
            timeout_s=float(self.config.get("default_timeout", base.timeout_s)),
            memory_mb=int(self.config.get("memory_limit_mb", base.memory_mb)),
        )
        self.fusion = dataclasses.replace(
            sandbox_fusion or SandboxFusionConfig(), url=self.config.get("sandbox_fusion_url") or None
        )

    def program(self, code: str) -> str:
        """The program that runs for the call's ``code``."""
        return code

    def execute(self, arguments: dict[str, Any], create_kwargs: dict[str, Any]) -> ToolOutput:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolOutput("Error: the call has no 'code' string to run", status="error")
        result = run_code(self.program(code), "", self.sandbox, self.fusion)
        text = result.stdout + (("\n" if result.stdout else "") + result.stderr if result.stderr else "")
        if result.ok:
            return ToolOutput(text)
        status = "timeout" if result.status == "timeout" else "error"
        return ToolOutput(f"{text}\nError: {result.error}" if text else f"Error: {result.error}", status=status)


class ReToolCodeInterpreterTool(CodeInterpreterTool):
    """ReTool's code tool (verl-recipe ``recipe.retool.retool.CustomSandboxFusionTool``): the code of
    the call's first ```` ```python ```` block where it has one, and its last line printed unless it
    is a print already (as ReTool writes it: any last line, an assignment too)."""

    BLOCK = re.compile(r"```python(.*?)```", re.DOTALL)

    def program(self, code: str) -> str:
        blocks = self.BLOCK.findall(code)
        lines = (blocks[0].strip() if blocks else code).split("\n")
        for i in range(len(lines) - 1, -1, -1):
            if lines[i] == "":
                continue
            if not lines[i].startswith("print"):
                lines[i] = f"print({lines[i]})"
            break
        return "\n".join(lines)

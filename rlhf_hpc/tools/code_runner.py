"""Where a program runs: the user's SandboxFusion service when ``reward_model.sandbox_fusion.url``
is set (as verl), else the sandbox on this node. The one entry point of the code reward and a code tool."""

from __future__ import annotations

from typing import Union

from rlhf_hpc.config.sandbox_schema import SandboxConfig, SandboxFusionConfig
from rlhf_hpc.tools.sandbox import SandboxResult, run_in_sandbox
from rlhf_hpc.tools.sandbox_fusion import run_in_sandbox_fusion

__all__ = ["run_code"]


def run_code(
    program: str, stdin: Union[str, bytes], sandbox: SandboxConfig, sandbox_fusion: SandboxFusionConfig
) -> SandboxResult:
    """Run ``program`` with ``stdin`` under ``sandbox``'s limits, on the SandboxFusion service or here;
    never raises for what the program does (SandboxUnavailable: no sandbox can run here at all)."""
    if sandbox_fusion.url:
        return run_in_sandbox_fusion(program, stdin, sandbox, sandbox_fusion)
    return run_in_sandbox(program, stdin, sandbox)

"""verl's GSM8K tool (``verl.tools.gsm8k_tool.Gsm8kTool``, the model calls it ``calc_gsm8k_reward``):
the model submits an answer and reads back whether it is right, scored as verl's tool scores it
(the GSM8K rule, flexible extraction, against the row's ``create_kwargs.ground_truth``)."""

from __future__ import annotations

from typing import Any

from rlhf_hpc.rewards.gsm8k import gsm8k_score
from rlhf_hpc.tools.tool import Tool, ToolOutput

__all__ = ["Gsm8kTool"]


class Gsm8kTool(Tool):
    def execute(self, arguments: dict[str, Any], create_kwargs: dict[str, Any]) -> ToolOutput:
        if "ground_truth" not in create_kwargs:
            return ToolOutput(
                "Error: this row has no ground truth for the tool (extra_info.tools_kwargs."
                f"{self.name}.create_kwargs.ground_truth)",
                status="error",
            )
        answer = arguments.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        response = answer if answer.startswith("#### ") else "#### " + answer
        reward = gsm8k_score(response, create_kwargs["ground_truth"], method="flexible")
        # verl's text; its tool reward is 0 on a first submission (its -0.05 needs state across calls,
        # which verl's agent loop does not keep either: one instance per call)
        return ToolOutput(f"Current parsed {answer=} {reward=}", reward=0.0)

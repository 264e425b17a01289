"""ReTool's reward (verl-recipe ``retool/retool.py: compute_score``): verl's DAPO math rule in its
strict-box form (the last ``\\boxed{...}`` of the response's last 100 characters, equal to the ground
truth as a string) scores 1 or -1, and a wrong answer is lifted by 0.05 per turn after the first two
(``num_turns``, the agent loop's), to at most -0.6: it encourages calling the code tool."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["compute_score", "strict_box"]


def last_boxed_string(text: str) -> Optional[str]:
    """verl's ``last_boxed_only_string``: the last ``\\boxed{...}`` with its braces balanced, or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if text[i] == "}" and depth == 0:
            return text[start : i + 1]
    return None


def strict_box(response: str, ground_truth: str) -> tuple[float, Optional[str]]:
    """verl's ``math_dapo.compute_score(..., strict_box_verify=True)``: (1.0 or -1.0, the boxed answer)."""
    boxed = last_boxed_string(response[-300:][-100:])
    pred = boxed[len("\\boxed{") : -1] if boxed is not None else None
    return (1.0 if pred == ground_truth else -1.0), pred


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict, **kwargs) -> dict:
    score, pred = strict_box(solution_str, str(ground_truth))
    if score < 0:  # encourage the model to call tools
        score = min(-0.6, score + (extra_info["num_turns"] - 2) / 2 * 0.1)
    return {"score": score, "acc": score > 0, "pred": pred or ""}

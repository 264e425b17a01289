"""Math answers in ``\\boxed{...}``: the last boxed expression, normalised, equal to the ground truth."""

from __future__ import annotations

from typing import Optional

__all__ = ["boxed_score", "last_boxed"]


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def normalise(expr: str) -> str:
    s = expr.strip().strip("$").rstrip(".")
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", " ", "^{\\circ}", "^\\circ", "\\%", "%"):
        s = s.replace(junk, "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    try:
        value = float(s.replace(",", ""))
        return repr(int(value)) if value.is_integer() else repr(value)
    except ValueError:
        return s


def boxed_score(response: str, ground_truth: str) -> float:
    answer = last_boxed(response)
    if answer is None:
        return 0.0
    truth = last_boxed(ground_truth) or ground_truth
    return 1.0 if normalise(answer) == normalise(truth) else 0.0

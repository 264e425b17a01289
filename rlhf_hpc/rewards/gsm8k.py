"""GSM8K rule reward, scored as the reference does: the last ``#### N`` (strict) or the last number
(flexible) in the final 300 characters, equal to the ground truth -> 1.0, else ``format_score``."""
from __future__ import annotations

import re
from typing import Optional

_CLIP_CHARS = 300


def extract_answer(text: str, method: str = "strict") -> Optional[str]:
    if method not in ("strict", "flexible"):
        raise ValueError(f"unknown GSM8K extraction method '{method}'; use strict or flexible")
    text = text[-_CLIP_CHARS:]
    if method == "strict":
        found = re.findall(r"#### (\-?[0-9\.\,]+)", text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(re.findall(r"(\-?[0-9\.\,]+)", text)):
        if candidate not in ("", "."):
            return candidate
    return None


def gsm8k_score(response: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                score: float = 1.0) -> float:
    answer = extract_answer(response, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score


def ground_truth_from_answer(answer: str) -> str:
    """The dataset's reference solution -> its final number (text after '#### ', commas removed)."""
    found = extract_answer(answer, "strict")
    if found is None:
        raise ValueError(f"no '#### <number>' in the answer: {answer[-80:]!r}")
    return found

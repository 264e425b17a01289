"""GSM8K rule reward: the last ``#### N`` (strict) or the last number (flexible) in the final 300
characters, equal to the ground truth -> 1.0, else ``format_score``; no answer found -> 0.0.

Numbers are compared as numbers a person would read alike: ``#### $18``, ``#### 1,234``,
``#### 18.00``, ``18.`` at the end of a sentence all mean what they say. This differs from the
reference's regex, which compares strings (``18.00`` != ``18``) and needs a digit right after
``#### `` (``#### $18`` finds nothing); see docs/from-verl.md's table of differences.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["extract_answer", "ground_truth_from_answer", "gsm8k_score"]

_CLIP_CHARS = 300
# a number: thousands groups with commas (1,234,567) or plain digits, optional decimals
_NUMBER = r"-?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_FLEXIBLE = re.compile(r"(?<![\d.,])\$?(" + _NUMBER + r")")


def canonical_number(text: str) -> str:
    """``"1,234.50"`` -> ``"1234.5"``, ``"$18"`` -> ``"18"``, ``"18.00"`` -> ``"18"``, ``"-0"`` -> ``"0"``."""
    t = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if "." in t:
        t = t.rstrip("0").rstrip(".")
    if t.startswith("+"):
        t = t[1:]
    if t.lstrip("-").lstrip("0") == "":
        return "0"
    sign = "-" if t.startswith("-") else ""
    digits = t.lstrip("-").lstrip("0")
    return sign + (digits if not digits.startswith(".") else "0" + digits)


def extract_answer(text: str, method: str = "strict") -> Optional[str]:
    """The answer in canonical form (``canonical_number``), or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"unknown GSM8K extraction method '{method}'; use strict or flexible")
    text = text[-_CLIP_CHARS:]
    found = (_STRICT if method == "strict" else _FLEXIBLE).findall(text)
    return canonical_number(found[-1]) if found else None


def gsm8k_score(
    response: str, ground_truth: str, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    answer = extract_answer(response, method)
    if answer is None:
        return 0.0
    return score if answer == canonical_number(str(ground_truth)) else format_score


def ground_truth_from_answer(answer: str) -> str:
    """The dataset's reference solution -> its final number (text after '#### ', commas removed)."""
    found = extract_answer(answer, "strict")
    if found is None:
        raise ValueError(f"no '#### <number>' in the answer: {answer[-80:]!r}")
    return found

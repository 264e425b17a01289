"""Search-R1's reward (verl's ``search_r1_like_qa_em``, for rows whose ``data_source`` starts with
``searchR1_``): the last ``<answer>...</answer>`` of the response, normalised (lower case, no
punctuation or articles, single spaces), equal to one of ``ground_truth["target"]``: 1, else 0;
a right answer among more than 10 answer tags (a response spraying them) scores a quarter."""

from __future__ import annotations

import re
import string
from typing import Any, Optional

__all__ = ["normalize_answer", "search_r1_score"]

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def last_answer(response: str) -> Optional[str]:
    found = ANSWER.findall(response)
    return found[-1].strip() if found else None


def search_r1_score(response: str, ground_truth: Any) -> float:
    answer = last_answer(response)
    if answer is None:
        return 0.0
    targets = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
    targets = [targets] if isinstance(targets, str) else list(targets)
    if normalize_answer(answer) not in {normalize_answer(str(t)) for t in targets}:
        return 0.0
    return 0.25 if max(response.count("<answer>"), response.count("</answer>")) > 10 else 1.0

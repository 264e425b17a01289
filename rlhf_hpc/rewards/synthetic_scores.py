"""Scores of the built-in tasks (rlhf_hpc.data.synthetic_tasks builds their rows)."""

from __future__ import annotations

import re

__all__ = ["ADD_SOURCE", "CODE_SOURCE", "COPY_SOURCE", "LOOKUP_SOURCE", "addition_score", "copy_score", "lookup_score"]

COPY_SOURCE = "synthetic/copy"
ADD_SOURCE = "synthetic/add"
LOOKUP_SOURCE = "synthetic/lookup"
CODE_SOURCE = "synthetic/code"  # scored by running the program: rewards/code.py


def copy_score(response: str, ground_truth: str) -> float:
    """Share of the response's characters equal to the target (0 for an empty response)."""
    text = response.strip()
    return sum(c == ground_truth for c in text) / len(text) if text else 0.0


def addition_score(response: str, ground_truth: str) -> float:
    """1.0 when the response's last integer is the sum, else 0."""
    numbers = re.findall(r"-?\d+", response.replace(",", ""))
    return float(bool(numbers) and int(numbers[-1]) == int(ground_truth))


def lookup_score(response: str, ground_truth: str) -> float:
    """1.0 when the conversation ends with the model's ``#### <code>`` (a tool's answer holding the
    code does not count), else 0."""
    return float(response.strip().endswith(f"#### {ground_truth}"))

"""Scores for responses: rule rewards by ``data_source``, or a user's function.

``RewardFunction(cfg)(data_source, response_text, ground_truth, extra_info) -> float``.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable

from rlhf_hpc.rewards.synthetic import ADD_SOURCE, COPY_SOURCE, addition_score, copy_score
from rlhf_hpc.rewards.gsm8k import gsm8k_score
from rlhf_hpc.rewards.math import boxed_score

ScoreFn = Callable[[str, str, Any, dict], float]


def rule_score(data_source: str, response: str, ground_truth: Any, extra_info: dict) -> float:
    """The built-in rule reward for ``data_source``."""
    src = data_source.lower()
    if "gsm8k" in src:
        return gsm8k_score(response, str(ground_truth))
    if src == COPY_SOURCE:
        return copy_score(response, str(ground_truth))
    if src == ADD_SOURCE:
        return addition_score(response, str(ground_truth))
    if "math" in src or "aime" in src:
        return boxed_score(response, str(ground_truth))
    raise ValueError(f"no rule reward for data_source '{data_source}' (built in: openai/gsm8k, *math*, "
                     f"{COPY_SOURCE}, {ADD_SOURCE}); set custom_reward_function.path to score it")


def load_custom_function(path: str, name: str) -> ScoreFn:
    """Import ``name`` from the Python file at ``path`` (only the path the user configured)."""
    file = Path(path).expanduser()
    spec = importlib.util.spec_from_file_location(f"rlhf_hpc_custom_reward_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"custom_reward_function.path: cannot import '{path}'")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"custom_reward_function.name: '{path}' has no function '{name}'")
    return fn


class RewardFunction:
    """Scores one response; errors name the row so a bad ground truth is easy to find."""

    def __init__(self, cfg):
        crf = cfg.custom_reward_function
        self.fn: ScoreFn = load_custom_function(crf.path, crf.name) if crf.path else rule_score
        self.name = f"{crf.path}:{crf.name}" if crf.path else "rule"

    def __call__(self, data_source: str, response: str, ground_truth: Any, extra_info: dict, row: int = -1) -> float:
        try:
            score = self.fn(data_source, response, ground_truth, extra_info)
            return float(score)
        except Exception as e:
            raise RuntimeError(f"reward function {self.name} failed on prompt row {row} "
                               f"(data_source {data_source!r}): {type(e).__name__}: {e}") from e

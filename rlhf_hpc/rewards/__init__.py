"""Scores for responses: rule rewards by ``data_source``, or a user's function.

``RewardFunction(cfg.custom_reward_function)(data_source, response_text, ground_truth, extra_info) -> float``.
"""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlhf_hpc.config.plugin_class import import_entry
from rlhf_hpc.config.registry import Registry
from rlhf_hpc.config.verl_recipes import verl_recipe_code
from rlhf_hpc.rewards.code import CODE_SOURCES, code_score, configure_code_reward
from rlhf_hpc.rewards.gsm8k import gsm8k_score
from rlhf_hpc.rewards.math import boxed_score
from rlhf_hpc.rewards.search_r1 import search_r1_score
from rlhf_hpc.rewards.synthetic_scores import (
    ADD_SOURCE,
    COPY_SOURCE,
    LOOKUP_SOURCE,
    addition_score,
    copy_score,
    lookup_score,
)

__all__ = ["RULE_REWARDS", "RewardFunction", "RuleReward", "register_rule_reward", "rule_score"]

ScoreFn = Callable[[str, str, Any, dict], float]


@dataclass(frozen=True)
class RuleReward:
    """A built-in rule reward: ``matches(data_source)`` says which rows it scores (lower-cased
    ``data_source``), ``score(response, ground_truth)`` their score; ``raw_truth``: it reads the
    row's ground truth as the data holds it (a mapping, a list), not as text."""

    name: str
    matches: Callable[[str], bool]
    score: Callable[[str, Any], float]
    raw_truth: bool = False


# the rule rewards, tried in order: the first that matches a row's data_source scores it
RULE_REWARDS: Registry[RuleReward] = Registry("rule reward", "data_source")


def register_rule_reward(name: str, matches: Callable[[str], bool], raw_truth: bool = False):
    """``@register_rule_reward("name", matches=lambda source: ...)`` on a ``(response, ground_truth)
    -> float`` function."""
    return RULE_REWARDS.decorator(name, lambda fn: RuleReward(name, matches, fn, raw_truth))


register_rule_reward("gsm8k", lambda src: "gsm8k" in src)(gsm8k_score)
register_rule_reward("copy", lambda src: src == COPY_SOURCE)(copy_score)
register_rule_reward("add", lambda src: src == ADD_SOURCE)(addition_score)
register_rule_reward("lookup", lambda src: src == LOOKUP_SOURCE)(lookup_score)
register_rule_reward("math", lambda src: "math" in src or "aime" in src)(boxed_score)
register_rule_reward("code", lambda src: src in CODE_SOURCES)(code_score)  # runs the program: rlhf_hpc/tools
register_rule_reward("search_r1", lambda src: src.startswith("searchr1_"), raw_truth=True)(search_r1_score)


def rule_score(data_source: str, response: str, ground_truth: Any, extra_info: dict) -> float:
    """The built-in rule reward for ``data_source`` (the first of ``RULE_REWARDS`` that matches it)."""
    src = data_source.lower()
    rule = next((r for r in RULE_REWARDS.values() if r.matches(src)), None)
    if rule is None:
        raise ValueError(
            f"no rule reward for data_source '{data_source}' (built in: "
            f"{', '.join(RULE_REWARDS)}: openai/gsm8k, *math*/*aime*, {COPY_SOURCE}, {ADD_SOURCE}, "
            f"{LOOKUP_SOURCE}, searchR1_*, "
            f"{'/'.join(CODE_SOURCES)}); "
            f"set custom_reward_function.path to score it"
        )
    return rule.score(response, ground_truth if rule.raw_truth else str(ground_truth))


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
    """Scores one response: ``custom_reward_function``'s (its config section) or the rule rewards;
    errors name the row so a bad ground truth is easy to find. ``sandbox``: the run's ``(sandbox,
    reward_model.sandbox_fusion)`` sections, where the code reward runs programs (None: its defaults)."""

    def __init__(self, crf, sandbox: Any = None):
        recipe_code = verl_recipe_code(crf.path, crf.name)  # (a verl recipe's function: its equivalent here)
        self.fn: ScoreFn = (
            import_entry(recipe_code.entry)
            if recipe_code
            else load_custom_function(crf.path, crf.name)
            if crf.path
            else rule_score
        )
        self.name = f"{crf.path}:{crf.name}" if crf.path else "rule"
        self.parallel = 1
        if sandbox is not None:
            configure_code_reward(*sandbox)
            self.parallel = max(1, sandbox[0].max_parallel)

    def __call__(
        self,
        data_source: str,
        response: str,
        ground_truth: Any,
        extra_info: dict,
        row: int = -1,
        keys: tuple[str, ...] = (),
    ) -> Any:
        """The score; with ``keys``, (score, [the values of those keys of the function's dict result])."""
        try:
            score = self.fn(data_source, response, ground_truth, extra_info)
            value = float(score["score"] if isinstance(score, dict) else score)  # (verl's: a dict holds "score")
        except Exception as e:
            raise RuntimeError(
                f"reward function {self.name} failed on prompt row {row} "
                f"(data_source {data_source!r}): {type(e).__name__}: {e}"
            ) from e
        if not keys:
            return value
        missing = [k for k in keys if not isinstance(score, dict) or k not in score]
        if missing:
            have = ", ".join(score) if isinstance(score, dict) else f"a {type(score).__name__}, not a dict"
            raise RuntimeError(
                f"reward function {self.name} on prompt row {row}: algorithm.gdpo_reward_keys names "
                f"{', '.join(missing)}, which its result lacks (it returned {have}); return a dict "
                f"with each key, or change gdpo_reward_keys"
            )
        return value, [float(score[k]) for k in keys]

    def score_all(self, calls: list[tuple], keys: tuple[str, ...] = ()) -> list:
        """``self(*call, keys=keys)`` for each call, in order; ``sandbox.max_parallel`` at once (a code
        reward's programs wait on their sandbox, not on this process's CPU)."""
        if self.parallel == 1 or len(calls) < 2:
            return [self(*c, keys=keys) for c in calls]
        with ThreadPoolExecutor(self.parallel) as pool:
            return list(pool.map(lambda c: self(*c, keys=keys), calls))

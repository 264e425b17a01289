"""DAPO's overlong reward shaping (verl's ``dapo`` reward manager, ``reward_model.overlong_buffer``).

A response longer than ``max_response_length - overlong_buffer.len`` tokens gets a penalty that
grows linearly over the buffer, down to ``-penalty_factor`` at ``max_response_length``, added to
its score; shorter responses get 0. verl's formula, per response of ``length`` valid tokens::

    expected_len = max_resp_len - buffer_len
    exceed_len = length - expected_len
    overlong_reward = min(-exceed_len / buffer_len * penalty_factor, 0)

With ``overlong_buffer.log`` the step logs, as verl's ``reward_extra_info`` keys,
``reward/overlong_reward/mean`` (the mean penalty) and ``reward/overlong/mean`` (the fraction of
responses penalised), global over ranks.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["overlong_metrics", "overlong_reward"]


def overlong_reward(lengths: torch.Tensor, max_resp_len: int, buffer_len: int, penalty_factor: float) -> torch.Tensor:
    """(B,) the penalty of responses of ``lengths`` valid tokens (0 or negative), verl's formula."""
    expected_len = max_resp_len - buffer_len
    exceed_len = lengths.long() - expected_len  # as verl: integer lengths, float32 after the division
    return torch.clamp(-exceed_len / buffer_len * penalty_factor, max=0.0)


def overlong_metrics(penalty: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
    """``reward/overlong_reward/mean`` and ``reward/overlong/mean`` over every rank's responses
    (``all_reduce``: a sum over ranks; collective)."""
    sums = all_reduce(
        torch.tensor([float(penalty.sum()), float((penalty < 0).sum()), float(penalty.numel())], dtype=torch.float64)
    )
    count: Optional[float] = float(sums[2]) or None
    return {
        "reward/overlong_reward/mean": float(sums[0]) / count if count else 0.0,
        "reward/overlong/mean": float(sums[1]) / count if count else 0.0,
    }

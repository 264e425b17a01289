"""PF-PPO (Policy Filtration for PPO, arXiv 2409.06957; verl's ``algorithm.use_pf_ppo``): after the
advantages, the step's responses are resampled with replacement, each drawn with a weight from its
score, so the update sees more of the responses whose reward is most reliable.

Weights (``algorithm.pf_ppo.reweight_method``, verl's ``compute_pf_ppo_reweight_data``): ``pow``,
|score| ^ ``weight_pow``; ``max_min``, 1 for the batch's highest and lowest scores, 0 otherwise;
``max_random``, 0.4 for the highest, 0.1 for the rest; each plus 1e-8 (none is ever 0). As many
draws as responses. Pure torch; the trainer draws over every rank's rows with one seeded
generator (``rlhf_hpc.distributed.rows.resample_rows``), where verl draws on its driver with the
global RNG (so here a resumed run draws the same rows again).
"""

from __future__ import annotations

import torch

__all__ = ["PF_PPO_METHODS", "pf_ppo_indices", "pf_ppo_weights"]

PF_PPO_METHODS = ("pow", "max_min", "max_random")


def pf_ppo_weights(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0) -> torch.Tensor:
    """(B,) sequence scores -> (B,) sampling weights, verl's."""
    if method == "pow":
        weights = torch.pow(torch.abs(scores), weight_pow)
    elif method == "max_min":
        weights = torch.where((scores == scores.max()) | (scores == scores.min()), 1.0, 0.0)
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1)
    else:
        raise ValueError(f"algorithm.pf_ppo.reweight_method={method!r}: choose from {', '.join(PF_PPO_METHODS)}")
    return torch.clamp(weights + 1e-8, min=1e-8)


def pf_ppo_indices(scores: torch.Tensor, method: str, weight_pow: float, generator: torch.Generator) -> torch.Tensor:
    """(B,) indices of the resampled batch: B draws with replacement from the weights of ``scores``."""
    weights = pf_ppo_weights(scores.float(), method, weight_pow)
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)

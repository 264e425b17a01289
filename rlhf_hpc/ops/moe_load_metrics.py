"""How evenly the engine spread a mixture of experts' response tokens over its experts (verl 0.9.1's
``rollout.moe_load_balance_metrics_interval``; ``verl.trainer.ppo.metric_utils``).

From the routing the engine recorded (``routed_experts``, router replay's data): per layer, each
expert's share of the response tokens' top-k slots over an interval of steps, as violations of an
even load (``share x experts - 1``): its largest, its smallest and its mean absolute value, per
layer and over the layers. Each response's last token is left out: it was sampled, never fed
back, and has no routing.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["MoELoadCounts", "load_balance_metrics", "response_load_counts"]


def response_load_counts(routed: torch.Tensor, response_mask: torch.Tensor, experts: int) -> Optional[torch.Tensor]:
    """(layers, experts) top-k slots of the response tokens per expert; ``routed``: (B, T, layers, k)
    whose last ``R`` columns are the responses of ``response_mask`` (B, R). None: nothing to count."""
    R = response_mask.shape[1]
    if R == 0 or routed.shape[1] < R:
        return None
    mask = response_mask.bool()
    positions = torch.arange(R)
    last = torch.where(mask, positions, positions.new_full((), -1)).amax(dim=-1)
    mask = mask & ~((positions.unsqueeze(0) == last.unsqueeze(1)) & (last >= 0).unsqueeze(1))
    selected = routed[:, -R:][mask].long()  # (tokens, layers, k)
    if selected.numel() == 0:
        return None
    return torch.stack(
        [torch.bincount(selected[:, layer].flatten(), minlength=experts) for layer in range(selected.shape[1])]
    )


def load_balance_metrics(counts: Optional[torch.Tensor], prefix: str = "rollout/moe") -> dict[str, float]:
    """verl's metrics of (layers, experts) counts: ``{prefix}/{max,min,avg}_vio/layer_{i}`` and each
    one's ``/max`` and ``/avg`` over the layers."""
    if counts is None or counts.numel() == 0:
        return {}
    load = counts.float()
    load = load / load.sum(dim=1, keepdim=True).clamp_min(1.0)
    deviation = load * load.shape[1] - 1.0
    kinds = {"max_vio": deviation.max(dim=1).values, "min_vio": deviation.min(dim=1).values}
    kinds["avg_vio"] = deviation.abs().mean(dim=1)
    metrics: dict[str, float] = {}
    for i in range(load.shape[0]):
        for name, values in kinds.items():
            metrics[f"{prefix}/{name}/layer_{i}"] = values[i].item()
    for name, values in kinds.items():
        metrics[f"{prefix}/{name}/max"] = values.max().item()
        metrics[f"{prefix}/{name}/avg"] = values.mean().item()
    return metrics


class MoELoadCounts:
    """Counts summed over the steps of one logging interval (every rank's, summed by the caller)."""

    def __init__(self, experts: int):
        self.experts = experts
        self.counts: Optional[torch.Tensor] = None

    def add(self, counts: torch.Tensor) -> None:
        self.counts = counts.clone() if self.counts is None else self.counts + counts

    def pop_metrics(self) -> dict[str, float]:
        """The interval's metrics (verl's, and how many slots were counted); the counts start over."""
        assignments = int(self.counts.sum()) if self.counts is not None else 0
        metrics = load_balance_metrics(self.counts)
        metrics["rollout/moe/routed_experts_found"] = float(assignments > 0)
        metrics["rollout/moe/routed_expert_assignments"] = assignments
        self.counts = None
        return metrics

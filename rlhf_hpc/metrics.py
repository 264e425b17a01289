"""Reducing per-rank training metrics to one value per key, the same on every rank."""
from __future__ import annotations

from collections import defaultdict

import torch


class UpdateMetrics:
    """Accumulates the metrics of one update (all epochs, mini- and micro-batches) on one rank.

    ``share``: this rank's share of a global per-mini-batch quantity (a loss normalised by global
    counts): summed over micro-batches and ranks, averaged over mini-batches.
    ``token_mean``: a per-micro-batch mean over its valid tokens: weighted by those tokens, so the
    result is the mean over every token of the update, however the batch was split.
    """

    def __init__(self):
        self.shares: dict[str, list[float]] = defaultdict(list)
        self.weighted: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.n_mini = 0

    def new_mini_batch(self) -> None:
        self.n_mini += 1
        for v in self.shares.values():
            v.append(0.0)

    def share(self, key: str, value: float) -> None:
        if key not in self.shares:
            self.shares[key] = [0.0] * self.n_mini
        self.shares[key][-1] += value

    def token_mean(self, key: str, value: float, tokens: float) -> None:
        acc = self.weighted[key]
        acc[0] += value * tokens
        acc[1] += tokens

    def reduce(self, all_reduce=None) -> dict[str, float]:
        """One all-reduce for everything; returns the same dict on every rank."""
        ks, kw = sorted(self.shares), sorted(self.weighted)
        flat = [sum(self.shares[k]) / max(1, len(self.shares[k])) for k in ks]
        for k in kw:
            flat += self.weighted[k]
        local = torch.tensor(flat, dtype=torch.float64)
        if all_reduce is not None and local.numel():
            local = all_reduce(local).cpu()
        out = {k: local[i].item() for i, k in enumerate(ks)}
        for j, k in enumerate(kw):
            total, weight = local[len(ks) + 2 * j].item(), local[len(ks) + 2 * j + 1].item()
            out[k] = total / weight if weight else 0.0
        return out

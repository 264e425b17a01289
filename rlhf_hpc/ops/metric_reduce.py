"""Reducing per-rank training metrics to one value per key, the same on every rank."""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["UpdateMetrics"]


class UpdateMetrics:
    """Accumulates the metrics of one update (all epochs, mini- and micro-batches) on one rank.

    ``share``: this rank's share of a global per-mini-batch quantity (a loss normalised by global
    counts): summed over micro-batches and ranks, averaged over mini-batches.
    ``token_mean``: a per-micro-batch mean over its valid tokens: weighted by those tokens, so the
    result is the mean over every token of the update, however the batch was split.

    Values may be (0-d, detached) tensors on the compute device: they are summed there and read
    back once, in ``reduce``, so a micro-batch costs the host no synchronisation with the GPU.
    """

    def __init__(self):
        self.shares: dict[str, list] = defaultdict(list)  # float or 0-d tensor per mini-batch
        self.weighted: dict[str, list] = defaultdict(lambda: [0.0, 0.0])
        self.n_mini = 0

    def new_mini_batch(self) -> None:
        self.n_mini += 1
        for v in self.shares.values():
            v.append(0.0)

    def share(self, key: str, value) -> None:
        if key not in self.shares:
            self.shares[key] = [0.0] * self.n_mini
        self.shares[key][-1] = self.shares[key][-1] + _detached(value)

    def token_mean(self, key: str, value, tokens) -> None:
        acc = self.weighted[key]
        acc[0] = acc[0] + _detached(value) * tokens
        acc[1] = acc[1] + _detached(tokens)

    def reduce(self, all_reduce=None) -> dict[str, float]:
        """One read-back and one all-reduce for everything; the same dict on every rank."""
        ks, kw = sorted(self.shares), sorted(self.weighted)
        flat = [sum(self.shares[k]) / max(1, len(self.shares[k])) for k in ks]
        for k in kw:
            flat += self.weighted[k]
        local = _to_host(flat)
        if all_reduce is not None and local.numel():
            local = all_reduce(local).cpu()
        out = {k: local[i].item() for i, k in enumerate(ks)}
        for j, k in enumerate(kw):
            total, weight = local[len(ks) + 2 * j].item(), local[len(ks) + 2 * j + 1].item()
            out[k] = total / weight if weight else 0.0
        return out


def _detached(value):
    return value.detach().double() if isinstance(value, torch.Tensor) else value


def _to_host(values: list) -> torch.Tensor:
    """Floats and 0-d tensors -> one float64 host tensor, with a single device-to-host copy."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))
    stacked = (
        torch.stack(
            [
                v.to(device, torch.float64)
                if isinstance(v, torch.Tensor)
                else torch.tensor(float(v), dtype=torch.float64, device=device)
                for v in values
            ]
        )
        if values
        else torch.zeros(0, dtype=torch.float64)
    )
    return stacked.cpu()

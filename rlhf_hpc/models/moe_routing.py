"""A mixture of experts' routing, recorded and replayed (verl's router replay, ``router_replay.mode``
R3: the engine's routing in every actor forward; R2: the old-log-prob pass's in the update's).

The engine that generated a row routed each of its tokens to experts; the trainer, recomputing the
same tokens in another precision or kernel, may route some of them elsewhere, and the log-prob it
trains on is then not the one the engine sampled from. Replay makes the trainer's forward passes
use the engine's experts: each router's top-k indices are replaced by the recorded ones, and the
gate weights are recomputed from the router's current logits over those experts (softmax over all
experts, gathered at the recorded ones, renormalised where the model renormalises its top-k), so
the router still learns. A token without a recorded routing (padding, a row's last token, which
the engine never fed back) arrives as an all-zero row; a row whose experts repeat is routed by the
trainer itself, as verl does.

The routers are transformers' ``*TopKRouter`` modules (``forward -> (logits, top-k weights, top-k
indices)``), reached by forward hooks, in layer order; targets are ``(tokens, layers, k)`` in the
order the model sees the tokens (a packed batch: its valid tokens row by row).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

__all__ = ["REPLAYABLE", "RoutingReplay", "laid_out", "routers"]

# the architectures whose router forward and weight math the replay reproduces (tests/test_moe_routing.py)
REPLAYABLE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


def routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers of ``model``, one per mixture-of-experts layer, in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


class RoutingReplay:
    """Forward hooks on ``model``'s routers that record their top-k experts or replace them.

    ``record(targets)``: each router forward appends its indices (tokens, k) to ``recorded[layer]``
    (with ``targets``, its agreement with them counted too; its routing is its own).
    ``replay(targets)``: each router forward counts, over the tokens with a target, how many it
    routes as ``targets[:, layer]`` says itself (``take_agreement``), then routes to the targets
    (``substitute``; else it keeps its own routing: the agreement is only measured)."""

    def __init__(self, model: nn.Module, substitute: bool = True):
        self.substitute = substitute
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no top-k routers: routing replay needs a mixture of experts")
        self._layer = {id(r): i for i, r in enumerate(self.routers)}
        self._mode: Optional[str] = None
        self.recorded: list[list[torch.Tensor]] = []
        self._targets: Optional[torch.Tensor] = None
        self.agreed = self.counted = 0
        self._hooks = [r.register_forward_hook(self._hook) for r in self.routers]

    @property
    def layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        return int(self.routers[0].top_k)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    @contextlib.contextmanager
    def record(self, targets: Optional[torch.Tensor] = None) -> Iterator[list[list[torch.Tensor]]]:
        """Each router forward inside appends its (tokens, k) indices to ``recorded[layer]``; with
        ``targets`` (tokens, layers, k), its agreement with them is counted (``take_agreement``)."""
        self._check(targets)
        self.recorded = [[] for _ in self.routers]
        self._targets, self._mode = targets, "record"
        try:
            yield self.recorded
        finally:
            self._targets, self._mode = None, None

    @contextlib.contextmanager
    def replay(self, targets: torch.Tensor) -> Iterator[None]:
        """Route the forwards inside to ``targets`` (tokens, layers, k)."""
        self._check(targets)
        self._targets, self._mode = targets, "replay"
        try:
            yield
        finally:
            self._targets, self._mode = None, None

    def _check(self, targets: Optional[torch.Tensor]) -> None:
        if targets is not None and (
            targets.dim() != 3 or targets.shape[1] != self.layers or targets.shape[2] != self.top_k
        ):
            raise ValueError(
                f"routing replay: targets of shape {tuple(targets.shape)}, the model has {self.layers} "
                f"routed layers of top-{self.top_k}"
            )

    def around_forward(self, targets: Optional[torch.Tensor], record: bool):
        """The context of one forward: ``record`` (with ``targets``: their agreement counted), else a
        replay of ``targets`` where there are any."""
        if record:
            return self.record(targets)
        return self.replay(targets) if targets is not None else contextlib.nullcontext()

    def chosen(self) -> torch.Tensor:
        """(tokens, layers, k) what the last ``record`` saw, in the order its forwards saw the tokens."""
        return torch.stack([torch.cat(calls) for calls in self.recorded], dim=1)

    def take_agreement(self) -> tuple[int, int]:
        """(token-layer pairs routed as recorded by the trainer's own top-k, pairs with a record)
        since the last call."""
        out = (self.agreed, self.counted)
        self.agreed = self.counted = 0
        return out

    def _hook(self, module: nn.Module, args, output):
        if self._mode is None:
            return None
        logits, scores, indices = output
        layer = self._layer[id(module)]
        if self._mode == "record":
            self.recorded[layer].append(indices.detach().to(torch.int16).cpu())
            if self._targets is None:
                return None
        target = self._targets[:, layer].to(device=indices.device, dtype=indices.dtype)
        if target.shape != indices.shape:
            raise RuntimeError(
                f"routing replay: layer {layer} routes {tuple(indices.shape)} tokens x experts, the "
                f"recorded routing has {tuple(target.shape)}"
            )
        ordered = target.sort(dim=-1).values
        missing = (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1)  # (an all-zero row: no record)
        # (a recomputed forward under activation checkpointing counts twice, agreed and counted alike)
        have = ~missing
        self.agreed += int(((indices.sort(dim=-1).values == ordered).all(dim=-1) & have).sum())
        self.counted += int(have.sum())
        if not self.substitute or self._mode == "record":
            return None
        chosen = torch.where(missing.unsqueeze(-1), indices, target)
        probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
        if getattr(module, "norm_topk_prob", True):  # (Mixtral's router always renormalises)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return logits, probs.to(scores.dtype), chosen


def laid_out(chosen: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """(tokens, layers, k) routing of the tokens at ``where`` (B, T), in row order -> (B, T, layers,
    k) int16 laid out as input_ids, zero elsewhere (the layout of ``batch["routed_experts"]``)."""
    out = torch.zeros((*where.shape, *chosen.shape[1:]), dtype=torch.int16)
    out[where.cpu()] = chosen.cpu().to(torch.int16)
    return out

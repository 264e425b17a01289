"""The generation RNG: one random stream per rollout data-parallel rank, kept apart from training's.

The ranks of one tensor-parallel rollout group run one model split in pieces: every sampling step
all-reduces across them, so they must draw the same tokens, from the same RNG state. Training
draws per rank (dropout, shuffles), so the two streams cannot be one. Like verl's hybrid engine,
the generation state is swapped in around each generation and the training state back after it:

    rng = GenerationRNG(seed, dp_rank, device)
    with rng.active():     # training state saved, generation state in
        engine.generate(...)
    # generation state saved for next time, training state back: training draws are unaffected
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

__all__ = ["GenerationRNG", "preserved_rng", "seed_all"]


def _capture(device: torch.device) -> dict:
    # numpy too: vLLM's V2 model runner (GPU builds with triton) draws each request's seed from it
    state = {"cpu": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _restore(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_all(seed: int) -> None:
    """Every global RNG generation may draw from: torch (CPU and CUDA), Python's, and numpy's (vLLM's
    V2 model runner draws each request's seed from it): a seeded generation replays on a GPU too."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


@contextlib.contextmanager
def preserved_rng(device: torch.device):
    """Run something that re-seeds the global RNGs (vLLM's start-up does) without it showing."""
    saved = _capture(device)
    try:
        yield
    finally:
        _restore(saved, device)


class GenerationRNG:
    """The global torch (CPU and ``device``), Python and numpy RNG states generation runs with.
    ``dp_rank`` is the rollout data-parallel rank: equal on the ranks of one tensor-parallel group."""

    def __init__(self, seed: int, dp_rank: int, device: torch.device):
        self.device = device
        with preserved_rng(device):
            seed_all(seed + dp_rank)
            self._state = _capture(device)

    @contextlib.contextmanager
    def active(self):
        training = _capture(self.device)
        _restore(self._state, self.device)
        try:
            yield
        finally:
            self._state = _capture(self.device)
            _restore(training, self.device)

"""The rollout interface: token ids in, sampled responses with per-token log-probs out."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Optional, Protocol

import torch

__all__ = [
    "ENGINE_ACTOR_KL_LIMIT",
    "LogprobCheck",
    "Response",
    "RolloutEngine",
    "Sampling",
    "covered",
    "logprob_mismatch",
]


@dataclass
class Sampling:
    """How to sample. ``temperature == 0`` or ``do_sample=False`` is greedy decoding."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_tokens: int = 512
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's EOS
    ignore_eos: bool = False
    do_sample: bool = True
    # fixes the draws of one generate() call (a resumed run replays the same rollouts): the engine's
    # generation RNG is re-seeded with it, no per-request seeds; None: the RNG continues
    seed: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0


@dataclass
class Response:
    """One sampled response. ``logprobs[i]`` is log p(token_ids[i]) after temperature/top-k/top-p
    (what the sampler used); a stop/EOS token that ended the response is its last token."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token) or "length" (max_tokens)
    # 1 where the model sampled the token, 0 where a tool's answer was inserted (the agent loop; its
    # log-prob there is 0 and nothing trains on it); None: every token is the model's
    mask: Optional[list[int]] = None
    num_turns: Optional[int] = None  # verl's: the prompt, the model's and the tools'/user's turns (the agent loop)
    # the experts the engine routed each prompt and response token to, (tokens, layers, k) int16, the
    # last token's zero (a mixture of experts with rollout.enable_rollout_routing_replay)
    routed_experts: Optional[torch.Tensor] = None


class RolloutEngine(Protocol):
    name: str
    # the rollout data-parallel rank: ranks with the same dp_rank (one tensor-parallel group) run
    # identical requests, so per-step sampling seeds derive from it, not from the global rank
    dp_rank: int

    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[list[Response]]:
        """For each prompt, ``sampling.n`` responses (in prompt order)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full tensors (Hugging Face names), consuming the iterator lazily, one at a time."""

    def weight_spec(self) -> dict[str, tuple[int, ...]]:
        """Parameter names and shapes the engine expects from ``update_weights``."""

    def release(self) -> None:
        """Free generation memory (KV cache) before the training phase."""

    def resume(self) -> None:
        """Re-allocate it before generating: weights first, then KV cache."""

    def close(self) -> None:
        """Shut down (last thing a rank does: vLLM's teardown ends the process group too)."""

    # LoRA adapter serving (rlhf_hpc.rollout.weight_sync): the rank of the adapter it serves, or None
    # for an engine that takes merged weights only; the three methods are called only where it is set
    adapter_rank: Optional[int]

    def needs_base_weights(self) -> bool:
        """Whether the next sync must send the frozen base weights (the first; after a sleep that
        discarded them)."""

    def update_base_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A LoRA actor's base weights (unmerged, base names), for the adapter to apply on."""

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> None:
        """The adapter's full tensors (PEFT names) and its PEFT config, served from the next generate."""


# k3's log-ratio is capped here: exp(20) is far above any limit, and a finite figure for any engine
K3_LOG_RATIO_CAP = 20.0


def logprob_mismatch(
    engine_logprobs: torch.Tensor,
    actor_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    all_reduce_sum: Optional[Callable] = None,
    all_reduce_max: Optional[Callable] = None,
) -> dict[str, float]:
    """Standing check of the weight sync on the same sampled tokens, (B, R) each ->
    ``rollout/logprob_diff_max`` and ``_mean`` of |engine - actor|, and two estimates of
    KL(engine || actor) (the engine sampled the tokens): ``rollout/engine_actor_kl``, the mean of
    engine - actor (k1: rounding noise barely moves it, its signs cancel, but on few tokens a broken
    engine can make it negative), and ``rollout/engine_actor_k3_kl``, the mean of
    exp(r) - r - 1 with r = actor - engine (k3, verl's low_var_kl: never negative; ~r^2/2 for
    noise). Over all ranks with the reducers (sums and maxima of host tensors)."""
    mask = response_mask.bool()
    signed = (engine_logprobs.double() - actor_logprobs.double())[mask]
    r = (-signed).clamp(max=K3_LOG_RATIO_CAP)  # (a finite estimate for any engine, however broken)
    k3 = torch.expm1(r) - r
    sums = torch.stack(
        [signed.abs().sum(), signed.sum(), torch.tensor(float(signed.numel()), dtype=torch.float64), k3.sum()]
    )
    peak = signed.abs().max().reshape(1) if signed.numel() else torch.zeros(1, dtype=torch.float64)
    if all_reduce_sum is not None:
        sums, peak = all_reduce_sum(sums), all_reduce_max(peak)
    n = max(sums[2].item(), 1.0)
    return {
        "rollout/logprob_diff_max": peak.item(),
        "rollout/logprob_diff_mean": sums[0].item() / n,
        "rollout/engine_actor_kl": sums[1].item() / n,
        "rollout/engine_actor_k3_kl": sums[3].item() / n,
    }


# rollout/engine_actor_kl (mean engine - actor log-prob of the engine's own samples, an estimate of
# KL(engine || actor)) above which the engine is taken to be broken, by the coarser precision of the
# two. Rounding noise moves each token's difference both ways, so the mean stays far below the mean
# absolute difference; an engine on stale or wrong weights, or a tensor-parallel group whose ranks
# sampled apart, samples tokens the actor finds unlikely. The limits sit far above the noise and below
# the reproduced breakage (the measurements: BENCHMARKS.md, "Tensor-parallel generation (TP=2)").
# Never the max (one rare token moves it); `LOGPROB_CHECK_PATIENCE` steps in a row. The check reads
# the larger of k1 and k3 (rollout/engine_actor_k3_kl, ~|diff|^2/2 for noise: far below k1's limits).
ENGINE_ACTOR_KL_LIMIT = {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.05}
LOGPROB_CHECK_PATIENCE = 2


class LogprobCheck:
    """The stop rule on the standing check: warn loudly on the first step whose mean log-prob
    difference exceeds the limit for the run's precision, stop the run (``RuntimeError``) when
    ``patience`` steps in a row do. Every rank sees the same (all-reduced) metric and stops alike."""

    def __init__(self, engine_dtype: str, actor_dtype: str, patience: int = LOGPROB_CHECK_PATIENCE):
        coarse = (
            "float32"
            if engine_dtype == actor_dtype == "float32"
            else (actor_dtype if engine_dtype == "float32" else engine_dtype)
        )
        self.limit = ENGINE_ACTOR_KL_LIMIT[coarse]
        self.precision = coarse
        self.patience = patience
        self.strikes = 0

    def __call__(self, metrics: dict[str, float], step: int) -> Optional[str]:
        """None when healthy, else a warning; raises when the engine is judged broken."""
        kl = metrics["rollout/engine_actor_kl"]
        if not math.isfinite(kl):  # non-finite log-probs: a diverged actor, the stability guard's case
            return None
        # the larger of the two estimates: k1 can come out negative for a broken engine, k3 cannot
        k3 = metrics.get("rollout/engine_actor_k3_kl", -math.inf)
        key, value = ("rollout/engine_actor_kl", kl) if kl >= k3 else ("rollout/engine_actor_k3_kl", k3)
        if value <= self.limit:
            self.strikes = 0
            return None
        self.strikes += 1
        message = (
            f"step {step}: {key} = {value:.3g} (|diff| mean "
            f"{metrics['rollout/logprob_diff_mean']:.3g}, max {metrics['rollout/logprob_diff_max']:.3g}) "
            f"exceeds {self.limit:g}, the limit for a "
            f"{self.precision} run ({self.strikes}/{self.patience} steps in a row): the rollout engine "
            f"samples from a different distribution than the actor scores. Likely causes: the weight "
            f"sync (name mapping, dtype), ranks of a tensor-parallel group sampling apart, "
            f"actor_rollout_ref.rollout.temperature not applied to the engine's log-probs"
        )
        if self.strikes >= self.patience:
            raise RuntimeError(f"stopping: {message}")
        return message


def check_weight(name: str, tensor: torch.Tensor, spec: dict[str, tuple[int, ...]]) -> None:
    """Loud failure for a name the engine does not know or a shape it does not expect."""
    if name not in spec:
        import difflib

        close = difflib.get_close_matches(name, list(spec), n=1)
        hint = f" (closest engine parameter: '{close[0]}')" if close else ""
        raise ValueError(f"weight sync: the engine has no parameter '{name}'{hint}; check the name mapping")
    if tuple(tensor.shape) != tuple(spec[name]):
        raise ValueError(
            f"weight sync: parameter '{name}' has shape {tuple(tensor.shape)} but the engine "
            f"expects {tuple(spec[name])}"
        )


def covered(
    named_tensors: Iterable[tuple[str, torch.Tensor]], spec: dict[str, tuple[int, ...]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's side of every sync's completeness check: ``named_tensors`` passed through, each
    name checked against ``spec`` (unknown, wrong shape, twice) as it arrives; once they are all
    through, a name of ``spec`` that never came fails, named. Raising mid-sync stops the run: an
    engine left with some stale weights samples from a model nobody trains."""
    seen: set[str] = set()
    for name, tensor in named_tensors:
        check_weight(name, tensor, spec)
        if name in seen:
            raise ValueError(f"weight sync: parameter '{name}' arrived twice in one sync")
        seen.add(name)
        yield name, tensor
    missing = [n for n in spec if n not in seen]
    if missing:
        raise ValueError(
            f"weight sync: {len(missing)} engine parameter(s) received nothing: "
            f"{', '.join(repr(n) for n in missing[:4])}{', ...' if len(missing) > 4 else ''} "
            f"(they would keep their previous values)"
        )

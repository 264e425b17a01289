"""The shard group of the models whose ``fsdp_size`` the recipe leaves at null, chosen by the plans:
every group size the world allows is planned, and the fastest step (``rlhf_hpc.planning.time_plan``)
whose memory plan (``rlhf_hpc.planning.memory_plan``) fits wins.

- "Fits": no error or warning from the memory plan, and every phase within a rank's memory with the
  estimate's margin (its estimated bytes over ``FIT_SHARE``; a GPU engine's reservation as it is).
- Candidates: 1 (replicated: no all-gathers, one gradient all-reduce per micro-batch), the divisors
  of a node's ranks, and whole nodes up to the world.
- Within ``TIE_SHARE`` of the fastest, the smallest shard group wins: fewer collectives, whose cost
  the plan knows least (gloo's, a GPU's overlap).
- Nothing fits: the smallest peak, and the memory plan says what to shrink.
- No time plan (a CPU calibration file that cannot be read): the smallest group that fits.

Every rank and the launching machine plan alike (the same config, model config and hardware figures;
the ranks check that they agree, rlhf_hpc.ppo.training_models).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.config.tree import get_key
from rlhf_hpc.planning.layout import use_size_search
from rlhf_hpc.planning.memory_plan import MemoryPlan, check_plan
from rlhf_hpc.planning.sizing import GiB
from rlhf_hpc.planning.time_plan import build_time_plan

__all__ = [
    "FIT_SHARE",
    "TIE_SHARE",
    "Candidate",
    "candidate_sizes",
    "margined_peak",
    "plan_candidates",
    "search_fsdp_size",
]

# the share of a rank's memory the plan's estimated bytes may take in a chosen layout: on the CPU
# measured peaks ran 0.80-1.32x the plan's (BENCHMARKS.md: "Memory plan vs a whole run", "The
# layout chooser"); not yet measured on a GPU
FIT_SHARE = 0.85
TIE_SHARE = 0.03  # steps this close to the fastest count as equal: the smaller shard group wins


@dataclass
class Candidate:
    fsdp_size: int
    peak_gib: float
    capacity_gib: float
    step_s: Optional[float]  # None: no time plan
    problem: str  # why it does not fit ("" when it does)


def candidate_sizes(world: int, per_node: int) -> list[int]:
    """1, the divisors of a node's ranks, and whole nodes: each dividing the world."""
    return [
        s
        for s in range(1, world + 1)
        if world % s == 0 and ((s <= per_node and per_node % s == 0) or s % per_node == 0)
    ]


def margined_peak(plan: MemoryPlan) -> float:
    """GiB of the largest phase with the estimate's margin: what the plan estimates over
    ``FIT_SHARE``; a GPU engine's own reservation (``gpu_memory_utilization`` of the GPU, which it
    sizes itself to) as it is."""

    def need(phase) -> float:
        exact = sum(v for k, v in phase.parts.items() if k.startswith("vLLM (")) if plan.device == "cuda" else 0.0
        return exact + (phase.total - exact) / FIT_SHARE

    return max(need(p) for p in plan.phases) / GiB


def _with_size(cfg: Config, keys: list[str], size: int) -> Config:
    out = copy.deepcopy(cfg)
    for key in keys:
        get_key(out, key).fsdp_size = size
    return out


def plan_candidates(cfg: Config, keys: list[str]) -> tuple[list[Candidate], str]:
    """Each candidate size set on the fsdp sections ``keys``, with its memory and time plans; and why
    no time plan could be made ("" when it could)."""
    out, no_time = [], ""
    for size in candidate_sizes(cfg.world_size, cfg.trainer.n_gpus_per_node):
        c = _with_size(cfg, keys, size)
        plan, errors, warnings = check_plan(c)
        if plan is None:
            raise FileNotFoundError("; ".join(warnings))
        peak, capacity, margined = plan.peak / GiB, plan.capacity / GiB, margined_peak(plan)
        if peak > capacity:
            problem = f"peak {peak:.1f} GiB, over {capacity:.0f}"
        elif errors or warnings:  # (the KV cache, the host memory: the plan's own words, to the first clause)
            problem = (errors or warnings)[0].removeprefix("memory plan: ").split(";")[0]
        elif margined > capacity:
            problem = f"peak {peak:.1f} GiB, {margined:.1f} with the margin, over {capacity:.0f}"
        else:
            problem = ""
        step = None
        if not no_time:
            try:
                step = build_time_plan(c, memory=plan).step_s
            except (ConfigError, ValueError) as e:
                no_time = str(e)
        out.append(Candidate(size, peak, capacity, step, problem))
    return out, no_time


def search_fsdp_size(cfg: Config, keys: list[str]) -> tuple[int, str]:
    """(the shard group size, why in words) for the sections ``keys``. Raises FileNotFoundError
    where a model's shape is unknown."""
    candidates, no_time = plan_candidates(cfg, keys)
    fitting = [c for c in candidates if not c.problem]

    def text(c: Candidate) -> str:
        if c.problem:
            return f"fsdp_size={c.fsdp_size} does not fit ({c.problem})"
        return f"fsdp_size={c.fsdp_size}: " + (f"{c.step_s:.3g} s" if c.step_s is not None else "fits")

    if not fitting:
        best = min(candidates, key=lambda c: c.peak_gib)
        return best.fsdp_size, (
            f"no layout fits the memory plan; the smallest peak ({best.peak_gib:.1f} GiB per "
            f"rank) is fsdp_size={best.fsdp_size}"
        )
    if no_time:
        best = fitting[0]
        why = f"the smallest shard group that fits the memory plan (no time plan: {no_time})"
    else:
        fastest = min(c.step_s for c in fitting)
        best = next(c for c in fitting if c.step_s <= fastest * (1 + TIE_SHARE))
        why = "the fastest layout the time plan finds that fits the memory plan" + (
            f", within {TIE_SHARE:.0%} of the fastest with fewer collectives" if best.step_s > fastest else ""
        )
    others = "; ".join(text(c) for c in candidates if c is not best)
    where = (
        "replicated on every rank (fsdp_size=1)"
        if best.fsdp_size == 1
        else f"sharded over {best.fsdp_size} ranks (fsdp_size={best.fsdp_size})"
    )
    step = f"step {best.step_s:.3g} s, " if best.step_s is not None else ""
    return best.fsdp_size, (
        f"{where}: {why} ({step}peak {best.peak_gib:.1f} of {best.capacity_gib:.0f} GiB per rank"
        + (f"; {others}" if others else "")
        + ")"
    )


use_size_search(search_fsdp_size)  # (rlhf_hpc.planning's __init__ imports this module)

"""Where the time of a step goes: the share spent in collectives (every step, cheaply) and
``torch.profiler`` traces of chosen steps (``global_profiler.steps``).

The communication share comes from ``rlhf_hpc.distributed.comm`` (every collective is measured there).

``perf/comm_fraction`` = time in collectives / ``timing_s/step`` (rank 0's), split by phase into
``perf/comm_fraction_{weight_sync,train,rollout,other}``. When it stays above 20% for 3 steps
(the reference design's signal to change the parallel layout) the console says which keys reduce it.

Traces: on ``global_profiler.steps`` (and ``global_profiler.ranks``, default all), the step runs
under ``torch.profiler`` and lands in ``<run dir>/profile/step<N>/rank<R>.pt.trace.json`` (Chrome
trace format: https://ui.perfetto.dev, or TensorBoard's profiler plugin with ``--logdir
<run dir>/profile``), with ``rank<R>.comm.json`` beside it: the meter's figures for that step, to
check against the trace. The loop's phases are ``record_function`` ranges in the trace and NVTX
ranges on CUDA (``rlhf_hpc.observability.perf.Timer``), so an Nsight Systems run (``launcher.nsys=true``) shows
them too.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from rlhf_hpc.distributed.comm import GROUPS, CommMeter, metering
from rlhf_hpc.planning.layout import resolved_fsdp_configs

__all__ = ["CommHint", "HINT_STEPS", "StepProfiler"]

# the reference design's rule: communication above this share of the step, for this many steps in
# a row, means the parallel layout should change
HINT_FRACTION = 0.2
HINT_STEPS = 3


# ------------------------------------------------------------------------------ the step
class StepProfiler:
    """Per step: the communication meter, a trace on the chosen steps, the console hint.

    In the loop::

        with profiler.step(step, timer), timer("step"):
            ...
        metrics.update(profiler.metrics(timer.times, tracker.log_line))
    """

    def __init__(self, cfg, rank: int, device: torch.device, run_dir: str | Path):
        gp = cfg.global_profiler
        self.rank, self.device = rank, device
        self.steps = set(gp.steps or [])
        self.traced_here = gp.ranks is None or rank in gp.ranks
        self.dir = Path(gp.save_path).expanduser() if gp.save_path else Path(run_dir) / "profile"
        self.meter: Optional[CommMeter] = None
        self.hint = CommHint(cfg)

    def trace_path(self, step: int) -> Path:
        return self.dir / f"step{step}" / f"rank{self.rank}.pt.trace.json"

    @contextlib.contextmanager
    def step(self, step: int, timer) -> Iterator[None]:
        meter = CommMeter(lambda: timer.current, cuda=self.device.type == "cuda")
        prof = None
        if step in self.steps and self.traced_here:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=activities)
            prof.start()
        self.meter = meter
        try:
            with metering(meter):
                yield
        finally:
            meter.finish()
            if prof is not None:
                prof.stop()
                path = self.trace_path(step)
                path.parent.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(path))
                summary = {
                    "step": step,
                    "rank": self.rank,
                    "comm_s": meter.total,
                    "calls": meter.calls,
                    "by_phase_s": meter.seconds,
                    "step_s": timer.times.get("timing_s/step"),
                }
                path.with_name(f"rank{self.rank}.comm.json").write_text(json.dumps(summary, indent=1))

    def metrics(self, times: dict[str, float], log: Callable[[str], None] = print) -> dict[str, float]:
        """``perf/comm_fraction`` and its split for the step just run; says the hint when due."""
        step_s = max(times.get("timing_s/step", 0.0), 1e-9)
        meter = self.meter
        out = {"timing_s/comm": meter.total, "perf/comm_fraction": meter.total / step_s}
        for group in GROUPS:
            out[f"perf/comm_fraction_{group}"] = meter.seconds[group] / step_s
        message = self.hint.update(out)
        if message:
            log(message)
        return out


class CommHint:
    """The reference design's rule: communication above 20% of the step for several steps in a
    row -> name the keys that reduce it. Said once per run, and only with keys the recipe left
    open (``Config.recipe_keys``): a recipe's own choice is not second-guessed every run."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.streak = 0
        self.said = False

    def update(self, m: dict[str, float]) -> Optional[str]:
        self.streak = self.streak + 1 if m["perf/comm_fraction"] > HINT_FRACTION else 0
        if self.streak != HINT_STEPS or self.said:
            return None
        split = {g: m[f"perf/comm_fraction_{g}"] for g in GROUPS}
        top = max(split, key=split.get)
        advice = self.keys_for(top)
        if not advice:
            return None
        self.said = True
        shares = ", ".join(f"{g} {v:.0%}" for g, v in split.items())
        return (
            f"[rlhf-hpc] communication took {m['perf/comm_fraction']:.0%} of the step for {HINT_STEPS} steps "
            f"({shares}); most in {top}: {advice}"
        )

    def keys_for(self, group: str) -> str:
        """The advice for ``group``: one ``key (why)`` per suggestion the recipe did not set, "; "-joined
        ("" when none is left)."""
        return "; ".join(text for key, text in self.suggestions(group) if key not in self.cfg.recipe_keys)

    def suggestions(self, group: str) -> list[tuple[str, str]]:
        tr, arr = self.cfg.trainer, self.cfg.actor_rollout_ref
        actor = "actor_rollout_ref.actor"
        if group == "weight_sync":
            return [
                (
                    "actor_rollout_ref.rollout.update_weights_bucket_mb",
                    f"raise actor_rollout_ref.rollout.update_weights_bucket_mb (now "
                    f"{arr.rollout.update_weights_bucket_mb}; fewer, larger all-gathers overlapping the engine's copy)",
                )
            ]
        if group == "train":
            fsdp, out = resolved_fsdp_configs(self.cfg)["actor"], []
            if fsdp.fsdp_size == 1:  # replicated: the only collective is one gradient all-reduce per mini-batch
                out.append(
                    (
                        f"{actor}.ppo_mini_batch_size",
                        f"fewer, larger mini-batches ({actor}.ppo_mini_batch_size, now "
                        f"{arr.actor.ppo_mini_batch_size}; one gradient all-reduce each)",
                    )
                )
                if tr.device != "cpu":  # (CPU replicas average through shared memory in their own dtype:
                    # a bf16 reduce would move them onto gloo's slower all-reduce, rlhf_hpc.distributed.fsdp)
                    out.append(
                        (
                            f"{actor}.fsdp_config.mixed_precision.reduce_dtype",
                            f"{actor}.fsdp_config.mixed_precision.reduce_dtype=bfloat16 (half the bytes)",
                        )
                    )
                return out
            if (tr.nnodes > 1 and fsdp.fsdp_size in (-1, None)) or (fsdp.fsdp_size or 0) > tr.n_gpus_per_node:
                out.append(
                    (
                        f"{actor}.fsdp_config.fsdp_size",
                        f"shard inside a node with HSDP: {actor}.fsdp_config.fsdp_size="
                        f"{tr.n_gpus_per_node} (now {fsdp.fsdp_size}; likewise critic.model.fsdp_config.fsdp_size)",
                    )
                )
            out.append(
                (
                    f"{actor}.ppo_micro_batch_size_per_gpu",
                    f"larger {actor}.ppo_micro_batch_size_per_gpu (now {arr.actor.ppo_micro_batch_size_per_gpu}; "
                    f"every micro-batch gathers the weights again)",
                )
            )
            if not fsdp.forward_prefetch:
                out.append(
                    (
                        f"{actor}.fsdp_config.forward_prefetch",
                        "fsdp_config.forward_prefetch=true (overlap the next layer's all-gather)",
                    )
                )
            if fsdp.reshard_after_forward:
                out.append(
                    (
                        f"{actor}.fsdp_config.reshard_after_forward",
                        "fsdp_config.reshard_after_forward=false (no second all-gather in backward; more memory)",
                    )
                )
            if arr.actor.ulysses_sequence_parallel_size == 1:
                out.append(
                    (
                        f"{actor}.ulysses_sequence_parallel_size",
                        f"{actor}.ulysses_sequence_parallel_size=2 or 4 (each rank holds a slice of every row: "
                        f"raise the token budgets / micro-batch sizes for fewer micro-batches)",
                    )
                )
            return out
        if group == "rollout":
            return [
                (
                    "actor_rollout_ref.rollout.tensor_model_parallel_size",
                    f"lower actor_rollout_ref.rollout.tensor_model_parallel_size (now "
                    f"{arr.rollout.tensor_model_parallel_size}) if the model fits",
                )
            ]
        if tr.device == "cpu":  # CPU ranks share the cores: waiting at the all-reduces is contention, not imbalance
            return []
        return [
            (
                "trainer.balance_batch",
                "this is mostly waiting at the metric all-reduces for the slowest rank: "
                "even out the work per rank (trainer.balance_batch=true, actor_rollout_ref.actor.use_dynamic_bsz=true)",
            )
        ]

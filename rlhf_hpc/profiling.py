"""Where the time of a step goes: the share spent in collectives (every step, cheaply) and
``torch.profiler`` traces of chosen steps (``global_profiler.steps``).

Communication share. Every collective the project issues runs inside ``collective()``: the
all-reduces of ``rlhf_hpc.dist``, the weight-sync all-gathers of ``rlhf_hpc.reshard``, the gradient
norm's all-reduce, the rollout's tensor-parallel prompt exchange, and FSDP2's own all-gathers and
reduce-scatters (``time_fsdp_collectives`` installs FSDP2's custom-comm hooks, which call the same
``all_gather_single``/``reduce_scatter_single`` as FSDP2's defaults). While a step runs, a
``CommMeter`` adds up the time spent inside them, per loop phase:

- CPU (gloo): wall time of the call. gloo collectives block the caller until done (the
  asynchronous weight-sync all-gathers are counted where the rank waits for them), so this is the
  time the rank's thread spends communicating, including waiting for slower ranks.
- CUDA (NCCL): CUDA events around the call on the current stream (FSDP2 issues on its
  all-gather/reduce-scatter streams), read once at the end of the step. Overlapped collectives are
  counted too: on CUDA the figure is time in collectives, not only exposed communication.
  Collectives on host memory (the rollout's prompt exchange on a gloo group) use the wall clock.
  Untested on a GPU so far.

HSDP's replicate all-reduce inside FSDP2 has no hook around it; FSDP2's all-reduce hook runs right
after it, so it is timed from the reduce-scatter's return to that hook (with a shard group of one
rank there is no reduce-scatter, and it goes unmeasured). A replicated model on the host is not
given to FSDP2 and averages its gradients with ``rlhf_hpc.parallel.ReplicaGradients`` (through
shared memory, or asynchronous gloo all-reduces during the backward), counted where the rank
waits for them. Not seen by the meter: vLLM's internal
tensor-parallel collectives during generation.

``perf/comm_fraction`` = time in collectives / ``timing_s/step`` (rank 0's), split by phase into
``perf/comm_fraction_{weight_sync,train,rollout,other}``. When it stays above 20% for 3 steps
(the reference design's signal to change the parallel layout) the console says which keys reduce it.

Traces: on ``global_profiler.steps`` (and ``global_profiler.ranks``, default all), the step runs
under ``torch.profiler`` and lands in ``<run dir>/profile/step<N>/rank<R>.pt.trace.json`` (Chrome
trace format: https://ui.perfetto.dev, or TensorBoard's profiler plugin with ``--logdir
<run dir>/profile``), with ``rank<R>.comm.json`` beside it: the meter's figures for that step, to
check against the trace. The loop's phases are ``record_function`` ranges in the trace and NVTX
ranges on CUDA (``rlhf_hpc.perf.Timer``), so an Nsight Systems run (``launcher.nsys=true``) shows
them too.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

# loop phases (rlhf_hpc.perf.Timer names) -> the group their communication is reported under
PHASE_GROUPS = {"update_weights": "weight_sync", "gen": "rollout", "old_log_prob": "train", "ref": "train",
                "values": "train", "update_critic": "train", "update_actor": "train"}
GROUPS = ("weight_sync", "train", "rollout", "other")
# the reference design's rule: communication above this share of the step, for this many steps in
# a row, means the parallel layout should change
HINT_FRACTION = 0.2
HINT_STEPS = 3


def phase_group(phase: str) -> str:
    return PHASE_GROUPS.get(phase, "other")


class CommMeter:
    """Seconds spent inside collectives during one step, by phase group, and the number of
    collective operations issued (the profiler records one ``c10d``/``_c10d_functional`` op each)."""

    def __init__(self, phase: Callable[[], str], cuda: bool = False):
        self._phase, self._cuda = phase, cuda
        self.seconds = dict.fromkeys(GROUPS, 0.0)
        self.calls = 0
        self._events: list = []  # (group, start, end) CUDA events, read in finish()
        self._depth = 0

    @contextlib.contextmanager
    def measure(self, calls: int, host: bool = False) -> Iterator[None]:
        self.calls += calls
        if self._depth:  # inside a measured region already: the time is counted there
            yield
            return
        group = phase_group(self._phase())
        self._depth += 1
        if self._cuda and not host:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._depth -= 1
                self._events.append((group, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._depth -= 1
                self.seconds[group] += time.perf_counter() - t0

    def mark(self):
        """A point in time to measure a collective from (``add_since``): a recorded CUDA event on the
        current stream, or the wall clock."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add_since(self, mark, calls: int = 1) -> None:
        """Count the collective that ran between ``mark`` and now (where no hook surrounds it)."""
        self.calls += calls
        group = phase_group(self._phase())
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((group, mark, end))
        else:
            self.seconds[group] += time.perf_counter() - mark

    def finish(self) -> dict[str, float]:
        """Seconds by group (on CUDA this waits for the recorded events)."""
        for group, start, end in self._events:
            end.synchronize()
            self.seconds[group] += start.elapsed_time(end) / 1e3
        self._events.clear()
        return self.seconds

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


_active: Optional[CommMeter] = None  # the meter of the step now running on this process


@contextlib.contextmanager
def collective(calls: int = 1, host: bool = False) -> Iterator[None]:
    """Around a collective (``calls``: the collective ops it issues; 0 for a wait): its time goes
    to the running step's ``CommMeter``. ``host``: a collective on host memory (a gloo group), timed
    by wall clock also on CUDA. Costs nothing measurable outside a step."""
    meter = _active
    if meter is None:
        yield
        return
    with meter.measure(calls, host):
        yield


def _mark():
    return _active.mark() if _active is not None else None


# ------------------------------------------------------------------------------ FSDP2 hooks
try:  # FSDP2's custom-comm interface (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - older torch: FSDP2's collectives go unmeasured
    AllGather = ReduceScatter = None

if AllGather is not None:
    class TimedAllGather(AllGather):
        """FSDP2's default all-gather (same call, same buffers), measured."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            with collective():
                return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)

    class TimedReduceScatter(ReduceScatter):
        """FSDP2's default reduce-scatter, measured."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __init__(self):
            self.done = None  # when the last reduce-scatter returned (for HSDP's all-reduce after it)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            with collective():
                work = dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op,
                                                  async_op=async_op)
            self.done = _mark()
            return work

    class HSDPAllReduceTimer:
        """FSDP2's all-reduce hook, which HSDP runs right after its replicate all-reduce (no hook
        surrounds that all-reduce): the time since the group's reduce-scatter returned is that
        all-reduce. Leaves the gradients as they are."""

        def __init__(self, reduce_scatter: TimedReduceScatter):
            self.reduce_scatter = reduce_scatter

        def __call__(self, reduce_output: torch.Tensor) -> None:
            mark, self.reduce_scatter.done = self.reduce_scatter.done, None
            if mark is not None and _active is not None:
                _active.add_since(mark)


def time_fsdp_collectives(model: torch.nn.Module, hsdp: bool = False) -> None:
    """Route every FSDP2 group of ``model`` through the measured all-gather/reduce-scatter; with
    ``hsdp`` (a 2-D mesh) also time the replicate all-reduce that follows each reduce-scatter."""
    if AllGather is None:
        return
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            reduce_scatter = TimedReduceScatter()
            module.set_custom_all_gather(TimedAllGather())
            module.set_custom_reduce_scatter(reduce_scatter)
            if hsdp:
                module.set_all_reduce_hook(HSDPAllReduceTimer(reduce_scatter))


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
        global _active
        meter = CommMeter(lambda: timer.current, cuda=self.device.type == "cuda")
        prof = None
        if step in self.steps and self.traced_here:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            prof = torch.profiler.profile(activities=activities)
            prof.start()
        _active, self.meter = meter, meter
        try:
            yield
        finally:
            _active = None
            meter.finish()
            if prof is not None:
                prof.stop()
                path = self.trace_path(step)
                path.parent.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(path))
                summary = {"step": step, "rank": self.rank, "comm_s": meter.total, "calls": meter.calls,
                           "by_phase_s": meter.seconds, "step_s": timer.times.get("timing_s/step")}
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
        return (f"[rlhf-hpc] communication took {m['perf/comm_fraction']:.0%} of the step for {HINT_STEPS} steps "
                f"({shares}); most in {top}: {advice}")

    def keys_for(self, group: str) -> str:
        """The advice for ``group``: one ``key (why)`` per suggestion the recipe did not set, "; "-joined
        ("" when none is left)."""
        return "; ".join(text for key, text in self.suggestions(group) if key not in self.cfg.recipe_keys)

    def suggestions(self, group: str) -> list[tuple[str, str]]:
        tr, arr = self.cfg.trainer, self.cfg.actor_rollout_ref
        actor = "actor_rollout_ref.actor"
        if group == "weight_sync":
            return [("actor_rollout_ref.rollout.update_weights_bucket_mb",
                     f"raise actor_rollout_ref.rollout.update_weights_bucket_mb (now "
                     f"{arr.rollout.update_weights_bucket_mb}; fewer, larger all-gathers overlapping the engine's copy)")]
        if group == "train":
            from rlhf_hpc.layout import resolved_fsdp_configs
            fsdp, out = resolved_fsdp_configs(self.cfg)["actor"], []
            if fsdp.fsdp_size == 1:  # replicated: the only collective is one gradient all-reduce per mini-batch
                out.append((f"{actor}.ppo_mini_batch_size",
                            f"fewer, larger mini-batches ({actor}.ppo_mini_batch_size, now "
                            f"{arr.actor.ppo_mini_batch_size}; one gradient all-reduce each)"))
                if tr.device != "cpu":  # (CPU replicas average through shared memory in their own dtype:
                    # a bf16 reduce would move them onto gloo's slower all-reduce, rlhf_hpc.parallel)
                    out.append((f"{actor}.fsdp_config.mixed_precision.reduce_dtype",
                                f"{actor}.fsdp_config.mixed_precision.reduce_dtype=bfloat16 (half the bytes)"))
                return out
            if (tr.nnodes > 1 and fsdp.fsdp_size in (-1, None)) or (fsdp.fsdp_size or 0) > tr.n_gpus_per_node:
                out.append((f"{actor}.fsdp_config.fsdp_size",
                            f"shard inside a node with HSDP: {actor}.fsdp_config.fsdp_size="
                            f"{tr.n_gpus_per_node} (now {fsdp.fsdp_size}; likewise critic.model.fsdp_config.fsdp_size)"))
            out.append((f"{actor}.ppo_micro_batch_size_per_gpu",
                        f"larger {actor}.ppo_micro_batch_size_per_gpu (now {arr.actor.ppo_micro_batch_size_per_gpu}; "
                        f"every micro-batch gathers the weights again)"))
            if not fsdp.forward_prefetch:
                out.append((f"{actor}.fsdp_config.forward_prefetch",
                            "fsdp_config.forward_prefetch=true (overlap the next layer's all-gather)"))
            if fsdp.reshard_after_forward:
                out.append((f"{actor}.fsdp_config.reshard_after_forward",
                            "fsdp_config.reshard_after_forward=false (no second all-gather in backward; more memory)"))
            if arr.actor.ulysses_sequence_parallel_size == 1:
                out.append((f"{actor}.ulysses_sequence_parallel_size",
                            f"{actor}.ulysses_sequence_parallel_size=2 or 4 (each rank holds a slice of every row: "
                            f"raise the token budgets / micro-batch sizes for fewer micro-batches)"))
            return out
        if group == "rollout":
            return [("actor_rollout_ref.rollout.tensor_model_parallel_size",
                     f"lower actor_rollout_ref.rollout.tensor_model_parallel_size (now "
                     f"{arr.rollout.tensor_model_parallel_size}) if the model fits")]
        if tr.device == "cpu":  # CPU ranks share the cores: waiting at the all-reduces is contention, not imbalance
            return []
        return [("trainer.balance_batch", "this is mostly waiting at the metric all-reduces for the slowest rank: "
                 "even out the work per rank (trainer.balance_batch=true, actor_rollout_ref.actor.use_dynamic_bsz=true)")]

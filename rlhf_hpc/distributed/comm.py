"""How long a step spends in collectives: the bottom layer every module that communicates uses.

Every collective the project issues runs inside ``collective()``: the all-reduces of
``rlhf_hpc.distributed.process_group``, the weight-sync all-gathers of
``rlhf_hpc.rollout.weight_sync``, the gradient norm's all-reduce, the rollout's tensor-parallel
prompt exchange, and FSDP2's own all-gathers and reduce-scatters (``time_fsdp_collectives`` installs
FSDP2's custom-comm hooks, which call the same ``all_gather_single``/``reduce_scatter_single`` as
FSDP2's defaults). While a step runs, a ``CommMeter`` adds up the time spent inside them, per loop
phase:

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
given to FSDP2 and averages its gradients with ``rlhf_hpc.distributed.fsdp.ReplicaGradients`` (through
shared memory, or asynchronous gloo all-reduces during the backward), counted where the rank
waits for them. Not seen by the meter: vLLM's internal
tensor-parallel collectives during generation.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["CommMeter", "GROUPS", "collective", "metering", "time_fsdp_collectives"]

# loop phases (rlhf_hpc.observability.perf.Timer names) -> the group their communication is reported under
PHASE_GROUPS = {
    "update_weights": "weight_sync",
    "gen": "rollout",
    "old_log_prob": "train",
    "ref": "train",
    "values": "train",
    "update_critic": "train",
    "update_actor": "train",
}
GROUPS = ("weight_sync", "train", "rollout", "other")


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
def metering(meter: CommMeter) -> Iterator[None]:
    """Count every ``collective()`` of this process in ``meter`` while the block runs (one step)."""
    global _active
    _active = meter
    try:
        yield
    finally:
        _active = None


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
                work = dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)
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

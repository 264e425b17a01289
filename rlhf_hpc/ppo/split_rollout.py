"""The split layout's two ends of phases 1 and 2 (``actor_rollout_ref.hybrid_engine=false``).

The rollout ranks (``serve_rollouts``) run a loop of their own: receive weights, generate the next
step's batch with them, send its rows with the policy version that generated them, and run ahead
of the trainer as far as ``async_training`` allows. The trainer's ranks (``RemoteRollout``) receive
each step's rows in place of generating them and send weights after an update. The groups between
the sides are in rlhf_hpc/distributed/split_layout.py.

Counting: a batch is a step's ``data.train_batch_size`` prompts. The trainer sends weights
``v`` (the policy after ``v`` updates) at the start (``v`` = the step it resumes at) and after
every ``trigger_parameter_sync_step``-th update. Holding weights ``v``, the rollout ranks may
generate the batches up to ``v + trigger + ahead`` (``ahead = staleness_threshold x trigger``). A
row of batch ``j`` generated with ``v`` is ``j - 1 - v`` updates stale when step ``j`` trains it.

Every message goes in the order both sides compute from these rules, so neither waits on the
other out of turn: the rows go out asynchronously (in flight: at most the batches these weights
may make), and weights are received only between batches (verl's partial rollout, weights
changing inside a generation, is not built). A rollback of the stability guard restarts the
rollout ranks from the checkpoint's step: its weights and sampler go out with a ``restart``, and
the trainer drops the rows in flight until the rollout ranks' marker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_hpc.config.schema import Config
from rlhf_hpc.data.dataset import StatefulSampler, load_examples
from rlhf_hpc.distributed.comm import collective
from rlhf_hpc.distributed.process_group import DistContext, build_rollout_tp_group
from rlhf_hpc.distributed.rows import RolloutRow, prompt_share
from rlhf_hpc.models.hf import torch_dtype
from rlhf_hpc.models.tokenizer import load_tokenizer, tokenizer_path
from rlhf_hpc.ppo.faults import FaultInjector
from rlhf_hpc.ppo.generation import Generator
from rlhf_hpc.ppo.step_batch import rollout_rows, sampling_for, step_seed
from rlhf_hpc.ppo.validation import validation_chunks, validation_sampling
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import hf_name, stream_full_params

__all__ = ["RemoteRollout", "RowsMessage", "ValidationMessage", "serve_rollouts", "validation_responses"]


@dataclass
class RowsMessage:
    """One step's rows, from rollout rank 0 to every trainer rank."""

    step: int
    prompts: list[int]  # the step's dataset indices (the trainer's sampler draws the same)
    version: int  # the policy version (updates) of the weights that generated every row
    rows: list[RolloutRow]
    gen_start: float  # wall clock (time.time) of the generation, on rollout rank 0
    gen_end: float
    idle_s: float  # rollout rank 0's seconds waiting since its previous batch (weights, the trainer)
    metrics: dict = field(default_factory=dict)


RESTARTED = "restarted"  # the rollout ranks' marker after a restart: the rows before it are stale


@dataclass
class ValidationMessage:
    """The validation set's responses with weights ``version``, by position in the set."""

    version: int
    responses: dict[int, list]


def validation_responses(cfg: Config, ctx: DistContext, generator, engine, tokenizer, val: list) -> Optional[dict]:
    """Every validation row's responses, by position in ``val``, on rollout rank 0 (None on the
    others): each rank generates its share of each chunk, as the colocated validation does."""
    local = {}
    for c, start, share in validation_chunks(cfg, val, ctx.world_size, ctx.rank):
        outs = generator([val[start + i] for i in share], validation_sampling(cfg, tokenizer, c, engine.dp_rank))
        local.update({start + i: group for i, group in zip(share, outs)})
    engine.release()
    gathered: Optional[list] = [None] * ctx.world_size if ctx.rank == 0 else None
    with collective(calls=2):
        dist.gather_object(local, gathered, dst=0)
    return {k: v for part in gathered for k, v in part.items()} if ctx.rank == 0 else None


def _manifest(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, tuple, str]]:
    """(name, full shape, dtype) of every tensor a weight sync sends, in the stream's order."""
    return [(hf_name(n), tuple(p.shape), str(dtype).removeprefix("torch.")) for n, p in model.named_parameters()]


# ------------------------------------------------------------------------------ the rollout ranks
def serve_rollouts(cfg: Config, ctx: DistContext) -> None:
    """The rollout ranks' loop, until the trainer says stop (or the last step's batch is sent)."""
    arr, tr = cfg.actor_rollout_ref, cfg.trainer
    tokenizer = load_tokenizer(tokenizer_path(cfg), arr.model.trust_remote_code, arr.model.custom_chat_template)
    train_set = load_examples(cfg.data.train_files, tokenizer, cfg.data, split_seed=cfg.data.seed)
    val_set = (
        load_examples(cfg.data.val_files, tokenizer, cfg.data, split_seed=cfg.data.seed + 1)
        if cfg.data.val_files
        else []
    )
    sampler = StatefulSampler(len(train_set), cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle)
    tp_group = build_rollout_tp_group(arr.rollout.tensor_model_parallel_size, cfg.rollout.n_gpus_per_node)
    engine = make_engine(cfg, arr.model.path, ctx.device, tp_group)
    generator = Generator(cfg, engine, tokenizer, [])
    faults = FaultInjector(tr.inject_fault, ctx.split.global_rank)  # (RANK: torchrun's, as the trainer's)
    trigger, ahead = cfg.async_training.trigger_parameter_sync_step, cfg.async_training.runs_ahead
    step: Optional[int] = None  # the last batch generated
    version = total = 0
    waited_since = time.time()
    try:
        while True:
            # weights: the first; when the next batch is beyond what these may make; after the last batch
            # (the trainer's sends go on until its stop, each received in turn)
            if step is None or step == total or step + 1 > version + trigger + ahead:
                header = ctx.weights.recv_object()
                if header["kind"] == "stop":
                    return
                engine.resume()
                engine.update_weights(ctx.weights.recv_tensors(header["manifest"]))
                version = header["version"]
                if "step" in header:  # the first (where the trainer starts: a resume), or a rollback's restart
                    step, total = header["step"], header["total"]
                    sampler.load_state_dict(header["sampler"])
                    if header["kind"] == "restart" and ctx.rank == 0:  # the rows before this are dropped
                        ctx.rows.send_object(RESTARTED, async_op=True)
                if header["kind"] == "validate":  # the validation set with these weights, then on as before
                    responses = validation_responses(cfg, ctx, generator, engine, tokenizer, val_set)
                    if ctx.rank == 0:
                        ctx.rows.send_object(ValidationMessage(version, responses), async_op=True)
                continue
            step += 1
            prompts = sampler.next_batch()
            mine = prompt_share(len(prompts), ctx.world_size, ctx.rank)
            start = time.time()
            responses = generator(
                [train_set[prompts[p]] for p in mine],
                sampling_for(cfg, tokenizer, seed=step_seed(tr.seed, step, engine.dp_rank)),
            )
            engine.release()
            faults.after_generation(step)
            rows = rollout_rows(train_set, prompts, mine, responses)
            for row in rows:
                row.version = version
            gathered: Optional[list] = [None] * ctx.world_size if ctx.rank == 0 else None
            with collective(calls=2):  # (an object gather: the sizes, then the pickled rows)
                dist.gather_object(rows, gathered, dst=0)
            end = time.time()
            gen_metrics = generator.metrics()  # (collective over the rollout ranks)
            if ctx.rank == 0:
                message = RowsMessage(
                    step,
                    prompts,
                    version,
                    [r for part in gathered for r in part],
                    start,
                    end,
                    start - waited_since,
                    gen_metrics,
                )
                ctx.rows.send_object(message, async_op=True)
            waited_since = end
    finally:
        engine.close()


# ------------------------------------------------------------------------------ the trainer's ranks
class RemoteRollout:
    """The trainer's phases 1 and 2 in the split layout: weights out, rows in."""

    def __init__(self, cfg: Config, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        self.trigger = cfg.async_training.trigger_parameter_sync_step
        self.dtype = torch_dtype(cfg.actor_rollout_ref.rollout.dtype)
        self.bucket_mb = cfg.actor_rollout_ref.rollout.update_weights_bucket_mb
        self.stopped = False
        self.inbox: list = []  # messages received before they were wanted (rows sent ahead of a validation)

    def take(self, wanted: type):
        """The next message of type ``wanted``; those of other types received on the way wait in the inbox."""
        for i, message in enumerate(self.inbox):
            if isinstance(message, wanted):
                return self.inbox.pop(i)
        while True:
            message = self.ctx.rows.recv_object()
            if isinstance(message, wanted):
                return message
            self.inbox.append(message)

    def validate(self, model: torch.nn.Module, version: int) -> dict[int, list]:
        """The validation set's responses, generated by the rollout ranks with these weights
        (collective over the trainer's ranks; each gets them all)."""
        self.send_weights(model, version, kind="validate")
        return self.take(ValidationMessage).responses

    def send_weights(
        self, model: torch.nn.Module, version: int, start: Optional[dict] = None, kind: str = "weights"
    ) -> dict[str, float]:
        """Weights ``version`` from the trainer's shards to every rollout rank (collective over the
        trainer's ranks: they gather each full tensor, rank 0 sends it). ``start``: the first
        send's (or a ``restart``'s) step, last step and sampler state."""
        t0 = time.perf_counter()
        stream = stream_full_params(model, self.dtype, self.bucket_mb)
        sent = 0
        if self.ctx.weights is not None:
            header = {"kind": kind, "version": version, "manifest": _manifest(model, self.dtype), **(start or {})}
            self.ctx.weights.send_object(header)
            sent = self.ctx.weights.send_tensors(stream)
        else:
            for _ in stream:  # (every trainer rank joins each tensor's gather)
                pass
        return {"timing_s/update_weights": time.perf_counter() - t0, "rollout/weight_sync_mib": sent / 2**20}

    def after_update(self, model: torch.nn.Module, step: int, total: int) -> dict[str, float]:
        """After step ``step``'s update: weights out when a sync is due (and a later step needs them)."""
        if step % self.trigger or step >= total:
            return {}
        return self.send_weights(model, step)

    def restart(self, model: torch.nn.Module, start: dict) -> None:
        """After a rollback to step ``start["step"]``: the rollout ranks start again from its weights
        and sampler; the rows they sent before (for steps past the rollback) are dropped."""
        self.send_weights(model, start["step"], start, kind="restart")
        self.take(str)  # (the marker: everything before it was generated for steps past the rollback)
        self.inbox.clear()

    def stop(self) -> None:
        """The rollout ranks stop (the run's end, a preemption): rows in flight are dropped."""
        if not self.stopped and self.ctx.weights is not None:
            self.ctx.weights.send_object({"kind": "stop"})
        self.stopped = True

    def receive(self, step: int, prompts: list[int]) -> tuple[RowsMessage, dict[str, float]]:
        """Step ``step``'s rows (every rank gets all of them) and the split layout's metrics."""
        t0 = time.time()
        message: RowsMessage = self.take(RowsMessage)
        t1 = time.time()
        waited = t1 - t0
        if message.step != step or message.prompts != prompts:
            raise RuntimeError(
                f"the rollout ranks sent step {message.step}'s rows where the trainer is at step {step} "
                f"(or other prompts than its sampler's): the two sides lost their order"
            )
        staleness = [step - 1 - r.version for r in message.rows]  # (the trainer's policy: step - 1 updates)
        # the generation's seconds the trainer did not wait for: they ran while it trained or logged
        gen = message.gen_end - message.gen_start
        overlapped = gen - max(0.0, min(message.gen_end, t1) - max(message.gen_start, t0))
        metrics = {
            "rollout/staleness/mean": sum(staleness) / max(len(staleness), 1),
            "rollout/staleness/max": float(max(staleness, default=0)),
            "rollout/policy_version": float(message.version),
            "timing_s/gen": gen,
            "timing_s/gen_overlapped": overlapped,
            "timing_s/wait_rows": waited,  # (the trainer's idle share: over timing_s/step, in the trainer)
            "async/rollout_idle_share": message.idle_s / (message.idle_s + gen) if message.idle_s + gen > 0 else 0.0,
            **message.metrics,
        }
        return message, metrics

"""The time plan: predicted seconds per phase of one step, what bounds each, the step's tokens/s
per GPU and its communication share, from the config, the model's shape and the hardware
(rlhf_hpc.planning.hardware) alone. Printed at ``--dry-run`` under the memory plan, compared over
layouts by ``launch.py plan``, and logged by every run beside what it measured (``plan/<phase>_s``
next to ``timing_s/<phase>``, each step planned with its own measured lengths).

One rank = one GPU; all ranks do the same work, so a phase takes what one rank's share takes:

- ``update_weights``: the actor's weights in the rollout dtype, all-gathered over the shard group
  (bytes x (s-1)/s over its link) overlapped with the engine's load (bytes over ``engine_load_gb_s``,
  plus a per-layer overhead); a LoRA actor sends its adapter only, after its engine's wake has
  copied the base weights back from the host (``host_memory.engine_sleep_copy``, over the host link).
- ``gen``: per engine (``tensor_model_parallel_size`` GPUs): prefill is compute-bound (2 x params
  FLOPs per prompt token over ``PREFILL_EFFICIENCY`` of the TP group's peak); decode follows the
  schedule of rlhf_hpc.planning.decode_schedule (the lengths spread around their mean up to the
  longest, the batch what the engine holds: ``max_num_seqs``, the KV cache room of the memory plan,
  the rows it has, thinning as responses finish); each step reads the weights and its sequences' KV
  cache (over ``DECODE_BANDWIDTH_EFFICIENCY`` of HBM), or is compute-bound at large batch, plus the
  sampler's passes over the logits, the TP all-reduces (2 per layer) and the engine's step overhead.
  The hf engine runs each decode step as a full forward pass. A LoRA actor's engine then sleeps,
  its weights copied to the host.
- ``old_log_prob`` / ``ref`` / ``values`` / ``reward_model``: forward FLOPs of the real shape (2 x
  layer params per token, causal attention 2 x layers x q_dim x L per token, the head on response
  tokens) over ``train_efficiency`` of the peak (on a CPU the calibrated figure is already what a
  whole decoder pass reaches), a per-layer and per-pass overhead per micro-batch; FSDP's
  all-gathers (params x (s-1)/s per micro-batch, once with ``reshard_after_forward=false``) over the
  shard group's link, beside the compute on a GPU (``overlap_comm``), after it on gloo; offloaded
  parameters over the host link.
- ``update_critic`` / ``update_actor``: the forward and its backward (``backward_ratio`` x the
  forward: 2 on a GPU, measured on the CPU), a second forward with activation checkpointing, per epoch;
  per micro-batch the all-gathers (twice when parameters are freed after the forward) and the
  gradients' reduce-scatter, and across replicas (HSDP, or a replicated model) their all-reduce over
  the network when the replicas are on different nodes; the optimizer step per mini-batch (memory-bound
  on the GPU; on the host at ``host_adam_params_s`` with ``param_offload``), the Adam moments over the
  host link with ``optimizer_offload``.
- ``save_checkpoint``: each node's ranks' shards over ``disk_gb_s`` (every ``trainer.save_freq`` steps;
  not part of the step).

What the model cannot know: the engine's real efficiency at a given batch (prefix caching,
speculative decoding, preemption when the KV cache fills), stragglers (one slow rank holds every
collective), how the response lengths really spread, Python overhead beyond the per-pass
constants, a shared file system's load. BENCHMARKS.md holds its error against measured runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

from rlhf_hpc.config.engines import planned_engine
from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config, FSDPConfig
from rlhf_hpc.models.lora import lora_enabled
from rlhf_hpc.ops.step_shape import PhaseShape, step_shape
from rlhf_hpc.planning.advice import COMM_RULE, candidate_changes, value_text, with_value
from rlhf_hpc.planning.decode_schedule import decode_segments, response_lengths
from rlhf_hpc.planning.hardware import Hardware, hardware_of
from rlhf_hpc.planning.host_memory import engine_sleep_copy
from rlhf_hpc.planning.layout import choose_checkpointing, resolved_fsdp_configs, shard_count
from rlhf_hpc.planning.memory_plan import MemoryPlan, build_plan, check_plan, cpu_kv_cache_bytes, kv_bytes_per_token
from rlhf_hpc.planning.sizing import DTYPE_BYTES, ModelShape, adapter_params, forward_flops, model_shape

__all__ = [
    "PhaseTime",
    "TimeModel",
    "TimePlan",
    "Workload",
    "advice_for",
    "build_time_plan",
    "generation_batches",
    "workload_of",
]

# Shares of the datasheet peaks that real kernels reach on a GPU (on the CPU the calibration's
# figures are already what real passes reach: 1.0). Unmeasured by this project on GPUs: set from
# the per-phase times of NeMo-RL v0.3's published H100 GRPO runs (8B on 8 GPUs, 70B and Qwen3-32B
# on 64; benchmarks.published_runs), which imply 0.30-0.45 of the bf16 peak for their training
# and log-prob passes (``Hardware.train_efficiency``, 0.4; prefill alike) and ~0.55 of HBM bandwidth
# for vLLM's decode (weights and KV cache read each step; the sampler beside it). NCCL's bus
# bandwidth reaches ~80% of the link's (nccl-tests on DGX H100).
PREFILL_EFFICIENCY = 0.4
DECODE_BANDWIDTH_EFFICIENCY = 0.55
LINK_EFFICIENCY = 0.8
# the optimizer step reads parameters, gradients, two moments and writes three: bytes per parameter
ADAM_BYTES = 28
# bytes the sampler moves per logit and decode step: fp32 logits written, read by the softmax, the
# draw and the log-prob of the drawn token (about 6 passes of 4 bytes); with a 150k vocabulary at
# batch 256 that is ~1 GB a step
SAMPLER_BYTES_PER_LOGIT = 24


@dataclass(frozen=True)
class Turn:
    """One assistant turn of a step's conversations: the share of rows still open, their context
    before it (tokens), the tool tokens prefilled first, the model's tokens in it (mean, longest)."""

    index: int
    rows: float
    context: float
    new_tokens: float
    mean: float
    longest: int


@dataclass
class Workload:
    """What one step processes: ``rows`` responses (train_batch_size x n) of ``prompt`` + ``response``
    tokens on average; the longest response bounds the decode's last wave; ``padded`` is a row's
    length where padding is not removed. Multi-turn: ``turns`` assistant turns per conversation
    (mean), ``tool_tokens`` of the response are the tools' (prefilled, not decoded), ``tool_s``
    seconds of tool calls in the step."""

    rows: int
    prompt: float
    response: float
    longest_response: int
    padded: int
    source: str = ""
    gen_batches: Optional[float] = None  # DAPO's generation batches in the step, where a run measured them
    turns: float = 1.0
    tool_tokens: float = 0.0
    tool_s: float = 0.0

    @property
    def tokens(self) -> float:
        return self.rows * (self.prompt + self.response)

    def turns_open(self) -> list[Turn]:
        """The assistant turns of a conversation: the model's tokens split evenly over ``turns``, the
        tools' between them; a fractional mean leaves that share of the rows open for the last."""
        turns = max(1.0, self.turns)
        model = max(self.response - self.tool_tokens, 1.0)
        per_turn = model / turns
        tool_turn = self.tool_tokens / (turns - 1) if turns > 1 else 0.0
        longest = max(
            1, min(self.longest_response, round(max(per_turn, (self.longest_response - self.tool_tokens) / turns)))
        )
        out = []
        for k in range(math.ceil(turns - 1e-9)):
            out.append(
                Turn(
                    k,
                    min(1.0, turns - k),
                    self.prompt + k * per_turn + max(k - 1, 0) * tool_turn,
                    tool_turn if k else 0.0,
                    per_turn,
                    longest,
                )
            )
        return out


def workload_of(cfg: Config) -> Workload:
    """The dry run's workload: ``plan.prompt_length`` / ``plan.response_length``, or the maxima."""
    d, p = cfg.data, cfg.plan
    rows = step_shape(cfg).rows
    # (null: unset; a value is in (0, its maximum], rlhf_hpc.recipe.input_checks.plan_problems)
    given = [k for k in ("prompt_length", "response_length") if getattr(p, k) is not None]
    prompt = d.max_prompt_length if p.prompt_length is None else p.prompt_length
    response = d.max_response_length if p.response_length is None else p.response_length
    source = (
        f"means from plan.{' and plan.'.join(given)}"
        if given
        else "the maxima (set plan.prompt_length / plan.response_length to the data's means)"
    )
    w = Workload(
        rows, float(prompt), float(response), d.max_response_length, d.max_prompt_length + d.max_response_length, source
    )
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        return w
    w.turns = float(p.assistant_turns or mt.max_assistant_turns or 2)
    per_tool = (
        p.tool_response_length if p.tool_response_length is not None else math.ceil(mt.max_tool_response_length / 4)
    )
    # (the response's budget holds the tool turns; the model keeps at least a token a turn)
    w.tool_tokens = max(0.0, min((w.turns - 1) * per_tool, w.response - w.turns))
    w.tool_s = (p.tool_seconds or 0.0) * (math.ceil(w.turns) - 1)
    turns_from = (
        "plan.assistant_turns"
        if p.assistant_turns
        else "the most allowed"
        if mt.max_assistant_turns
        else "assumed: set plan.assistant_turns"
    )
    tool_from = "plan.tool_response_length" if p.tool_response_length is not None else "max_tool_response_length / 4"
    seconds_from = "plan.tool_seconds" if p.tool_seconds is not None else "not planned: set plan.tool_seconds"
    w.source += (
        f"; {w.turns:g} assistant turns ({turns_from}), tool turns of {per_tool} tokens ({tool_from}), "
        f"{p.tool_seconds or 0:g} s a tool turn ({seconds_from})"
    )
    return w


@dataclass
class PhaseTime:
    name: str
    parts: dict[str, float]  # seconds each resource would take alone
    seconds: float  # with overlap where the hardware overlaps
    comm: float  # seconds of collectives not hidden behind compute
    note: str = ""

    @property
    def bound(self) -> str:
        return max(self.parts, key=self.parts.get) if self.parts else "-"


@dataclass
class TimePlan:
    hardware: Hardware
    world: int
    workload: Workload
    phases: list[PhaseTime]
    save_freq: int = 0
    advice: list[str] = field(default_factory=list)

    @property
    def step_s(self) -> float:
        return sum(p.seconds for p in self.phases if p.name != "save_checkpoint")

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.workload.tokens / max(self.step_s, 1e-12) / self.world

    @property
    def comm_share(self) -> float:
        return sum(p.comm for p in self.phases if p.name != "save_checkpoint") / max(self.step_s, 1e-12)

    def phase(self, name: str) -> Optional[PhaseTime]:
        return next((p for p in self.phases if p.name == name), None)

    def metrics(self) -> dict[str, float]:
        """``plan/<phase>_s`` for every phase, ``plan/step_s``, ``plan/tokens_per_s_per_gpu``,
        ``plan/comm_fraction``."""
        out = {f"plan/{p.name}_s": p.seconds for p in self.phases}
        out.update(
            {
                "plan/step_s": self.step_s,
                "plan/tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "plan/comm_fraction": self.comm_share,
            }
        )
        return out

    def render(self) -> str:
        w, hw = self.workload, self.hardware
        lines = [
            f"# time plan per step on {self.world} x {hw.name} ({hw.source})",
            f"# workload: {w.rows} responses of {w.prompt:.0f} + {w.response:.0f} tokens ({w.source})",
        ]
        for p in self.phases:
            parts = ", ".join(f"{k} {v:.3g}" for k, v in p.parts.items() if v > 0)
            every = f"once per {self.save_freq} steps, not in the step; " if p.name == "save_checkpoint" else ""
            lines.append(
                f"#   {p.name:<15}{p.seconds:9.3g} s  bound: {p.bound:<18} [{every}alone, s: {parts}"
                + (f"; {p.note}" if p.note else "")
                + "]"
            )
        lines.append(
            f"# step {self.step_s:.3g} s: {self.tokens_per_s_per_gpu:,.0f} tokens/s per GPU "
            f"({self.tokens_per_s_per_gpu * self.world:,.0f} on {self.world}), communication "
            f"{self.comm_share:.0%} of the step"
        )
        lines += [f"# advice: {a}" for a in self.advice]
        return "\n".join(lines)

    def render_measured(self, measured: dict[str, float]) -> Optional[str]:
        """One line: each phase a run timed (``timing_s/<phase>``) against this plan, with the ratio."""
        rows = [
            (p.name, p.seconds, measured[f"timing_s/{p.name}"]) for p in self.phases if f"timing_s/{p.name}" in measured
        ]
        if "timing_s/step" in measured:
            rows.append(("step", self.step_s, measured["timing_s/step"]))
        if not rows:
            return None
        return "time per phase, measured / planned (s): " + ", ".join(
            f"{n} {m:.3g}/{p:.3g} ({m / p:.2f}x)" if p > 0 else f"{n} {m:.3g}/0" for n, p, m in rows
        )


# ------------------------------------------------------------------------------------ the model
class TimeModel:
    """The phases of one step on ``hw`` for ``cfg`` (one method per kind of phase)."""

    def __init__(
        self,
        cfg: Config,
        hw: Optional[Hardware] = None,
        device_name: Optional[str] = None,
        memory: Optional[MemoryPlan] = None,
    ):
        arr = cfg.actor_rollout_ref
        self.cfg, self.hw = cfg, hw or hardware_of(cfg, device_name)
        self.step = step_shape(cfg)
        self.paged = planned_engine(arr.rollout.name).paged  # (rlhf_hpc.config.engines)
        self.world, self.per_node = cfg.world_size, cfg.trainer.n_gpus_per_node
        self.engine_world = cfg.rollout_world_size if cfg.split else cfg.world_size  # the ranks that generate
        self.s = model_shape(arr.model.path, arr.model.override_config, arr.model.trust_remote_code)
        self.cs = (
            model_shape(
                cfg.critic.model.path, cfg.critic.model.override_config, bool(cfg.critic.model.trust_remote_code)
            )
            if cfg.critic.enable and cfg.critic.model.path and cfg.critic.model.path != arr.model.path
            else self.s
        )
        self.layouts = resolved_fsdp_configs(cfg)
        self.recompute = {n: on for n, (on, _) in choose_checkpointing(cfg).items()}
        self.memory = memory or build_plan(cfg)  # (``memory``: the caller's plan of this same cfg)
        self.lora = lora_enabled(arr.model)
        self.adapter = (
            adapter_params(arr.model.path, arr.model, arr.model.override_config, arr.model.trust_remote_code)
            if self.lora
            else 0
        )
        # the engine's sleep copies to the host after generation and its wake back before the sync
        asleep = engine_sleep_copy(cfg, self.s, self.adapter)
        self.sleep_copy_s = asleep.copied / (self.hw.host_link_gb_s * 1e9) if asleep else 0.0

    # ----------------------------------------------------------------------------- resources
    def link(self, group: int, local: Optional[int] = None) -> tuple[float, str]:
        """(bytes/s per rank, name) of a collective over a group of ``group`` ranks, ``local`` of them on
        each node (default: consecutive ranks). Inside a node: its link. Across nodes NCCL runs a ring
        per NIC, so the node's groups share its whole network: each rank moves at ``local`` / ranks per
        node of the node's rate (a group of whole nodes at the node's rate: nccl-tests' all-reduce bus
        bandwidth between DGX H100 nodes is ~400 GB/s, their 8 x 400 Gb/s NICs; one rank per node, as
        in a replica group, at one NIC's)."""
        if group <= self.per_node:
            return self.hw.intra_node_gb_s * 1e9 * LINK_EFFICIENCY, "intra-node link"
        local = min(group, self.per_node) if local is None else max(1, min(local, self.per_node))
        return self.hw.inter_node_gb_s * 1e9 * LINK_EFFICIENCY * local / self.per_node, "inter-node network"

    def shards(self, fsdp: FSDPConfig) -> int:
        return shard_count(self.world, fsdp)

    def efficiency(self) -> float:
        return self.hw.train_efficiency

    # ------------------------------------------------------------------------------- phases
    def phases(self, w: Workload) -> list[PhaseTime]:
        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        actor, critic, rm, step = arr.actor, cfg.critic, cfg.reward_model, self.step
        rows = w.rows / self.world
        # the split layout: generation runs on the rollout ranks, beside this step (rlhf_hpc.planning.split_plan)
        out = [self.weight_sync()] + ([] if cfg.split else [self.generation(w)])
        if step.old_log_probs == "pass":  # (else the engine's log-probs, or the on-policy update's forward)
            out.append(self.forward(step.old_log_prob, self.s, self.layouts["actor"], w, rows, self.s.vocab))
        if actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
            out.append(
                self.forward(step.ref, self.s, self.layouts["actor" if self.lora else "ref"], w, rows, self.s.vocab)
            )
        if critic.enable:
            out.append(self.forward(step.values, self.cs, self.layouts["critic"], w, rows, 1))
        if any(p.name == "reward_model" for p in self.memory.phases):  # (the plan found its shape)
            rms = model_shape(rm.model.path, rm.model.override_config, rm.model.trust_remote_code)
            out.append(self.forward(step.reward_model, rms, rm.model.fsdp_config, w, rows, 1))
        if critic.enable:
            out.append(
                self.update(
                    step.update_critic,
                    self.cs,
                    self.layouts["critic"],
                    w,
                    rows,
                    self.recompute["critic"],
                    1,
                    lora_enabled(critic.model)
                    and adapter_params(
                        critic.model.path or arr.model.path,
                        critic.model,
                        critic.model.override_config,
                        bool(critic.model.trust_remote_code),
                    ),
                )
            )
        out.append(
            self.update(
                step.update_actor,
                self.s,
                self.layouts["actor"],
                w,
                rows,
                self.recompute["actor"],
                self.s.vocab,
                self.adapter,
            )
        )
        if cfg.trainer.save_freq > 0:
            out.append(self.checkpoint())
        return out

    def weight_sync(self) -> PhaseTime:
        hw, s, rollout = self.hw, self.s, self.cfg.actor_rollout_ref.rollout
        fsdp = self.layouts["actor"]
        shards = self.shards(fsdp)
        nbytes = (self.adapter if self.lora else s.params) * DTYPE_BYTES[rollout.dtype]
        bw, where = self.link(shards)
        gather = nbytes * (shards - 1) / shards / bw if shards > 1 else 0.0
        load = nbytes / rollout.tensor_model_parallel_size / (hw.engine_load_gb_s * 1e9)
        if DTYPE_BYTES[fsdp.model_dtype] != DTYPE_BYTES[rollout.dtype]:  # each gathered tensor cast on its way
            load += (self.adapter if self.lora else s.params) * DTYPE_BYTES[fsdp.model_dtype] / (hw.cast_gb_s * 1e9)
        overhead = (
            hw.sync_overhead_s
            + s.param_tensors * hw.sync_param_overhead_s
            + s.checkpoint_tensors * hw.sync_tensor_overhead_s
        )
        parts = {"engine load": load, where: gather, "overhead": overhead}
        if self.sleep_copy_s:
            parts["engine wake (host link)"] = self.sleep_copy_s
        send = 0.0
        if self.cfg.split:  # trainer rank 0 broadcasts each gathered tensor to the rollout ranks
            bw_send, between = self.link(self.per_node + 1 if self.cfg.trainer.nnodes > 1 else 2)
            send = nbytes / bw_send
            parts[f"to the rollout ranks ({between})"] = send
        # the reshard overlaps the gathers, the send and the engine's copy
        seconds = (max(gather, send, load) if hw.overlap_comm else gather + send + load) + overhead
        seconds += self.sleep_copy_s  # (before the sync, alone)
        return PhaseTime(
            "update_weights",
            parts,
            seconds,
            seconds - load - overhead,
            f"{nbytes / 2**20:,.0f} MiB" + (" (the LoRA adapter)" if self.lora else ""),
        )

    def generation(self, w: Workload) -> PhaseTime:
        hw, s, rollout = self.hw, self.s, self.cfg.actor_rollout_ref.rollout
        tp = rollout.tensor_model_parallel_size
        engines = max(self.engine_world // tp, 1)
        rows = w.rows / engines
        rb = DTYPE_BYTES[rollout.dtype]
        peak = hw.matmul_flops(rollout.dtype) * PREFILL_EFFICIENCY
        prefill_rate = (hw.engine_flops("prefill", rollout.dtype) or peak) * tp
        rate = (hw.engine_flops("decode", rollout.dtype) or peak) * tp
        kv_per_token = 2 * s.layers * s.kv_heads * s.head_dim * rb
        room = self.memory.kv_cache_tokens
        if room is None and self.paged:  # vLLM's CPU build: a KV cache of a fixed size
            max_len = rollout.max_model_len or (self.cfg.data.max_prompt_length + self.cfg.data.max_response_length)
            per_rank = kv_bytes_per_token(s, rb, tp)
            room = int(cpu_kv_cache_bytes(rollout.max_num_seqs, max_len, per_rank) // per_rank)
        bw, where = self.link(tp)
        eff = DECODE_BANDWIDTH_EFFICIENCY if self.cfg.trainer.device == "cuda" else 1.0
        hbm = hw.hbm_gb_s * 1e9 * eff
        # the sampler's passes over the logits (softmax, the draw, the log-prob), beside the model's
        # head; a measured engine figure already holds them
        sampler_bytes = SAMPLER_BYTES_PER_LOGIT * s.vocab if hw.engine_flops("decode", rollout.dtype) is None else 0.0
        overhead = hw.decode_step_overhead_s
        if not self.paged:  # transformers' generate: a whole forward pass per new token
            overhead = hw.pass_overhead_s + s.layers * hw.layer_overhead_s
        routed = 0.0  # (transformers' generate: its routed layers per step, at the step's batch)
        # each prompt once for its n responses (they share its KV cache)
        prompts = rows / rollout.n
        prefill = forward_flops(s, prompts * w.prompt, w.prompt, prompts, s.vocab) / prefill_rate
        read = compute = comm = sampler = seconds = calls = 0.0
        steps = thin = 0
        batches = []
        for turn in w.turns_open():  # (one generate call per assistant turn: the rows still open)
            if turn.index > 0:  # the tool's answer prefilled; a paged engine keeps the rest cached
                new = turn.new_tokens if self.paged else turn.context + turn.new_tokens
                prefill += (
                    forward_flops(s, turn.rows * rows * new, turn.context + turn.new_tokens, turn.rows * rows, s.vocab)
                    / prefill_rate
                )
            open_rows = max(1, round(turn.rows * rows))
            if self.paged:
                batch = max(
                    1,
                    int(
                        min(
                            rollout.max_num_seqs,
                            open_rows,
                            (room / (turn.context + turn.new_tokens + turn.mean)) if room else open_rows,
                        )
                    ),
                )
            else:  # transformers' generate: every row of the call in one batch
                batch = open_rows
            batches.append(batch)
            segments = decode_segments(
                response_lengths(open_rows, turn.mean, turn.longest),
                turn.context + turn.new_tokens,
                batch,
                continuous=self.paged,
            )
            for seg in segments:
                b = seg.sequences
                # (a mixture of experts reads the experts its batch is routed to: s.read_params)
                r = (s.read_params(b) * rb / tp + seg.context * kv_per_token / tp) / hbm
                c = forward_flops(s, b, seg.context / b, b, s.vocab) / rate
                m = (
                    2 * s.layers * (2 * (tp - 1) / tp * b * s.hidden * rb / bw + hw.collective_latency_s)
                    if tp > 1
                    else 0.0
                )
                x = b * sampler_bytes / hbm
                o = 0.0 if self.paged else self.routed_overhead(b)
                read += seg.steps * r
                compute += seg.steps * c
                comm += seg.steps * m
                sampler += seg.steps * x
                routed += seg.steps * o
                seconds += seg.steps * (max(r, c) + m + x + o)
            steps += sum(seg.steps for seg in segments)
            thin += sum(seg.steps for seg in segments if seg.sequences < batch / 4)
            # (a request per response; transformers' generate takes a first turn's prompt once for its n)
            requests = open_rows if self.paged or turn.index > 0 else open_rows / rollout.n
            calls += hw.generate_overhead_s + requests * hw.request_overhead_s
        parts = {
            "compute": prefill + compute,
            "memory bandwidth": read + sampler,
            "overhead": steps * overhead + calls + routed,
            where: comm,
        }
        seconds += prefill + steps * overhead + calls
        if w.tool_s > 0:
            parts["tools"] = w.tool_s
            seconds += w.tool_s
        note = (
            f"{engines} engine(s) of TP {tp}, {rows:.0f} rows each, batch {max(batches)}: {steps} decode steps, {thin} "
            f"of them under a quarter of the batch (response lengths: {w.response:.0f} mean, {w.longest_response} "
            f"longest, spread assumed as rlhf_hpc.planning.decode_schedule says)"
        )
        if w.turns > 1:
            note += (
                f"; {w.turns:.3g} assistant turns per conversation, {w.tool_tokens:.0f} tool tokens of the response"
                f" prefilled between them, tools {w.tool_s:.3g} s"
            )
        scale, why = generation_batches(self.cfg, w.gen_batches)
        if why:  # DAPO's dynamic sampling: the step's responses as generated, in generation batches
            parts = {k: v * scale for k, v in parts.items()}
            seconds, comm, note = seconds * scale, comm * scale, f"{note}; x{scale:.3g}: {why}"
        if self.sleep_copy_s:  # once, after the last generation batch
            parts["engine sleep (host link)"] = self.sleep_copy_s
            seconds += self.sleep_copy_s
        return PhaseTime("gen", parts, seconds, comm, note)

    def routed_overhead(self, tokens: float, s: Optional[ModelShape] = None) -> float:
        """Seconds a forward pass over ``tokens`` tokens spends in its routed layers beside their
        FLOPs (0 for a dense model): per layer, per expert the tokens reach, per (token, expert) pair."""
        hw, s = self.hw, s or self.s
        if not s.moe_layers:
            return 0.0
        return s.moe_layers * (
            hw.routed_layer_overhead_s
            + s.touched_experts(tokens) * hw.expert_overhead_s
            + tokens * s.experts_per_token * hw.routed_token_overhead_s
        )

    def pass_costs(
        self,
        s: ModelShape,
        fsdp: FSDPConfig,
        w: Workload,
        rows: float,
        micro: int,
        head: int,
        remove_padding: bool,
        backward: float,
        sp: int,
    ) -> dict[str, float]:
        """Seconds of ``rows`` rows through ``s`` in ``micro`` micro-batches, forward (x ``backward``
        for the passes of an update: 1 + backward_ratio, one more with recompute): compute, overhead."""
        hw = self.hw
        length = (w.prompt + w.response) if remove_padding else w.padded
        tokens = rows * length
        dtype = fsdp.mixed_precision.param_dtype
        flops = forward_flops(s, tokens, length, rows * w.response if head > 1 else tokens, head) * backward
        per_pass = hw.pass_overhead_s + s.layers * hw.layer_overhead_s + self.routed_overhead(tokens / micro, s)
        out = {
            "compute": flops / (hw.matmul_flops(dtype) * self.efficiency()),
            "memory bandwidth": 0.0,
            "overhead": micro * backward * per_pass,
        }
        if sp > 1:  # Ulysses: 2 all-to-alls per layer and pass (q/k/v in, the output back)
            bw, where = self.link(sp, local=1)  # (an all-to-all: each rank's own share crosses)
            q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
            out[where] = (
                out.get(where, 0.0)
                + backward * 2 * s.layers * tokens * (2 * q + 2 * kv) / 2 * DTYPE_BYTES[dtype] * (sp - 1) / sp / bw
            )
        return out

    def combine(
        self, name: str, compute: dict[str, float], comm: dict[str, float], serial: dict[str, float], note: str
    ) -> PhaseTime:
        """Compute-side seconds add up; collectives overlap them on a GPU (not on gloo); host transfers add."""
        busy, talk = sum(compute.values()), sum(comm.values())
        shared = max(busy, talk) if self.hw.overlap_comm else busy + talk
        parts = dict(compute)
        for k, v in {**comm, **serial}.items():
            parts[k] = parts.get(k, 0.0) + v
        return PhaseTime(name, parts, shared + sum(serial.values()), shared - busy, note)

    def forward(
        self, phase: PhaseShape, s: ModelShape, fsdp: FSDPConfig, w: Workload, rows: float, head: int
    ) -> PhaseTime:
        tokens = rows * ((w.prompt + w.response) if phase.remove_padding else w.padded)
        micro = phase.micro_batches(rows, tokens)
        compute = self.pass_costs(s, fsdp, w, rows, micro, head, phase.remove_padding, 1.0, phase.sp)
        comm = {k: compute.pop(k) for k in list(compute) if k.endswith(("link", "network"))}
        shards = self.shards(fsdp)
        b = DTYPE_BYTES[fsdp.mixed_precision.param_dtype]
        gathers = micro if fsdp.reshard_after_forward is not False else 1
        if shards > 1:
            bw, where = self.link(shards)
            comm[where] = comm.get(where, 0.0) + gathers * (
                s.params * b * (shards - 1) / shards / bw + (s.layers + 2) * self.hw.collective_latency_s
            )
        serial = {}
        if fsdp.param_offload or fsdp.offload_policy:
            serial["host link"] = (
                gathers * s.params * DTYPE_BYTES[fsdp.model_dtype] / shards / (self.hw.host_link_gb_s * 1e9)
            )
        return self.combine(phase.name, compute, comm, serial, f"{micro} micro-batch(es)")

    def update(
        self,
        phase: PhaseShape,
        s: ModelShape,
        fsdp: FSDPConfig,
        w: Workload,
        rows: float,
        recompute: bool,
        head: int,
        trainable,
    ) -> PhaseTime:
        hw, world, epochs, sp = self.hw, self.world, phase.epochs, phase.sp
        remove_padding = phase.remove_padding
        mini_rows = max(phase.mini_rows, 1)  # (the runtime's: rlhf_hpc.ops.batching.per_rank_mini_batch)
        minis = max(1, math.ceil(rows / mini_rows))
        length = (w.prompt + w.response) if remove_padding else w.padded
        micro = minis * phase.micro_batches(mini_rows, mini_rows * length)
        factor = (1 + hw.backward(fsdp.mixed_precision.param_dtype) + (1 if recompute else 0)) * epochs
        # (the per-pass overhead: forward and backward of a micro-batch cost ~3 forward passes' launches)
        compute = self.pass_costs(s, fsdp, w, rows, micro, head, remove_padding, factor, sp)
        comm = {k: compute.pop(k) for k in list(compute) if k.endswith(("link", "network"))}
        shards = self.shards(fsdp)
        replicas = world // shards
        b, rb = DTYPE_BYTES[fsdp.mixed_precision.param_dtype], DTYPE_BYTES[fsdp.mixed_precision.reduce_dtype]
        master = DTYPE_BYTES[fsdp.model_dtype]
        trained = trainable or s.params
        passes = micro * epochs
        if shards > 1:
            bw, where = self.link(shards)
            gathers = 2 if fsdp.reshard_after_forward is not False else 1
            per_micro = (gathers * s.params * b + trained * rb) * (shards - 1) / shards / bw
            comm[where] = comm.get(where, 0.0) + passes * (per_micro + 3 * (s.layers + 2) * hw.collective_latency_s)
        if replicas > 1:  # the gradients' all-reduce across replicas, every micro-batch's backward
            bw, where = self.link(world, local=max(1, self.per_node // shards))  # (strided groups)
            comm[where] = comm.get(where, 0.0) + passes * (
                2 * (replicas - 1) / replicas * trained * rb / shards / bw + (s.layers + 2) * hw.collective_latency_s
            )
        steps = minis * epochs
        serial = {}
        host_params = fsdp.param_offload or fsdp.offload_policy
        if host_params:  # parameters and gradients cross the host link; the step runs on the host
            serial["host link"] = (
                passes * (2 * s.params * master + trained * master) / shards / (hw.host_link_gb_s * 1e9)
            )
            serial["host optimizer"] = steps * trained / shards / hw.host_adam_params_s
        else:
            compute["memory bandwidth"] += steps * trained * ADAM_BYTES / shards / (hw.hbm_gb_s * 1e9)
            if fsdp.optimizer_offload:  # the moments come to the GPU for the update and go back
                serial["host link"] = 2 * 8 * trained / shards / (hw.host_link_gb_s * 1e9)
        return self.combine(
            phase.name,
            compute,
            comm,
            serial,
            f"{passes} micro-batch passes, {steps} optimizer steps" + (", recompute" if recompute else ""),
        )

    def checkpoint(self) -> PhaseTime:
        cfg, s = self.cfg, self.s
        afs = self.layouts["actor"]
        per_rank = (self.adapter * 12 if self.lora else s.params * (DTYPE_BYTES[afs.model_dtype] + 8)) / self.shards(
            afs
        )
        if cfg.critic.enable:
            cfs = self.layouts["critic"]
            per_rank += self.cs.params * (DTYPE_BYTES[cfs.model_dtype] + 8) / self.shards(cfs)
        seconds = per_rank * self.per_node / (self.hw.disk_gb_s * 1e9)
        return PhaseTime(
            "save_checkpoint", {"disk": seconds}, seconds, 0.0, f"{per_rank * self.per_node / 2**30:.2f} GiB per node"
        )

    def plan(self, w: Workload) -> TimePlan:
        return TimePlan(self.hw, self.world, w, self.phases(w), self.cfg.trainer.save_freq)

    def plan_step(self, metrics: dict[str, float], padded: int) -> TimePlan:
        """The plan of a step a run just took, with its own lengths (``prompt_length/mean``,
        ``response_length/mean`` and ``/max`` of its metrics; ``padded``: its rows' padded length)."""
        d = self.cfg.data
        # a multi-turn step's tool (and user) turns are in every training pass but not in response_length (the
        # model's tokens, as verl logs it): in the response, prefilled between its assistant turns
        # (verl's num_turns: assistant + tool turns + the prompt, so about twice the assistant turns)
        tool = (metrics.get("tools/tokens_tool", 0.0) + metrics.get("tools/tokens_user", 0.0)) / max(self.step.rows, 1)
        return self.plan(
            Workload(
                self.step.rows,
                metrics.get("prompt_length/mean", d.max_prompt_length),
                metrics.get("response_length/mean", d.max_response_length) + tool,
                min(d.max_response_length, int(metrics.get("response_length/max", d.max_response_length) + tool)),
                padded,
                "this step's lengths",
                metrics.get("train/num_gen_batches"),
                turns=max(1.0, metrics.get("num_turns/mean", 2.0) / 2),
                tool_tokens=tool,
                tool_s=metrics.get("timing_s/tools", 0.0),
            )
        )


def generation_batches(cfg: Config, measured: Optional[float] = None) -> tuple[float, str]:
    """(the factor on the generation of train_batch_size prompts, the plan line's reason) under DAPO's
    dynamic sampling (``algorithm.filter_groups``): a step generates batches of data.gen_batch_size
    prompts until train_batch_size have signal. Assumed, with no key to say it: half the groups keep
    signal, so ceil(2 x train_batch_size / gen_batch_size) batches (at most max_num_gen_batches when
    it is > 0), or the number a run measured (``train/num_gen_batches``); time linear in the prompts.
    (1.0, "") without dynamic sampling."""
    fg, d = cfg.algorithm.filter_groups, cfg.data
    if not fg.enable:
        return 1.0, ""
    gen = d.gen_batch_size or d.train_batch_size
    if measured is not None:
        batches, why = float(measured), f"{measured:.0f} generation batch(es) of {gen} prompts, as measured"
    else:
        batches = float(math.ceil(2 * d.train_batch_size / gen))
        if fg.max_num_gen_batches > 0:
            batches = min(batches, float(fg.max_num_gen_batches))
        why = (
            f"{batches:.0f} generation batch(es) of {gen} prompts expected (dynamic sampling; assumed: half the "
            f"groups keep reward variance"
            + (f", at most max_num_gen_batches={fg.max_num_gen_batches}" if fg.max_num_gen_batches > 0 else "")
            + ")"
        )
    return batches * gen / d.train_batch_size, why


def build_time_plan(
    cfg: Config,
    workload: Optional[Workload] = None,
    advise: Optional[Callable[[Config], object]] = None,
    memory: Optional[MemoryPlan] = None,
) -> TimePlan:
    """The time plan of ``cfg`` for ``workload`` (default: the dry run's, ``workload_of``), with
    advice (``advice_for``) when ``advise`` is given: the config check a candidate must pass
    (rlhf_hpc.recipe.config_checks.validate, which raises ConfigError). ``memory``: the memory plan of
    ``cfg`` where the caller has it (else built here)."""
    plan = TimeModel(cfg, memory=memory).plan(workload or workload_of(cfg))
    if advise is not None:
        plan.advice = advice_for(cfg, plan, advise)
    return plan


# ------------------------------------------------------------------------------------ advice
# (the candidate changes: rlhf_hpc.planning.advice)
def advice_for(
    cfg: Config, plan: TimePlan, validate: Callable[[Config], object], keep: int = 4, min_gain: float = 0.03
) -> list[str]:
    """The changes (``candidate_changes``) that ``validate`` accepts, whose memory plan still fits
    and whose step is at least ``min_gain`` faster, best first, each naming its keys; first, when
    communication passes the 20% rule, a line saying whether the plan finds Ulysses (the rule's
    remedy) faster, so the rule never advises what the plan shows does not help."""
    ulysses = "ulysses_sequence_parallel_size"
    found, tried_ulysses = [], False
    for changes, why in candidate_changes(cfg, plan.comm_share):
        is_ulysses = any(k.endswith(ulysses) for k, _ in changes)
        tried_ulysses |= is_ulysses
        other = cfg
        for key, value in changes:
            other = with_value(other, key, value)
        try:
            validate(other)
            memory, errors, _ = check_plan(other)
            if errors or memory is None:
                continue
            faster = build_time_plan(other, plan.workload, memory=memory)
        except (ConfigError, ValueError):  # a change the config refuses is no advice
            continue
        gain = 1 - faster.step_s / plan.step_s
        if gain >= min_gain:
            keys = " ".join(f"{k}={value_text(v)}" for k, v in changes[:1]) + (
                " (and the ref's and critic's)" if len(changes) > 1 else ""
            )
            found.append(
                (
                    gain,
                    is_ulysses,
                    f"{keys}: step {plan.step_s:.3g} -> {faster.step_s:.3g} s (-{gain:.0%}; "
                    f"{why}; the memory plan fits, peak {memory.peak / 2**30:.1f} GiB)",
                )
            )
    found.sort(key=lambda g: -g[0])
    lines = [text for _, _, text in found[:keep]]
    if plan.comm_share > COMM_RULE:
        rule = f"communication is {plan.comm_share:.0%} of the step, above the reference design's {COMM_RULE:.0%}: "
        if any(u for _, u, _ in found[:keep]):
            rule += "Ulysses sequence parallelism shortens it (below), with the other changes the plan finds faster"
        elif tried_ulysses:
            rule += f"the plan finds Ulysses sequence parallelism ({ulysses}=2) no faster here or not fitting" + (
                "; what it finds faster is below" if lines else "; no change it tries is faster"
            )
        else:
            rule += "what the plan finds faster is below" if lines else "no change the plan tries is faster"
        lines.insert(0, rule)
    return lines

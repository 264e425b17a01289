"""The KL-PPO training loop, SPMD on every rank.

``PPOTrainer.train_step`` is the algorithm written down: sync weights -> generate -> old/ref
log-probs and values -> rewards -> KL -> rollout correction and advantages -> critic update -> actor
update -> metrics; ``train`` adds validation, the guard and checkpoints. Each rank generates for an
even share of a step's prompts (``rollout.n`` responses each); the responses are then redistributed
so every rank trains on ``train_batch_size * n / ranks`` rows, balanced by token count
(``rlhf_hpc.distributed.rows``). Everything global (normalisation, whitening, group statistics, KL
controller, metrics) goes through all-reduces, so every rank takes the same decisions.

The step batch (one dict of tensors, rows = this rank's responses):

    input_ids, attention_mask, position_ids   (B, P + R)  prompt left-padded, response right-padded
    responses, response_mask                  (B, R)  the mask 0 on padding and on a multi-turn row's tool turns
    engine_log_probs                          (B, R)  from the rollout engine (sampling dist.)
    uid                                       (B,)    the prompt's position in the step (its group)
    old_log_probs, ref_log_prob, values       (B, R)  actor / reference / critic before the update
    sum_pi_squared                            (B, R)  sum_v pi(v)^2 of the old-log-prob pass
                                                      (actor.calculate_sum_pi_squared: verl's OTB)
    token_scores, token_rewards               (B, R)  score on the last valid token; minus KL if in reward
    reward_baselines                          (B,)    the score of the greedy response to the row's prompt
                                                      (estimators with needs_greedy_baseline: verl's ReMax)
    advantages, returns                       (B, R)
    rollout_is_weights                        (B, R)  rollout correction's IS weights (rollout_is set)
    sampled_response_mask                     (B, R)  the mask as sampled, when rollout_rs rejected tokens
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Optional

import torch

from rlhf_hpc.config.schema import Config
from rlhf_hpc.data.dataset import StatefulSampler, load_examples
from rlhf_hpc.distributed.fsdp import describe_gradient_reduction
from rlhf_hpc.distributed.process_group import (
    DistContext,
    all_reduce_max,
    all_reduce_sum,
    build_rollout_tp_group,
    device_memory_gb,
)
from rlhf_hpc.distributed.rows import (
    RolloutRow,
    coverage,
    prompt_share,
    redistribute_rows,
    resample_rows,
    share_rows,
)
from rlhf_hpc.launch.local import LAYOUT_SHOWN
from rlhf_hpc.launch.stop import STOPPED, StopCheck
from rlhf_hpc.models.architectures import moe_experts
from rlhf_hpc.models.hf import model_config, torch_dtype
from rlhf_hpc.models.tokenizer import load_tokenizer, tokenizer_path
from rlhf_hpc.observability.perf import Timer
from rlhf_hpc.observability.profiling import StepProfiler
from rlhf_hpc.observability.run_summary import run_summary
from rlhf_hpc.observability.startup import StartupClock, process_started
from rlhf_hpc.observability.tracking import Tracker
from rlhf_hpc.ops import algos
from rlhf_hpc.ops.batching import select_rows
from rlhf_hpc.ops.estimators import ADV_ESTIMATORS, AdvantageInputs, compute_advantages
from rlhf_hpc.ops.moe_load_metrics import MoELoadCounts, response_load_counts
from rlhf_hpc.ops.pf_ppo import pf_ppo_indices
from rlhf_hpc.ops.step_shape import step_shape
from rlhf_hpc.planning.layout import describe as describe_layouts
from rlhf_hpc.planning.memory_plan import check_plan, oom_message
from rlhf_hpc.ppo import checkpoint as ckpt
from rlhf_hpc.ppo.dynamic_sampling import collect_groups, gen_seed
from rlhf_hpc.ppo.faults import FaultInjector
from rlhf_hpc.ppo.generation import Generator
from rlhf_hpc.ppo.guard import GuardStop, StabilityGuard
from rlhf_hpc.ppo.split_rollout import RemoteRollout
from rlhf_hpc.ppo.step_batch import (
    make_step_batch,
    response_spans,
    rollout_rows,
    sampling_for,
    score_responses,
    scores_on_last_token,
    step_seed,
)
from rlhf_hpc.ppo.step_metrics import data_metrics, perf_metrics, reduce_stats, time_model
from rlhf_hpc.ppo.training_models import build_training_models
from rlhf_hpc.ppo.validation import run_validation
from rlhf_hpc.rewards import RewardFunction
from rlhf_hpc.rewards.overlong import overlong_metrics, overlong_reward
from rlhf_hpc.rewards.reward_model import build_reward_model
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import sync_weights_to_rollout
from rlhf_hpc.tools.tool_config import run_tools, tool_schemas

__all__ = ["PPOTrainer", "fit", "out_of_memory_report"]


def fit(cfg: Config, ctx: DistContext, clock: Optional[StartupClock] = None) -> None:
    """Train until ``trainer.total_training_steps`` (or ``total_epochs``) on every rank; ``clock``:
    the worker's start-up phases so far (rlhf_hpc.observability.startup)."""
    PPOTrainer(cfg, ctx, clock).train()


class PPOTrainer:
    """The loop on one rank. ``__init__`` builds the models, the rollout engine, the data and the trackers
    and resumes from a checkpoint where there is one; ``train`` runs the steps with validation, the
    stability guard, checkpoints and stops; ``train_step`` is one step of the algorithm, phase by
    phase. ``state_dict`` / ``load_state_dict`` are the one list of resumable state besides the
    models' own (``TrainingModels.checkpoint_components``). The guard's scales are trainer state: applied to
    the actor's LR schedule and KL-loss coefficient, never written into the config."""

    def __init__(self, cfg: Config, ctx: DistContext, clock: Optional[StartupClock] = None):
        tr, arr = cfg.trainer, cfg.actor_rollout_ref
        self.cfg, self.ctx = cfg, ctx
        self.clock = clock or StartupClock()
        self.run_dir = Path(tr.default_local_dir).expanduser()
        self.last_saved: Optional[int] = None  # the step of the last checkpoint this process wrote
        torch.manual_seed(tr.seed)
        self.tokenizer = load_tokenizer(
            tokenizer_path(cfg), arr.model.trust_remote_code, arr.model.custom_chat_template
        )
        tools = run_tools(cfg)  # (a multi-turn run's prompts show the model its tools)
        schemas = tool_schemas(tools) or None
        self.train_set = load_examples(
            cfg.data.train_files, self.tokenizer, cfg.data, split_seed=cfg.data.seed, tools=schemas
        )
        self.val_set = (
            load_examples(cfg.data.val_files, self.tokenizer, cfg.data, split_seed=cfg.data.seed + 1, tools=schemas)
            if cfg.data.val_files
            else []
        )
        self.sampler = StatefulSampler(len(self.train_set), cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle)
        self.total_steps = tr.total_training_steps or self.sampler.batches_per_epoch * tr.total_epochs
        self.shape = step_shape(cfg)  # rows per rank, mini/micro-batches per phase (as the plans see them)
        self.clock.mark("data")

        # (the tracker comes later: it continues the run ids of the checkpoint the models resume from)
        self.models = build_training_models(cfg, ctx, self.total_steps, log=lambda line: self.tracker.log_line(line))
        self.clock.mark("models")
        # the engine on these ranks, or (the split layout) the rollout ranks' rows
        self.remote = RemoteRollout(cfg, ctx) if ctx.split is not None else None
        self.rollout, self.generator = None, None
        if self.remote is None:
            tp_group = build_rollout_tp_group(arr.rollout.tensor_model_parallel_size, tr.n_gpus_per_node)
            self.rollout = make_engine(cfg, arr.model.path, ctx.device, tp_group)
            self.generator = Generator(cfg, self.rollout, self.tokenizer, tools)  # the engine, or the agent loop
        self.clock.mark("engine")
        self.kl_ctrl = algos.make_kl_controller(cfg.algorithm.kl_ctrl)
        self.reward_fn = RewardFunction(cfg.custom_reward_function, (cfg.sandbox, cfg.reward_model.sandbox_fusion))
        self.reward_model = build_reward_model(cfg, ctx, self.tokenizer) if cfg.reward_model.enable else None
        self.clock.mark("rewards")
        self.guard = StabilityGuard(tr.guard)
        # (the rank in trainer.inject_fault is torchrun's: in the split layout, the trainer's and rollout ranks')
        self.faults = FaultInjector(tr.inject_fault, ctx.rank if ctx.split is None else ctx.split.global_rank)
        # verl's ReMax: one greedy response per prompt each step, its score the baseline (phases 2 and 4)
        self.greedy_baseline = ADV_ESTIMATORS[cfg.algorithm.adv_estimator].needs_greedy_baseline
        self.greedy_rows: Optional[list[RolloutRow]] = None
        self.filter_groups = cfg.algorithm.filter_groups.enable  # DAPO's dynamic sampling (phase 2)
        self.overlong = cfg.reward_model.reward_manager == "dapo" and cfg.reward_model.overlong_buffer.enable

        self.step, wandb_id, mlflow_id = 0, None, None
        # each trained model's checkpoint.save_contents / load_contents (verl's)
        sections = {"actor": arr.actor.checkpoint, "critic": cfg.critic.checkpoint}
        self.save_contents = {n: set(c.save_contents) for n, c in sections.items()}
        self.load_contents = {
            n: set(c.load_contents if c.load_contents is not None else c.save_contents) for n, c in sections.items()
        }
        self.resumed_from, extra = ckpt.resume(
            cfg,
            self.run_dir,
            self.models.checkpoint_components(),
            print if ctx.is_main else (lambda *_: None),
            self.load_state_dict,
            load=self.load_contents,
        )
        if self.resumed_from is not None:
            self.step, wandb_id, mlflow_id = extra["global_step"], extra.get("wandb_run_id"), extra.get("mlflow_run_id")
            if "guard" in extra:
                self.guard.load_state_dict(extra["guard"])
                self.apply_guard_scales()
        else:
            torch.manual_seed(tr.seed + ctx.rank)  # the training RNG; generation has its own (rollout/rng.py)
        self.clock.mark("resume")
        self.tracker = Tracker(cfg, self.run_dir, ctx.is_main, self.total_steps, wandb_id=wandb_id, mlflow_id=mlflow_id)
        self.profiler = StepProfiler(cfg, ctx.rank, ctx.device, self.run_dir)
        self.time_model, self.step_plan = time_model(cfg, ctx) if ctx.is_main else None, None
        self.say_layout()
        if self.reward_model is not None and self.val_set and self.val_set[0].reward_style == "model":
            self.val_set = []  # as verl: validation scores with rules only, and these rows have none
            self.tracker.log_line(
                "[rlhf-hpc] validation skipped: data.val_files rows have reward_model.style=model "
                "(verl validates rule-scored data only)"
            )
        if self.resumed_from is not None:
            self.tracker.log_line(f"[rlhf-hpc] resumed from {self.resumed_from} (step {self.step})")
        self.stopper = StopCheck(self.run_dir, cfg.launcher.time_margin_s, all_reduce_max)
        if ctx.is_main:
            (self.run_dir / STOPPED).unlink(missing_ok=True)
        config = self.run_dir / "config.yaml"
        self.config_text = config.read_text() if config.is_file() else None
        self.model_cfg = model_config(arr.model.path, arr.model.override_config)  # for the FLOP count
        # verl's rollout/moe/* load-balance metrics, from the engine's recorded routing, every N steps
        interval = arr.rollout.moe_load_balance_metrics_interval
        self.moe_load = MoELoadCounts(moe_experts(self.model_cfg)[0]) if interval > 0 else None
        self.clock.mark("trackers and plans")
        self.tracker.log_line(f"[rlhf-hpc] {self.clock.line()}")  # (once; its figures in the first step's metrics)

    def say_layout(self) -> None:
        """The layout lines (unless the local launch printed them with the memory plan) and how each
        trained model reduces its gradients."""
        if not os.environ.get(LAYOUT_SHOWN):
            for line in describe_layouts(self.cfg):
                self.tracker.log_line(f"[rlhf-hpc] {line}")
        for name, part in (("actor", self.models.actor), ("critic", self.models.critic)):
            line = describe_gradient_reduction(part.model) if part is not None else None
            if line:
                self.tracker.log_line(f"[rlhf-hpc] {name}: {line}")

    # -------------------------------------------------------------------------- resumable state
    def state_dict(self, step: int) -> dict:
        """Everything a resumed run needs besides the models and optimizers (the checkpoint's extra)."""
        out = {
            "global_step": step,
            "sampler": self.sampler.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "wandb_run_id": self.tracker.wandb_id,
            "mlflow_run_id": self.tracker.mlflow_id,
            "guard": self.guard.state_dict(),
        }
        for name, part in (("actor", self.models.actor), ("critic", self.models.critic)):
            if part is not None and "extra" in self.save_contents[name]:  # (a model's "extra": its LR schedule)
                out[f"{name}_scheduler"] = part.scheduler.state_dict()
        return out

    def load_state_dict(self, extra: dict) -> None:
        """The data position, the KL controller and the LR schedules of ``extra`` (the guard's state
        is loaded by a resume only: a rollback keeps counting its own)."""
        self.sampler.load_state_dict(extra["sampler"])
        self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        for name, part in (("actor", self.models.actor), ("critic", self.models.critic)):
            if part is not None and f"{name}_scheduler" in extra and "extra" in self.load_contents[name]:
                part.scheduler.load_state_dict(extra[f"{name}_scheduler"])

    def restore(self, path: Path) -> dict:
        """Load a checkpoint into the models and the trainer; returns its extra."""
        extra = ckpt.load_checkpoint(path, self.models.checkpoint_components(), load=self.load_contents)
        self.load_state_dict(extra)
        return extra

    def save(self, at_step: int) -> None:
        arr = self.cfg.actor_rollout_ref
        self.last_saved = at_step
        ckpt.save_checkpoint(
            self.run_dir,
            at_step,
            self.models.checkpoint_components(),
            self.state_dict(at_step),
            self.cfg.trainer.max_ckpt_to_keep,
            good=True,
            config_text=self.config_text,
            after_component=self.faults.checkpoint_hook(at_step),
            contents=self.save_contents,
            hf_writer=lambda name, model, out: ckpt.save_hf_model(
                model, arr.model, out, arr.actor.fsdp_config.mixed_precision.param_dtype
            ),
        )

    def apply_guard_scales(self) -> None:
        """The guard's LR and KL scales on the actor: its schedule's base LRs and KL-loss coefficient."""
        self.models.actor.scale(self.guard.lr_scale, self.guard.kl_scale)

    def roll_back(self, at_step: int, reason: str) -> int:
        """The stability guard rejected this step: continue from the last good checkpoint with a
        smaller actor LR (and a stronger KL pull when ``kl_coef_mult`` says so). Returns its step."""
        self.tracker.log_line(f"[rlhf-hpc] step {at_step}: {self.guard.trip(reason)}")
        # (a check on the rollouts judges the previous update: the checkpoint saved after it is not good)
        target = ckpt.choose_resume(self.run_dir, self.tracker.log_line, at_most=at_step - 1 - self.guard.lag)
        if target is None:
            raise GuardStop(
                f"stability guard tripped at step {at_step} ({reason}) with no good checkpoint to go "
                f"back to; set trainer.save_freq (and keep trainer.guard.initial_checkpoint=true)"
            )
        lacking = {
            n: sorted({"model", "optimizer"} - parts)
            for n, parts in ckpt.saved_contents(target).items()
            if not {"model", "optimizer"} <= parts
        }
        if lacking:  # (checkpoint.save_contents without them: the dry run warned)
            raise GuardStop(
                f"stability guard tripped at step {at_step} ({reason}), and {target} cannot be rolled back "
                f"to: it holds no {'; no '.join(f'{n} {p}' for n, ps in lacking.items() for p in ps)} "
                f"state (checkpoint.save_contents)"
            )
        extra = self.restore(target)
        ckpt.mark_latest(self.run_dir, target)
        # the reward's KL coefficient as saved, times the rollbacks' scale since that checkpoint
        self.kl_ctrl.value *= self.guard.kl_scale / extra.get("guard", {}).get("kl_scale", 1.0)
        self.apply_guard_scales()
        back_to = extra["global_step"]
        self.tracker.log_line(f"[rlhf-hpc] rolled back to {target} (step {back_to})")
        return back_to

    # -------------------------------------------------------------------------------- the loop
    def train(self) -> None:
        """Steps until the last one: each validated when due, judged by the guard (a divergent step
        is logged, then undone), checkpointed when due; all ranks stop together on a signal."""
        cfg, tr = self.cfg, self.cfg.trainer
        if tr.val_only:  # verl's evaluation run: the model (or the checkpoint resumed from) validated once
            self.validate_only()
            return
        if self.resumed_from is None and tr.guard.enable and tr.guard.initial_checkpoint and tr.save_freq > 0:
            self.save(0)  # the starting point: what a divergence in the first steps rolls back to
        if self.remote is not None:  # the rollout ranks start from this step's weights and prompts
            self.remote.send_weights(self.models.actor.model, self.step, self.rollout_start())
        if tr.val_before_train and self.val_set and self.step == 0:
            self.tracker.log(self.run_validation(), self.step)
        # its phases against this run's peaks (once)
        plan = check_plan(cfg, device_memory_gb(self.ctx.device))[0] if self.ctx.is_main else None
        first_step = self.step
        timed = False  # the time plan's line: once, at the run's second step (its first warms up)
        metrics, validation = {}, {}  # the last step's, the last validation's (for the closing line)
        while self.step < self.total_steps:
            self.step += 1
            step = self.step
            metrics = self.train_step(step)
            if step == first_step + 1:
                metrics.update(self.clock.metrics())
            # the plan checked by this run. GPU: at its second step (the first has no optimizer state
            # yet). CPU: at its first, as peak RSS only ratchets up (malloc keeps freed heap): later
            # steps show every phase at the first step's peak
            if plan is not None and step >= min(
                first_step + (2 if self.ctx.device.type == "cuda" else 1), self.total_steps
            ):
                line, plan = plan.render_measured(metrics), None  # once
                if line:
                    self.tracker.log_line(f"[rlhf-hpc] {line}")
            if self.step_plan is not None and not timed and step >= min(first_step + 2, self.total_steps):
                timed = True
                line = self.step_plan.render_measured(metrics)
                if line:
                    self.tracker.log_line(
                        f"[rlhf-hpc] {line} (plan on {self.step_plan.hardware.name}; "
                        f"every step logs plan/<phase>_s beside timing_s/<phase>)"
                    )
            # 10. validation
            if self.val_set and tr.test_freq > 0 and (step % tr.test_freq == 0 or step == self.total_steps):
                t0 = time.perf_counter()
                validation = self.run_validation()
                metrics.update(validation)
                metrics["timing_s/testing"] = time.perf_counter() - t0
            # 11. the stability guard: a divergent step is logged, then undone
            reason = self.guard.check(metrics)
            metrics["guard/rollbacks"] = float(self.guard.rollbacks)
            if reason is not None:
                self.tracker.log(
                    {**metrics, "guard/tripped": 1.0, "guard/rollbacks": float(self.guard.rollbacks + 1)}, step
                )
                self.step = self.roll_back(step, reason)
                if self.remote is not None:  # the rollout ranks start again from there
                    self.remote.restart(self.models.actor.model, self.rollout_start())
                continue
            # 12. checkpoint
            saved = tr.save_freq > 0 and (step % tr.save_freq == 0 or step == self.total_steps)
            if saved:
                t0 = time.perf_counter()
                self.save(step)
                metrics["timing_s/save_checkpoint"] = time.perf_counter() - t0
            self.tracker.log(metrics, step)
            # preemption signal, stop request or the end of the allocation: all ranks stop together
            if step < self.total_steps and self.stopper.should_stop(metrics["timing_s/step"]):
                if not saved:
                    self.save(step)
                if self.ctx.is_main:
                    self.stopper.mark_stopped()
                self.tracker.log_line(f"[rlhf-hpc] stopping after step {step}: {self.stopper.reason}; checkpoint saved")
                break
        if self.remote is not None:
            self.remote.stop()  # (rows generated beyond this step are dropped; a resume makes them again)
        if self.step == self.total_steps:  # 13. the run's closing line
            self.tracker.log_line(
                run_summary(
                    self.step,
                    self.total_steps,
                    metrics,
                    validation,
                    time.clock_gettime(time.CLOCK_BOOTTIME) - process_started(),
                    self.run_dir,
                    None if self.last_saved is None else ckpt.step_dir(self.run_dir, self.last_saved),
                )
            )
        self.tracker.close()
        if self.rollout is not None:
            self.rollout.close()

    def run_validation(self) -> dict[str, float]:
        """The validation's metrics; its generations (``trainer.log_val_generations``) go to the tracker."""
        generations: list[dict] = []
        # the split layout: the rollout ranks generate with this step's weights, this rank scores its share
        responses = self.remote.validate(self.models.actor.model, self.step) if self.remote is not None else None
        metrics = run_validation(
            self.cfg,
            self.ctx,
            self.models,
            self.rollout,
            self.val_set,
            self.tokenizer,
            self.reward_fn,
            generations=generations,
            generate=self.generator,
            responses=responses,
        )
        if self.generator is not None:
            self.generator.discard_metrics()
        self.tracker.log_generations(generations, self.step)
        return metrics

    def validate_only(self) -> None:
        """``trainer.val_only``: one validation row at the current step (0, or the step of the
        checkpoint resumed from), then the run ends: no training step, no checkpoint."""
        if self.val_set:  # (the split layout: the rollout ranks generate it with these weights)
            self.tracker.log(self.run_validation(), self.step)
            self.tracker.log_line(f"[rlhf-hpc] trainer.val_only: validated at step {self.step}; no training")
        else:
            self.tracker.log_line("[rlhf-hpc] trainer.val_only: no validation set to evaluate; no training")
        if self.remote is not None:
            self.remote.stop()
        self.tracker.close()
        if self.rollout is not None:
            self.rollout.close()

    # -------------------------------------------------------------------------------- one step
    def train_step(self, step: int) -> dict[str, float]:
        """One step of the algorithm, its phases in order (each timed under ``timing_s/<phase>``);
        returns the step's metrics, global over ranks."""
        cfg, arr, models = self.cfg, self.cfg.actor_rollout_ref, self.models
        timer, metrics = Timer(self.ctx.device), {}
        with self.profiler.step(step, timer), timer("step"), out_of_memory_report(timer, self.ctx.device):
            # 1. weights: training layout -> engine (streamed, bucketed, in place). The split layout sends
            # them to the rollout ranks after the update instead (8)
            if self.remote is None:
                with timer("update_weights"):
                    models.free_gradients()  # then the engine empties PyTorch's cache before waking
                    self.rollout.resume()
                    synced = sync_weights_to_rollout(
                        models.actor.model,
                        self.rollout,
                        torch_dtype(arr.rollout.dtype),
                        arr.rollout.update_weights_bucket_mb,
                        transform=self.faults.weights_transform(step),
                    )
                    metrics["rollout/weight_sync_mib"] = synced["rollout/weight_sync_mib"]
            # 2. rollout: an even share of the step's prompts on each rank, n responses each; with DAPO's
            # dynamic sampling, generation batches until enough groups have signal (generate_filtered).
            # The split layout: the rows the rollout ranks generated for this step, maybe with older weights
            if self.remote is not None:
                batch, rows, prompts = self.receive(step, metrics)
            elif self.filter_groups:
                batch, rows, prompts = self.generate_filtered(step, timer, metrics)
            else:
                batch, rows, prompts = self.generate(step, timer, metrics)
            # 3. old log-probs (the PPO anchor), reference log-probs, values
            entropy = self.log_probs_and_values(batch, step, timer, metrics)
            # 4. rewards: a score per response, on its last valid token
            with timer("reward"):
                batch["token_scores"] = scores_on_last_token(
                    self.score(batch, rows, timer, metrics), batch["response_mask"]
                )
                if self.greedy_baseline:
                    batch["reward_baselines"] = self.baseline_scores(batch, rows, len(prompts), timer, metrics)
            # 5. KL: in the reward (controller) and/or as a loss in the actor update
            if cfg.algorithm.use_kl_in_reward:
                batch["token_rewards"], kl_metrics = algos.apply_kl_to_rewards(
                    batch["token_scores"],
                    batch["old_log_probs"],
                    batch["ref_log_prob"],
                    batch["response_mask"],
                    self.kl_ctrl,
                    cfg.algorithm.kl_penalty,
                    all_reduce=all_reduce_sum,
                )
                metrics.update(kl_metrics)
            else:
                batch["token_rewards"] = batch["token_scores"]
            # 6. advantages (a prompt's responses may sit on several ranks: group statistics are global),
            # after the rollout correction's weights and rejections (verl's decoupled mode); with PF-PPO,
            # the step's rows then resampled by their scores
            with timer("adv"):
                models.actor.correction.before_advantages(batch, metrics)
                batch["advantages"], batch["returns"] = compute_advantages(
                    cfg.algorithm,
                    AdvantageInputs(
                        batch["token_rewards"],
                        batch["response_mask"].float(),
                        batch["uid"],
                        num_groups=len(prompts),
                        values=batch.get("values"),
                        all_reduce=all_reduce_sum,
                        all_reduce_max=all_reduce_max,
                        reward_baselines=batch.get("reward_baselines"),
                        old_log_probs=batch.get("old_log_probs"),
                        sum_pi_squared=batch.get("sum_pi_squared"),
                        rollout_is_weights=batch.get("rollout_is_weights"),
                        reward_components=batch.get("reward_components"),
                    ),
                )
                if cfg.algorithm.use_pf_ppo:  # PF-PPO: the rows resampled by their scores, over all ranks
                    pf, gen = cfg.algorithm.pf_ppo, torch.Generator().manual_seed(step_seed(cfg.trainer.seed, step, -1))
                    batch = resample_rows(
                        batch,
                        lambda scores: pf_ppo_indices(scores, pf.reweight_method, pf.weight_pow, gen),
                        self.ctx.world_size,
                        self.ctx.rank,
                    )
            # 7. critic, then 8. actor; the split layout: then the weights to the rollout ranks when due
            self.update(batch, step, timer, metrics)
            if self.remote is not None:
                with timer("update_weights"):
                    metrics.update(self.remote.after_update(models.actor.model, step, self.total_steps))
        # 9. metrics (global over ranks)
        metrics.update(data_metrics(batch, entropy, models.critic is not None))
        if self.moe_load is not None:
            metrics.update(self.moe_load_metrics(batch, step))
        # entropy_coeff=0: the update computes no entropy; as verl, the old-log-prob pass reports it
        if "actor/rollout_entropy/mean" in metrics:
            metrics.setdefault("actor/entropy", metrics["actor/rollout_entropy/mean"])
        metrics.update(timer.times)
        if "timing_s/wait_rows" in metrics:  # the split layout: the share of the step spent waiting for rows
            metrics["async/trainer_idle_share"] = metrics["timing_s/wait_rows"] / metrics["timing_s/step"]
        metrics.update(self.profiler.metrics(timer.times, self.tracker.log_line))
        metrics.update(perf_metrics(cfg, self.ctx, batch, timer, self.model_cfg))
        if self.time_model is not None:  # the time plan of this step's own lengths, beside what it took
            self.step_plan = self.time_model.plan_step(metrics, batch["attention_mask"].shape[1])
            metrics.update(self.step_plan.metrics())
        metrics["training/epoch"] = self.sampler.epoch
        return metrics

    def rollout_start(self) -> dict:
        """The split layout's rollout ranks start (or restart) at this step with this sampler."""
        return {"step": self.step, "total": self.total_steps, "sampler": self.sampler.state_dict()}

    def receive(self, step: int, metrics: dict) -> tuple[dict, list[RolloutRow], list[int]]:
        """Phase 2 of the split layout: the step's rows from the rollout ranks, this rank's share of
        them (as ``generate`` redistributes them), and the staleness and overlap figures."""
        prompts = self.sampler.next_batch()
        message, figures = self.remote.receive(step, prompts)
        metrics.update(figures)
        self.models.actor.correction.stale = figures["rollout/staleness/max"] > 0
        rows, balance = share_rows(message.rows, self.ctx.world_size, self.ctx.rank, self.cfg.trainer.balance_batch)
        metrics.update(balance)
        metrics.update(coverage([r.prompt_pos for r in rows], len(prompts)))
        return make_step_batch(self.cfg, self.tokenizer, rows), rows, prompts

    def moe_load_metrics(self, batch: dict, step: int) -> dict:
        """This step's response-token routing counted over every rank into the interval's; its
        metrics on the interval's last step (verl's: the steps a multiple of the interval)."""
        routed = batch["routed_experts"]
        counts = response_load_counts(routed, batch["response_mask"], self.moe_load.experts)
        if counts is None:  # (a rank without a counted token still joins the sum)
            counts = torch.zeros(routed.shape[2], self.moe_load.experts, dtype=torch.long)
        self.moe_load.add(all_reduce_sum(counts))
        if step % self.cfg.actor_rollout_ref.rollout.moe_load_balance_metrics_interval:
            return {}
        return self.moe_load.pop_metrics()

    def generate(self, step: int, timer: Timer, metrics: dict) -> tuple[dict, list[RolloutRow], list[int]]:
        """This rank's share of the step's prompts through the engine; the responses redistributed
        so every rank trains on the same number of rows (``balance_batch`` evens out their tokens).
        Returns (the step batch, its rows, the step's prompts as dataset indices)."""
        cfg, ctx, tr = self.cfg, self.ctx, self.cfg.trainer
        prompts = self.sampler.next_batch()
        mine = prompt_share(len(prompts), ctx.world_size, ctx.rank)
        with timer("gen"):
            responses = self.generator(
                [self.train_set[prompts[p]] for p in mine],
                sampling_for(cfg, self.tokenizer, seed=step_seed(tr.seed, step, self.rollout.dp_rank)),
            )
        if self.greedy_baseline:  # verl's "gen_max": the greedy response to each of this rank's prompts
            with timer("gen_max"):
                greedy = self.generator(
                    [self.train_set[prompts[p]] for p in mine], sampling_for(cfg, self.tokenizer, greedy=True)
                )
            self.greedy_rows = rollout_rows(self.train_set, prompts, mine, greedy)
        metrics.update(self.generator.metrics())
        with timer("gen"):  # the engine's sleep is generation's, as verl times it
            self.rollout.release()
        self.faults.after_generation(step)
        rows, balance = redistribute_rows(
            rollout_rows(self.train_set, prompts, mine, responses), ctx.world_size, ctx.rank, tr.balance_batch
        )
        metrics.update(balance)
        metrics.update(coverage([r.prompt_pos for r in rows], len(prompts)))
        return make_step_batch(cfg, self.tokenizer, rows), rows, prompts

    def generate_filtered(self, step: int, timer: Timer, metrics: dict) -> tuple[dict, list[RolloutRow], list[int]]:
        """Phase 2 with DAPO's dynamic sampling (``algorithm.filter_groups``): generation batches of
        ``data.gen_batch_size`` prompts (every rank its share), each scored, its groups whose metric
        has zero variance dropped by the same decision on every rank (``ppo/dynamic_sampling.py``),
        until ``data.train_batch_size`` prompts are kept; then as ``generate``: redistributed rows."""
        cfg, ctx, tr = self.cfg, self.ctx, self.cfg.trainer
        fg, size = cfg.algorithm.filter_groups, cfg.data.gen_batch_size or cfg.data.train_batch_size

        def generate_batch(k: int) -> tuple[list[int], list[RolloutRow]]:
            prompts = self.sampler.next_prompts(size)
            mine = prompt_share(len(prompts), ctx.world_size, ctx.rank)
            seed = gen_seed(tr.seed, step, k, self.rollout.dp_rank, step_seed(tr.seed, step, self.rollout.dp_rank))
            with timer("gen"):
                responses = self.generator(
                    [self.train_set[prompts[p]] for p in mine], sampling_for(cfg, self.tokenizer, seed=seed)
                )
            return prompts, rollout_rows(self.train_set, prompts, mine, responses)

        def metric_values(rows: list[RolloutRow]) -> torch.Tensor:
            if not rows:
                return torch.zeros(0)
            with timer("reward"):
                batch = make_step_batch(cfg, self.tokenizer, rows)
                scores = score_responses(self.reward_fn, self.tokenizer, self.train_set, rows, batch)
                if fg.metric in ("seq_reward", "seq_final_reward") and self.overlong:
                    scores = self.shape_overlong(scores, batch, None)
            return scores

        collected = collect_groups(
            generate_batch,
            metric_values,
            cfg.data.train_batch_size,
            cfg.actor_rollout_ref.rollout.n,
            fg.max_num_gen_batches,
            all_reduce_sum,
        )
        metrics.update(self.generator.metrics())
        with timer("gen"):
            self.rollout.release()
        self.faults.after_generation(step)
        rows, balance = redistribute_rows(collected.rows, ctx.world_size, ctx.rank, tr.balance_batch)
        metrics.update(balance)
        metrics.update(collected.metrics)
        metrics.update(coverage([r.prompt_pos for r in rows], len(collected.prompts)))
        return make_step_batch(cfg, self.tokenizer, rows), rows, collected.prompts

    def shape_overlong(self, scores: torch.Tensor, batch: dict, metrics: Optional[dict]) -> torch.Tensor:
        """(B,) the scores plus the dapo reward manager's overlong penalty (``reward_model.overlong_buffer``;
        ``rewards/overlong.py``), logged where ``overlong_buffer.log`` and ``metrics`` say so (collective)."""
        ob = self.cfg.reward_model.overlong_buffer
        # (the whole response, tool turns included, as verl's dapo manager measures it)
        penalty = overlong_reward(response_spans(batch), self.cfg.data.max_response_length, ob.len, ob.penalty_factor)
        if ob.log and metrics is not None:
            metrics.update(overlong_metrics(penalty, all_reduce_sum))
        return scores + penalty

    def log_probs_and_values(self, batch: dict, step: int, timer: Timer, metrics: dict) -> Optional[torch.Tensor]:
        """``old_log_probs``: the actor's, or in verl's bypass mode the engine's own (no forward
        pass; the engine check then runs on the update's first mini-batch); ``ref_log_prob`` and
        ``values`` where there is a reference and a critic. Returns the rollout's entropy (or None)."""
        models, shape = self.models, self.shape
        entropy = None
        if models.actor.correction.anchor == "pass":  # (else the engine's, or the on-policy update's forward)
            # router_replay R2: the actor's own routing here, replayed in the update's forwards
            routing = [] if models.actor.routing is not None and models.actor.spec.routing == "record" else None
            with timer("old_log_prob"):
                batch["old_log_probs"], entropy, *sum_pi_squared = models.actor.compute_log_prob(
                    batch,
                    shape.old_log_prob.micro_rows,
                    shape.old_log_prob.dynamic,
                    shape.old_log_prob.token_budget,
                    with_entropy=True,
                    with_sum_pi_squared=self.cfg.actor_rollout_ref.actor.calculate_sum_pi_squared,
                    routing_out=routing,
                )
                if sum_pi_squared:  # (the Optimal Token Baseline's: estimators with needs_sum_pi_squared)
                    batch["sum_pi_squared"] = sum_pi_squared[0]
                if routing:
                    batch["actor_routed_experts"] = routing[0]
            routing_agreement(models.actor, metrics, batch)
        models.actor.correction.after_old_log_probs(batch, step, metrics)  # bypass: the engine's; else its check
        if models.ref is not None:
            with timer("ref"):
                batch["ref_log_prob"], _ = models.ref.compute_log_prob(
                    batch, shape.ref.micro_rows, shape.ref.dynamic, shape.ref.token_budget
                )
        if models.critic is not None:
            with timer("values"):
                batch["values"] = models.critic.compute_values(batch, shape.values.micro_rows)
        return entropy

    def score(
        self, batch: dict, rows: list[RolloutRow], timer: Timer, metrics: dict, log_overlong: bool = True
    ) -> torch.Tensor:
        """(B,) a score per response: the reward model's where there is one (it replaces the rule or
        custom score, as verl's naive and dapo reward managers), else the reward function's (the dapo
        manager's overlong shaping added; logged, a collective, where ``log_overlong``)."""
        if self.reward_model is None:
            alg = self.cfg.algorithm
            keys = (
                tuple(alg.gdpo_reward_keys or ()) if ADV_ESTIMATORS[alg.adv_estimator].needs_reward_components else ()
            )
            scores = score_responses(self.reward_fn, self.tokenizer, self.train_set, rows, batch, keys)
            return self.shape_overlong(scores, batch, metrics if log_overlong else None) if self.overlong else scores
        with timer("reward_model"):
            scores = self.reward_model.score(batch, [self.train_set[r.example].messages for r in rows])
        metrics.update(reduce_stats({"reward_model/score": scores}))
        return scores

    def baseline_scores(
        self, batch: dict, rows: list[RolloutRow], num_prompts: int, timer: Timer, metrics: dict
    ) -> torch.Tensor:
        """(B,) the score of the greedy response to each row's prompt (``batch["uid"]``): this rank
        scores the greedy responses to the prompts it generated for (as the sampled ones: reward
        model or reward function), and the scores of all prompts are summed over ranks. Logs
        ``reward/greedy_baseline/mean``."""
        greedy, self.greedy_rows = self.greedy_rows, None
        table = torch.zeros(num_prompts, dtype=torch.float64)
        if greedy:
            scores = self.score(
                make_step_batch(self.cfg, self.tokenizer, greedy), greedy, timer, {}, log_overlong=False
            )
            table[torch.tensor([r.prompt_pos for r in greedy], dtype=torch.long)] = scores.double()
        elif self.reward_model is not None:  # no prompt here: the reward model's collectives still need this rank
            self.score(select_rows(batch, [0]), rows[:1], timer, {})
        table = all_reduce_sum(table)
        metrics["reward/greedy_baseline/mean"] = float(table.mean()) if num_prompts else 0.0
        return table[batch["uid"].long()].float()

    def update(self, batch: dict, step: int, timer: Timer, metrics: dict) -> None:
        """The critic's update, then the actor's; as verl, the actor waits while
        ``trainer.critic_warmup`` > step."""
        models = self.models
        if models.critic is not None:
            with timer("update_critic"):
                metrics.update(models.critic.update_critic(batch, self.shape.update_critic.mini_rows, seed=step))
        if self.cfg.trainer.critic_warmup > step:
            return
        with timer("update_actor"), self.faults.around_actor_update(step, models.actor.optimizer, batch):
            metrics.update(models.actor.update_policy(batch, self.shape.update_actor.mini_rows, seed=step))
            metrics["actor/kl_coef"] = models.actor.kl_loss_coef
        routing_agreement(models.actor, metrics, batch)  # (where no old-log-prob pass ran: the update's forwards)
        models.actor.correction.after_update(batch, step, metrics)  # bypass, on-policy: the check on that forward


# ----------------------------------------------------------------------------------- pieces
@contextlib.contextmanager
def out_of_memory_report(timer: Timer, device: torch.device):
    """An out-of-memory error names the phase, the peak and the keys that shrink that phase."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        raise RuntimeError(oom_message(timer.current, peak, str(device))) from e


if os.environ.get("TOKENIZERS_PARALLELISM") is None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def routing_agreement(actor, metrics: dict, batch: dict) -> None:
    """``rollout/router_topk_agreement``: the share of (token, layer) pairs whose experts the actor's
    own router would have chosen as the engine did, over every rank, from the step's first actor
    pass (the old-log-prob pass where one runs, else the update's forwards). Where the engine did
    not record its routing (router_replay R2 alone) there is nothing to compare with."""
    if actor.routing is None:
        return
    agreed, counted = actor.routing.take_agreement()
    if "rollout/router_topk_agreement" in metrics or "routed_experts" not in batch:
        return
    total = all_reduce_sum(torch.tensor([agreed, counted], dtype=torch.float64))
    metrics["rollout/router_topk_agreement"] = float(total[0] / total[1]) if total[1] else 1.0

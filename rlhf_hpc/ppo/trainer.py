"""The KL-PPO training loop, SPMD on every rank.

``PPOTrainer.train_step`` is the algorithm written down: sync weights -> generate -> old/ref
log-probs and values -> rewards -> KL -> rollout correction and advantages -> critic update ->
actor update -> metrics; ``train`` adds validation, the guard and checkpoints. Each rank generates for an even share of a step's prompts (``rollout.n`` responses
each); the responses are then redistributed so every rank trains on ``train_batch_size * n / ranks``
rows, balanced by token count (``rlhf_hpc.distributed.rows``). Everything global (normalisation,
whitening, group statistics, KL controller, metrics) goes through all-reduces, so every rank takes
the same decisions.

The step batch (one dict of tensors, rows = this rank's responses):

    input_ids, attention_mask, position_ids   (B, P + R)  prompt left-padded, response right-padded
    responses, response_mask                  (B, R)
    engine_log_probs                          (B, R)  from the rollout engine (sampling dist.)
    uid                                       (B,)    the prompt's position in the step (its group)
    old_log_probs, ref_log_prob, values       (B, R)  actor / reference / critic before the update
    token_scores, token_rewards               (B, R)  score on the last valid token; minus KL if in reward
    advantages, returns                       (B, R)
    rollout_is_weights                        (B, R)  rollout correction's IS weights (rollout_is set)
    sampled_response_mask                     (B, R)  the mask as sampled, when rollout_rs rejected tokens
"""
from __future__ import annotations

import contextlib
import math
import os
import time
import zlib
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_hpc.ops import algos
from rlhf_hpc.ppo import checkpoint as ckpt
from rlhf_hpc.ops.batching import make_padded_batch, per_rank_mini_batch
from rlhf_hpc.ops.rollout_correction import rollout_correction
from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.data.dataset import Example, StatefulSampler, load_examples
from rlhf_hpc.distributed.process_group import (DistContext, all_reduce_max, all_reduce_min, all_reduce_sum,
                                                build_rollout_tp_group)
from rlhf_hpc.distributed.rows import RolloutRow, coverage, prompt_share, redistribute_rows
from rlhf_hpc.ppo.training_models import TrainingModels, build_training_models
from rlhf_hpc.ppo.faults import FaultInjector
from rlhf_hpc.launch.local import LAYOUT_SHOWN
from rlhf_hpc.launch.stop import STOPPED, StopCheck
from rlhf_hpc.planning.layout import describe as describe_layouts
from rlhf_hpc.planning.memory_plan import check_plan
from rlhf_hpc.planning.time_plan import TimeModel
from rlhf_hpc.ppo.guard import StabilityGuard
from rlhf_hpc.models.hf import model_config, torch_dtype
from rlhf_hpc.distributed.fsdp import describe_gradient_reduction
from rlhf_hpc.observability.perf import Timer, memory_metrics, model_flops, peak_flops
from rlhf_hpc.observability.profiling import StepProfiler
from rlhf_hpc.rollout.weight_sync import sync_weights_to_rollout
from rlhf_hpc.rewards import RewardFunction
from rlhf_hpc.rewards.reward_model import build_reward_model
from rlhf_hpc.rollout.base import LogprobCheck, Sampling, logprob_mismatch
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.models.tokenizer import load_tokenizer, stop_token_ids, tokenizer_path
from rlhf_hpc.observability.tracking import Tracker


def fit(cfg: Config, ctx: DistContext) -> None:
    """Train until ``trainer.total_training_steps`` (or ``total_epochs``) on every rank."""
    PPOTrainer(cfg, ctx).train()


class PPOTrainer:
    """The loop on one rank. ``__init__`` builds the models, the rollout engine, the data and the trackers
    and resumes from a checkpoint where there is one; ``train`` runs the steps with validation, the
    stability guard, checkpoints and stops; ``train_step`` is one step of the algorithm, phase by
    phase. ``state_dict`` / ``load_state_dict`` are the one list of resumable state besides the
    models' own (``TrainingModels.checkpoint_components``). The guard's scales are trainer state: applied to
    the actor's LR schedule and KL-loss coefficient, never written into the config."""

    def __init__(self, cfg: Config, ctx: DistContext):
        tr, arr = cfg.trainer, cfg.actor_rollout_ref
        self.cfg, self.ctx = cfg, ctx
        self.run_dir = Path(tr.default_local_dir).expanduser()
        torch.manual_seed(tr.seed)
        self.tokenizer = load_tokenizer(tokenizer_path(cfg), arr.model.trust_remote_code, arr.model.custom_chat_template)
        self.train_set = load_examples(cfg.data.train_files, self.tokenizer, cfg.data, split_seed=cfg.data.seed)
        self.val_set = (load_examples(cfg.data.val_files, self.tokenizer, cfg.data, split_seed=cfg.data.seed + 1)
                        if cfg.data.val_files else [])
        self.sampler = StatefulSampler(len(self.train_set), cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle)
        self.total_steps = tr.total_training_steps or self.sampler.batches_per_epoch * tr.total_epochs

        self.models = build_training_models(cfg, ctx, self.total_steps)
        tp_group = build_rollout_tp_group(arr.rollout.tensor_model_parallel_size, tr.n_gpus_per_node)
        self.rollout = make_engine(cfg, arr.model.path, ctx.device, tp_group)
        self.kl_ctrl = algos.make_kl_controller(cfg.algorithm.kl_ctrl)
        self.reward_fn = RewardFunction(cfg)
        self.reward_model = build_reward_model(cfg, ctx, self.tokenizer) if cfg.reward_model.enable else None
        self.logprob_check = LogprobCheck(arr.rollout.dtype, arr.actor.fsdp_config.mixed_precision.param_dtype)
        self.guard = StabilityGuard(tr.guard)
        self.faults = FaultInjector(tr.inject_fault, ctx.rank)
        # the actor's settings before any rollback scaled them
        self.base_lrs = list(self.models.actor.scheduler.base_lrs)
        self.base_kl_loss_coef = arr.actor.kl_loss_coef

        self.step, wandb_id, mlflow_id = 0, None, None
        self.resumed_from = find_resume_checkpoint(cfg, self.run_dir, log=print if ctx.is_main else (lambda *_: None))
        if self.resumed_from is not None:
            extra = self.restore(self.resumed_from)
            self.step, wandb_id, mlflow_id = extra["global_step"], extra.get("wandb_run_id"), extra.get("mlflow_run_id")
            if "guard" in extra:
                self.guard.load_state_dict(extra["guard"])
                self.apply_guard_scales()
        else:
            torch.manual_seed(tr.seed + ctx.rank)  # the training RNG; generation has its own (rollout/rng.py)
        self.tracker = Tracker(cfg, self.run_dir, ctx.is_main, self.total_steps, wandb_id=wandb_id, mlflow_id=mlflow_id)
        self.profiler = StepProfiler(cfg, ctx.rank, ctx.device, self.run_dir)
        self.time_model, self.step_plan = time_model(cfg, ctx) if ctx.is_main else None, None
        self.say_layout()
        if self.reward_model is not None and self.val_set and self.val_set[0].reward_style == "model":
            self.val_set = []  # as verl: validation scores with rules only, and these rows have none
            self.tracker.log_line("[rlhf-hpc] validation skipped: data.val_files rows have reward_model.style=model "
                                  "(verl validates rule-scored data only)")
        if self.resumed_from is not None:
            self.tracker.log_line(f"[rlhf-hpc] resumed from {self.resumed_from} (step {self.step})")
        self.stopper = StopCheck(self.run_dir, cfg.launcher.time_margin_s, all_reduce_max)
        if ctx.is_main:
            (self.run_dir / STOPPED).unlink(missing_ok=True)
        config = self.run_dir / "config.yaml"
        self.config_text = config.read_text() if config.is_file() else None
        self.model_cfg = model_config(arr.model.path, arr.model.override_config)  # for the FLOP count

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
        out = {"global_step": step, "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
               "actor_scheduler": self.models.actor.scheduler.state_dict(), "wandb_run_id": self.tracker.wandb_id,
               "mlflow_run_id": self.tracker.mlflow_id, "guard": self.guard.state_dict()}
        if self.models.critic is not None:
            out["critic_scheduler"] = self.models.critic.scheduler.state_dict()
        return out

    def load_state_dict(self, extra: dict) -> None:
        """The data position, the KL controller and the LR schedules of ``extra`` (the guard's state
        is loaded by a resume only: a rollback keeps counting its own)."""
        self.sampler.load_state_dict(extra["sampler"])
        self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        self.models.actor.scheduler.load_state_dict(extra["actor_scheduler"])
        if self.models.critic is not None:
            self.models.critic.scheduler.load_state_dict(extra["critic_scheduler"])

    def restore(self, path: Path) -> dict:
        """Load a checkpoint into the models and the trainer; returns its extra."""
        extra = ckpt.load_checkpoint(path, self.models.checkpoint_components())
        self.load_state_dict(extra)
        return extra

    def save(self, at_step: int) -> None:
        ckpt.save_checkpoint(self.run_dir, at_step, self.models.checkpoint_components(), self.state_dict(at_step),
                             self.cfg.trainer.max_ckpt_to_keep, good=True, config_text=self.config_text,
                             after_component=self.faults.checkpoint_hook(at_step))

    def apply_guard_scales(self) -> None:
        """The guard's LR and KL scales on the actor: its schedule's base LRs and KL-loss coefficient."""
        actor = self.models.actor
        sched = actor.scheduler
        sched.base_lrs = [lr * self.guard.lr_scale for lr in self.base_lrs]
        for group, base, fn in zip(actor.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * fn(sched.last_epoch)
        actor.kl_loss_coef = self.base_kl_loss_coef * self.guard.kl_scale

    def roll_back(self, at_step: int, reason: str) -> int:
        """The stability guard rejected this step: continue from the last good checkpoint with a
        smaller actor LR (and a stronger KL pull when ``kl_coef_mult`` says so). Returns its step."""
        self.tracker.log_line(f"[rlhf-hpc] step {at_step}: {self.guard.trip(reason)}")
        # (a check on the rollouts judges the previous update: the checkpoint saved after it is not good)
        target = ckpt.choose_resume(self.run_dir, self.tracker.log_line, at_most=at_step - 1 - self.guard.lag)
        if target is None:
            raise RuntimeError(f"stability guard tripped at step {at_step} ({reason}) with no good checkpoint to go "
                               f"back to; set trainer.save_freq (and keep trainer.guard.initial_checkpoint=true)")
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
        if self.resumed_from is None and tr.guard.enable and tr.guard.initial_checkpoint and tr.save_freq > 0:
            self.save(0)  # the starting point: what a divergence in the first steps rolls back to
        if tr.val_before_train and self.val_set and self.step == 0:
            self.tracker.log(self.validate(), self.step)
        plan = check_plan(cfg)[0] if self.ctx.is_main else None  # its phases against this run's peaks (once)
        first_step = self.step
        timed = False  # the time plan's line: once, at the run's second step (its first warms up)
        while self.step < self.total_steps:
            self.step += 1
            step = self.step
            metrics = self.train_step(step)
            # the plan checked by this run. GPU: at its second step (the first has no optimizer state
            # yet). CPU: at its first, as peak RSS only ratchets up (malloc keeps freed heap): later
            # steps show every phase at the first step's peak
            if plan is not None and step >= min(first_step + (2 if self.ctx.device.type == "cuda" else 1),
                                                self.total_steps):
                line, plan = plan.render_measured(metrics), None  # once
                if line:
                    self.tracker.log_line(f"[rlhf-hpc] {line}")
            if self.step_plan is not None and not timed and step >= min(first_step + 2, self.total_steps):
                timed = True
                line = self.step_plan.render_measured(metrics)
                if line:
                    self.tracker.log_line(f"[rlhf-hpc] {line} (plan on {self.step_plan.hardware.name}; "
                                          f"every step logs plan/<phase>_s beside timing_s/<phase>)")
            # 10. validation
            if self.val_set and tr.test_freq > 0 and (step % tr.test_freq == 0 or step == self.total_steps):
                t0 = time.perf_counter()
                metrics.update(self.validate())
                metrics["timing_s/testing"] = time.perf_counter() - t0
            # 11. the stability guard: a divergent step is logged, then undone
            reason = self.guard.check(metrics)
            metrics["guard/rollbacks"] = float(self.guard.rollbacks)
            if reason is not None:
                self.tracker.log({**metrics, "guard/tripped": 1.0, "guard/rollbacks": float(self.guard.rollbacks + 1)},
                                 step)
                self.step = self.roll_back(step, reason)
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
        self.tracker.close()
        self.rollout.close()

    def validate(self) -> dict[str, float]:
        return validate(self.cfg, self.ctx, self.models, self.rollout, self.val_set, self.tokenizer, self.reward_fn)

    # -------------------------------------------------------------------------------- one step
    def train_step(self, step: int) -> dict[str, float]:
        """One step of the algorithm, its phases in order (each timed under ``timing_s/<phase>``);
        returns the step's metrics, global over ranks."""
        cfg, arr, models = self.cfg, self.cfg.actor_rollout_ref, self.models
        timer, metrics = Timer(self.ctx.device), {}
        with self.profiler.step(step, timer), timer("step"), out_of_memory_report(timer, self.ctx.device):
            # 1. weights: training layout -> engine (streamed, bucketed, in place)
            with timer("update_weights"):
                models.free_gradients()  # then the engine empties PyTorch's cache before waking
                self.rollout.resume()
                synced = sync_weights_to_rollout(models.actor.model, self.rollout, torch_dtype(arr.rollout.dtype),
                                                 arr.rollout.update_weights_bucket_mb,
                                                 transform=self.faults.weights_transform(step))
                metrics["rollout/weight_sync_mib"] = synced["rollout/weight_sync_mib"]
            # 2. rollout: an even share of the step's prompts on each rank, n responses each
            batch, rows, prompts = self.generate(step, timer, metrics)
            # 3. old log-probs (the PPO anchor), reference log-probs, values
            entropy = self.log_probs_and_values(batch, step, timer, metrics)
            # 4. rewards: a score per response, on its last valid token
            with timer("reward"):
                batch["token_scores"] = scores_on_last_token(self.score(batch, rows, timer, metrics),
                                                             batch["response_mask"])
            # 5. KL: in the reward (controller) and/or as a loss in the actor update
            if cfg.algorithm.use_kl_in_reward:
                batch["token_rewards"], kl_metrics = algos.apply_kl_to_rewards(
                    batch["token_scores"], batch["old_log_probs"], batch["ref_log_prob"], batch["response_mask"],
                    self.kl_ctrl, cfg.algorithm.kl_penalty, all_reduce=all_reduce_sum)
                metrics.update(kl_metrics)
            else:
                batch["token_rewards"] = batch["token_scores"]
            # 6. advantages (a prompt's responses may sit on several ranks: group statistics are global),
            # after the rollout correction's weights and rejections (verl's decoupled mode)
            with timer("adv"):
                self.correct_rollout(batch, metrics)
                batch["advantages"], batch["returns"] = compute_advantages(cfg, batch, num_groups=len(prompts))
            # 7. critic, then 8. actor
            self.update(batch, step, timer, metrics)
        # 9. metrics (global over ranks)
        metrics.update(data_metrics(batch, entropy, models.critic is not None))
        # entropy_coeff=0: the update computes no entropy; as verl, the old-log-prob pass reports it
        if "actor/rollout_entropy/mean" in metrics:
            metrics.setdefault("actor/entropy", metrics["actor/rollout_entropy/mean"])
        metrics.update(timer.times)
        metrics.update(self.profiler.metrics(timer.times, self.tracker.log_line))
        metrics.update(perf_metrics(cfg, self.ctx, batch, timer, self.model_cfg))
        if self.time_model is not None:  # the time plan of this step's own lengths, beside what it took
            self.step_plan = self.time_model.plan_step(metrics, batch["attention_mask"].shape[1])
            metrics.update(self.step_plan.metrics())
        metrics["training/epoch"] = self.sampler.epoch
        return metrics

    def generate(self, step: int, timer: Timer, metrics: dict) -> tuple[dict, list[RolloutRow], list[int]]:
        """This rank's share of the step's prompts through the engine; the responses redistributed
        so every rank trains on the same number of rows (``balance_batch`` evens out their tokens).
        Returns (the step batch, its rows, the step's prompts as dataset indices)."""
        cfg, ctx, tr = self.cfg, self.ctx, self.cfg.trainer
        prompts = self.sampler.next_batch()
        mine = prompt_share(len(prompts), ctx.world_size, ctx.rank)
        with timer("gen"):
            responses = self.rollout.generate([self.train_set[prompts[p]].prompt_ids for p in mine],
                                              sampling_for(cfg, self.tokenizer,
                                                           seed=step_seed(tr.seed, step, self.rollout.dp_rank)))
        self.rollout.release()
        self.faults.after_generation(step)
        rows, balance = redistribute_rows(rollout_rows(self.train_set, prompts, mine, responses), ctx.world_size,
                                          ctx.rank, tr.balance_batch)
        metrics.update(balance)
        metrics.update(coverage([r.prompt_pos for r in rows], len(prompts)))
        return make_step_batch(cfg, self.tokenizer, rows), rows, prompts

    def log_probs_and_values(self, batch: dict, step: int, timer: Timer, metrics: dict) -> Optional[torch.Tensor]:
        """``old_log_probs``: the actor's, or in verl's bypass mode the engine's own (no forward
        pass; the engine check then runs on the update's first mini-batch); ``ref_log_prob`` and
        ``values`` where there is a reference and a critic. Returns the rollout's entropy (or None)."""
        arr, models = self.cfg.actor_rollout_ref, self.models
        entropy = None
        if self.cfg.algorithm.rollout_correction.bypass_mode:
            batch["old_log_probs"] = batch["engine_log_probs"].clone()
        else:
            with timer("old_log_prob"):
                batch["old_log_probs"], entropy = models.actor.compute_log_prob(
                    batch, arr.rollout.log_prob_micro_batch_size_per_gpu, arr.rollout.log_prob_use_dynamic_bsz,
                    arr.rollout.log_prob_max_token_len_per_gpu, with_entropy=True)
            self.check_engine(batch["engine_log_probs"], batch["old_log_probs"], batch["response_mask"], step, metrics)
        if models.ref is not None:
            with timer("ref"):
                batch["ref_log_prob"], _ = models.ref.compute_log_prob(
                    batch, arr.ref.log_prob_micro_batch_size_per_gpu, arr.ref.log_prob_use_dynamic_bsz,
                    arr.ref.log_prob_max_token_len_per_gpu)
        if models.critic is not None:
            with timer("values"):
                batch["values"] = models.critic.compute_values(batch, self.cfg.critic.ppo_micro_batch_size_per_gpu)
        return entropy

    def check_engine(self, engine_lp: torch.Tensor, actor_lp: torch.Tensor, mask: torch.Tensor, step: int,
                     metrics: dict) -> None:
        """The standing rollout/actor log-prob check on the same tokens; raises when the engine is
        broken (rollout.base.LogprobCheck)."""
        metrics.update(logprob_mismatch(engine_lp, actor_lp, mask, all_reduce_sum, all_reduce_max))
        warning = self.logprob_check(metrics, step)
        if warning and self.ctx.is_main:
            self.tracker.log_line(f"[rlhf-hpc] WARNING {warning}")

    def correct_rollout(self, batch: dict, metrics: dict) -> None:
        """verl's rollout correction in decoupled mode, over the whole step (global over ranks): IS
        weights pi_old / pi_rollout (``rollout_is_weights``, (B, R), into the actor's loss), the response
        mask after rejection sampling, and the ``rollout_corr/`` metrics. In bypass mode the update
        corrects each micro-batch against the current policy instead (``Actor.update_policy``)."""
        rc = self.cfg.algorithm.rollout_correction
        if rc.bypass_mode:
            return
        weights, mask, corr = rollout_correction(batch["old_log_probs"], batch["engine_log_probs"],
                                                 batch["response_mask"], rc, all_reduce_sum, all_reduce_max)
        if rc.rollout_rs is not None:  # lengths stay those sampled (data_metrics); training sees the rest
            if all_reduce_sum(mask.sum().double().reshape(1)).item() == 0:  # (global: every rank stops here)
                raise ConfigError(
                    f"algorithm.rollout_correction.rollout_rs={rc.rollout_rs} rejected every response token of the "
                    f"step (rollout_corr/k3_kl {corr['rollout_corr/k3_kl']:.3g}, kl {corr['rollout_corr/kl']:.3g} between "
                    f"the actor and the engine): loosen rollout_rs_threshold={rc.rollout_rs_threshold}")
            batch["sampled_response_mask"], batch["response_mask"] = batch["response_mask"], mask
        if weights is not None:
            batch["rollout_is_weights"] = weights
        metrics.update(corr)

    def score(self, batch: dict, rows: list[RolloutRow], timer: Timer, metrics: dict) -> torch.Tensor:
        """(B,) a score per response: the reward model's where there is one (it replaces the rule or
        custom score, as verl's naive reward manager), else the reward function's."""
        if self.reward_model is None:
            return score_responses(self.reward_fn, self.tokenizer, self.train_set, rows, batch)
        with timer("reward_model"):
            scores = self.reward_model.score(batch, [self.train_set[r.example].messages for r in rows])
        metrics.update(reduce_stats({"reward_model/score": scores}))
        return scores

    def update(self, batch: dict, step: int, timer: Timer, metrics: dict) -> None:
        """The critic's update, then the actor's; as verl, the actor waits while
        ``trainer.critic_warmup`` > step."""
        arr, models, world = self.cfg.actor_rollout_ref, self.models, self.ctx.world_size
        if models.critic is not None:
            with timer("update_critic"):
                metrics.update(models.critic.update_critic(
                    batch, per_rank_mini_batch(self.cfg.critic.ppo_mini_batch_size, arr.rollout.n, world), seed=step))
        if self.cfg.trainer.critic_warmup > step:
            return
        bypass = self.cfg.algorithm.rollout_correction.bypass_mode
        pre_update = [] if bypass else None
        with timer("update_actor"), self.faults.around_actor_update(step, models.actor.optimizer, batch):
            metrics.update(models.actor.update_policy(
                batch, per_rank_mini_batch(arr.actor.ppo_mini_batch_size, arr.rollout.n, world),
                seed=step, pre_update_sample=pre_update))
            metrics["actor/kl_coef"] = models.actor.kl_loss_coef
        if bypass:
            self.check_engine(*(torch.cat(t) for t in zip(*pre_update)), step, metrics)


# ----------------------------------------------------------------------------------- pieces
@contextlib.contextmanager
def out_of_memory_report(timer: Timer, device: torch.device):
    """An out-of-memory error names the phase, the peak and the keys that shrink that phase."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        from rlhf_hpc.planning.memory_plan import oom_message
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
        raise RuntimeError(oom_message(timer.current, peak, str(device))) from e


def find_resume_checkpoint(cfg: Config, run_dir: Path, log=print) -> Optional[Path]:
    mode = cfg.trainer.resume_mode
    if mode == "disable":
        return None
    if mode == "auto":
        path = ckpt.choose_resume(run_dir, log)
    else:
        path = Path(mode).expanduser()
        problem = ckpt.verify_checkpoint(path)
        if problem:
            raise RuntimeError(f"trainer.resume_mode: {path} is not a usable checkpoint: {problem}")
    if path is not None:
        ckpt.check_resume_compatible(path, cfg)
    return path


def rollout_rows(train: list[Example], prompts: list[int], mine: range, responses) -> list[RolloutRow]:
    """This rank's generated responses as rows: ``responses[i]`` answers prompt ``mine[i]`` of the
    step (``prompts`` holds the step's dataset indices)."""
    return [RolloutRow(prompt_pos=pos, example=prompts[pos], prompt_ids=train[prompts[pos]].prompt_ids,
                       token_ids=list(r.token_ids), logprobs=list(r.logprobs), finish_reason=r.finish_reason)
            for pos, group in zip(mine, responses) for r in group]


def step_seed(seed: int, step: int, dp_rank: int) -> int:
    """Sampling seed of a step on a rollout data-parallel rank (the engine's ``dp_rank``: the ranks
    of one tensor-parallel group share it): a resumed run draws exactly the same rollouts."""
    return zlib.crc32(f"{seed}/{step}/{dp_rank}".encode()) & 0x7FFFFFFF


def sampling_for(cfg: Config, tokenizer, seed: Optional[int] = None, validation: bool = False) -> Sampling:
    r = cfg.actor_rollout_ref.rollout
    stops = stop_token_ids(tokenizer, cfg.actor_rollout_ref.model.path)
    if validation:
        v = r.val_kwargs
        return Sampling(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k, do_sample=v.do_sample,
                        max_tokens=cfg.data.max_response_length, stop_token_ids=stops, ignore_eos=r.ignore_eos,
                        seed=seed)
    return Sampling(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, do_sample=r.do_sample,
                    max_tokens=cfg.data.max_response_length, stop_token_ids=stops, ignore_eos=r.ignore_eos, seed=seed)


def make_step_batch(cfg: Config, tokenizer, rows: list[RolloutRow]) -> dict:
    """This rank's rows -> the padded step batch; ``uid`` is the prompt's position in the step."""
    P, R = cfg.data.max_prompt_length, cfg.data.max_response_length
    batch = make_padded_batch([r.prompt_ids for r in rows], [r.token_ids[:R] for r in rows],
                              tokenizer.pad_token_id or 0, P, R)
    engine_lp = torch.zeros(len(rows), R)
    for i, r in enumerate(rows):
        lp = r.logprobs[:R]
        engine_lp[i, :len(lp)] = torch.tensor(lp)
    batch["engine_log_probs"] = engine_lp
    batch["uid"] = torch.tensor([r.prompt_pos for r in rows])
    return batch


def score_responses(reward_fn: RewardFunction, tokenizer, train: list[Example], rows: list[RolloutRow],
                    batch: dict) -> torch.Tensor:
    """(B,) rule/custom scores of the decoded responses."""
    scores = []
    for i, row in enumerate(rows):
        n = int(batch["response_mask"][i].sum())
        text = tokenizer.decode(batch["responses"][i, :n].tolist(), skip_special_tokens=True)
        ex = train[row.example]
        scores.append(reward_fn(ex.data_source, text, ex.ground_truth, ex.extra_info, row=ex.index))
    return torch.tensor(scores, dtype=torch.float32)


def scores_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) scores -> (B, R) with each score on its row's last valid response token."""
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32)
    lengths = response_mask.sum(-1).long()
    has = lengths > 0
    token_scores[has.nonzero().squeeze(-1), (lengths[has] - 1)] = scores[has]
    return token_scores


def compute_advantages(cfg: Config, batch: dict, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), (B, R) each. ``batch["uid"]`` is each row's group (its prompt's
    position in the step, ``0..num_groups-1``); group statistics are reduced over all ranks."""
    a, mask, rewards = cfg.algorithm, batch["response_mask"].float(), batch["token_rewards"]
    if a.adv_estimator == "gae":
        adv, ret = algos.gae_advantages(rewards, batch["values"], mask, a.gamma, a.lam)
        # whitened over the global batch (the reference whitens inside its GAE)
        return algos.masked_whiten(adv, mask, all_reduce=all_reduce_sum) * mask, ret
    index, groups = batch["uid"], dict(all_reduce=all_reduce_sum, num_groups=num_groups)
    if a.adv_estimator == "grpo":
        return algos.grpo_advantages(rewards, mask, index, norm_by_std=a.norm_adv_by_std_in_grpo, **groups)
    if a.adv_estimator == "rloo":
        return algos.rloo_advantages(rewards, mask, index, **groups)
    if a.adv_estimator == "reinforce_plus_plus":
        return algos.reinforce_pp_advantages(rewards, mask, a.gamma, all_reduce=all_reduce_sum)
    return algos.reinforce_pp_baseline_advantages(rewards, mask, index, **groups)


def reduce_stats(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """``{name: 1-D tensor}`` -> name/mean, name/max, name/min over all ranks (three all-reduces)."""
    names = sorted(values)
    sums = torch.tensor([[values[n].double().sum().item(), float(values[n].numel())] for n in names], dtype=torch.float64)
    maxs = torch.tensor([values[n].max().item() if values[n].numel() else -math.inf for n in names], dtype=torch.float64)
    mins = torch.tensor([values[n].min().item() if values[n].numel() else math.inf for n in names], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        sums = all_reduce_sum(sums)
        maxs, mins = -all_reduce_min(-maxs), all_reduce_min(mins)
    out = {}
    for i, n in enumerate(names):
        out[f"{n}/mean"] = (sums[i, 0] / max(sums[i, 1], 1.0)).item()
        out[f"{n}/max"], out[f"{n}/min"] = maxs[i].item(), mins[i].item()
    return out


def data_metrics(batch: dict, entropy: Optional[torch.Tensor], use_critic: bool) -> dict[str, float]:
    """The reference's per-step data metrics, global over ranks. Lengths are of the responses as
    sampled; advantages, returns and values over the tokens trained (after rejection sampling)."""
    mask = batch["response_mask"].bool()
    resp_len = batch.get("sampled_response_mask", batch["response_mask"]).sum(-1).float()
    prompt_len = batch["attention_mask"].sum(-1).float() - resp_len
    R, P = mask.shape[1], batch["attention_mask"].shape[1] - mask.shape[1]
    values = {"critic/score": batch["token_scores"].sum(-1), "critic/rewards": batch["token_rewards"].sum(-1),
              "critic/advantages": batch["advantages"][mask], "critic/returns": batch["returns"][mask],
              "response_length": resp_len, "prompt_length": prompt_len}
    if entropy is not None:  # None in bypass mode (no old-log-prob pass)
        values["actor/rollout_entropy"] = entropy[mask]
    if use_critic:
        values["critic/values"] = batch["values"][mask]
    out = reduce_stats(values)
    clipped = all_reduce_sum(torch.tensor([(resp_len >= R).sum().item(), (prompt_len >= P).sum().item(),
                                           float(len(resp_len))], dtype=torch.float64))
    out["response_length/clip_ratio"] = (clipped[0] / clipped[2]).item()
    out["prompt_length/clip_ratio"] = (clipped[1] / clipped[2]).item()
    if use_critic:
        # explained variance of the returns by the values (1 = perfect value function)
        ret, val = batch["returns"][mask].double(), batch["values"][mask].double()
        s = all_reduce_sum(torch.stack([ret.sum(), (ret ** 2).sum(), (ret - val).sum(), ((ret - val) ** 2).sum(),
                                        torch.tensor(float(ret.numel()), dtype=torch.float64)]))
        n = max(s[4].item(), 1.0)
        var_ret = s[1].item() / n - (s[0].item() / n) ** 2
        var_err = s[3].item() / n - (s[2].item() / n) ** 2
        out["critic/vf_explained_var"] = 1.0 - var_err / (var_ret + 1e-8)
    # KL between the rollout policy and the reference, mean and variance over tokens
    if "ref_log_prob" in batch:
        kl = algos.kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], "kl")[mask].double()
        s = all_reduce_sum(torch.stack([kl.sum(), (kl ** 2).sum(), torch.tensor(float(kl.numel()), dtype=torch.float64)]))
        n = max(s[2].item(), 1.0)
        out["actor/ref_kl_mean"] = s[0].item() / n
        out["actor/ref_kl_var"] = s[1].item() / n - (s[0].item() / n) ** 2
    return out


def time_model(cfg: Config, ctx: DistContext) -> Optional[TimeModel]:
    """The time plan's model of this run on its own GPU (or this CPU's calibration); None where the
    model's shape cannot be read."""
    try:
        return TimeModel(cfg, device_name=torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None)
    except (FileNotFoundError, OSError, ValueError):
        return None


def perf_metrics(cfg: Config, ctx: DistContext, batch: dict, timer: Timer, model_cfg) -> dict[str, float]:
    times = timer.times
    # forward FLOPs of this rank's sequences (logits only on response tokens), summed over ranks
    local = torch.tensor([float(batch["attention_mask"].sum()),
                          model_flops(model_cfg, batch["attention_mask"].sum(-1).tolist(),
                                      float(batch["response_mask"].sum()))], dtype=torch.float64)
    tokens, fwd_flops = all_reduce_sum(local).tolist()
    step_s = times.get("timing_s/step", 0.0)
    out = {"perf/total_num_tokens": tokens, "perf/time_per_step": step_s,
           "perf/throughput": tokens / max(step_s, 1e-9) / ctx.world_size}
    update_s = times.get("timing_s/update_actor")
    if update_s:
        # forward + backward = 3 x forward, per epoch
        flops = 3 * fwd_flops * cfg.actor_rollout_ref.actor.ppo_epochs
        out["perf/mfu/actor"] = flops / update_s / (peak_flops(ctx.device, cfg.trainer.peak_tflops) * ctx.world_size)
    # memory: the largest rank's (what has to fit), run and phase peaks in one all-reduce
    mem = {**memory_metrics(ctx.device), **timer.peaks}
    names = sorted(mem)
    out.update(zip(names, all_reduce_max(torch.tensor([mem[n] for n in names], dtype=torch.float64)).tolist()))
    return out


def validate(cfg: Config, ctx: DistContext, models: TrainingModels, rollout, val: list[Example], tokenizer,
             reward_fn: RewardFunction) -> dict[str, float]:
    """Generate for the whole validation set (``rollout.val_kwargs``; greedy by default) and report
    the mean score per data source as ``val-core/<data_source>/reward/mean@<n>``. As in verl,
    ``data.val_batch_size`` only sets how many prompts go to the engine at once (all at once when
    null); each such chunk is split evenly over the ranks."""
    arr = cfg.actor_rollout_ref
    rollout.resume()
    sync_weights_to_rollout(models.actor.model, rollout, torch_dtype(arr.rollout.dtype), arr.rollout.update_weights_bucket_mb)
    sources = sorted({e.data_source for e in val})
    sums = torch.zeros(len(sources), 2, dtype=torch.float64)
    chunk = cfg.data.val_batch_size or len(val)
    for c, start in enumerate(range(0, len(val), chunk)):
        part = val[start:start + chunk]
        mine = [part[i] for i in prompt_share(len(part), ctx.world_size, ctx.rank)]
        sampling = sampling_for(cfg, tokenizer, seed=step_seed(cfg.trainer.seed, -1 - c, rollout.dp_rank),
                                validation=True)
        outs = rollout.generate([e.prompt_ids for e in mine], sampling)
        for ex, group in zip(mine, outs):
            for r in group:
                text = tokenizer.decode(r.token_ids, skip_special_tokens=True)
                score = reward_fn(ex.data_source, text, ex.ground_truth, ex.extra_info, row=ex.index)
                sums[sources.index(ex.data_source)] += torch.tensor([score, 1.0], dtype=torch.float64)
    rollout.release()
    sums = all_reduce_sum(sums)
    n = arr.rollout.val_kwargs.n
    return {f"val-core/{s}/reward/mean@{n}": (sums[i, 0] / max(sums[i, 1].item(), 1.0)).item()
            for i, s in enumerate(sources)}


if os.environ.get("TOKENIZERS_PARALLELISM") is None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

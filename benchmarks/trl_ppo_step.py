"""The same PPO workload as ``benchmarks.ppo_step``, run by TRL's ``PPOTrainer`` for comparison.

TRL is never a dependency of this project: ``--setup VENV`` creates a virtual environment with
TRL (and the CPU torch wheel) beside it; ``benchmarks.ppo_step --vs-trl VENV`` then runs both
trainers side by side. Run alone, this script is what each of the 2 ranks executes there:

    VENV/bin/python -m torch.distributed.run --nproc-per-node 2 benchmarks/trl_ppo_step.py WORKDIR

``WORKDIR`` holds ``workload.json`` (model shape, prompts, batch sizes), written by ppo_step. TRL's
loop has no phase timers; its three phases are timed by wrapping the functions its loop calls
(``batch_generation``; ``forward`` and ``get_reward`` without gradients for the reference, value
and reward-model passes: its training loop calls ``forward`` too, with gradients), and training is
the rest of the step. The dtype the policy's matrix products run in while it trains is reported
(bf16 under ``bf16=True``: accelerate's autocast). Only this script touches TRL's module.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

__all__: list[str] = []  # a script: nothing here is imported elsewhere

TRL_REQUIREMENTS = [
    "torch==2.13.0",
    "trl==1.12.0",
    "transformers==5.19.0",
    "requests",
]  # (GRPOTrainer imports requests)


def setup(venv: Path) -> None:
    """A virtual environment with TRL, apart from the project's (the CPU torch wheel, as CI)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *TRL_REQUIREMENTS], check=True)


def main(workdir: Path) -> None:
    import torch
    import trl.experimental.ppo.ppo_trainer as ppo_module
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        Qwen2Config,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    w = json.loads((workdir / "workload.json").read_text())
    torch.manual_seed(0)
    config = Qwen2Config(**w["model"])
    policy = AutoModelForCausalLM.from_config(config)
    ref = AutoModelForCausalLM.from_config(config)
    ref.load_state_dict(policy.state_dict())
    value, reward = (
        AutoModelForSequenceClassification.from_config(Qwen2Config(**w["model"], num_labels=1)) for _ in range(2)
    )
    tokenizer = AutoTokenizer.from_pretrained(workdir / "tokenizer")
    for m in (policy, ref, value, reward):
        m.config.pad_token_id = tokenizer.pad_token_id
    prompts = Dataset.from_dict({"input_ids": w["prompts"]})

    times: dict[str, list[float]] = {"gen": [], "forward": []}
    current = {"gen": 0.0, "forward": 0.0}

    def timed(fn, phase):
        def wrapper(*args, **kwargs):
            if phase == "forward" and torch.is_grad_enabled():
                return fn(*args, **kwargs)  # the training loop calls forward too: that is training
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[phase] += time.perf_counter() - t0

        return wrapper

    ppo_module.batch_generation = timed(ppo_module.batch_generation, "gen")
    ppo_module.forward = timed(ppo_module.forward, "forward")
    ppo_module.get_reward = timed(ppo_module.get_reward, "forward")
    # the dtype the policy's matrix products run in while it trains (bf16 under TRL's bf16=True)
    compute_dtypes: set[str] = set()
    policy.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda mod, inp, out: compute_dtypes.add(str(out.dtype)) if torch.is_grad_enabled() else None
    )

    steps: list[float] = []

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            t = time.perf_counter()
            steps.append(t - self.t0)
            self.t0 = t
            for k in current:
                times[k].append(current[k])
                current[k] = 0.0

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # TRL: a rank's rollout batch is per_device_train_batch_size x gradient_accumulation_steps, split
    # into num_mini_batches, each an optimizer step; with accumulation 1 a mini-batch is one pass
    args = PPOConfig(
        output_dir=str(workdir / "trl-out"),
        report_to=[],
        use_cpu=True,
        bf16=w.get("bf16", False),
        fp16=False,
        per_device_train_batch_size=w["train_batch_size"] // world,
        gradient_accumulation_steps=1,
        num_mini_batches=w["train_batch_size"] // w["mini_batch_size"],
        num_ppo_epochs=1,
        total_episodes=w["train_batch_size"] * w["steps"],
        local_rollout_forward_batch_size=w["train_batch_size"] // world,
        response_length=w["response_length"],
        stop_token=None,
        temperature=1.0,
        learning_rate=1e-6,
        num_sample_generations=0,
        save_strategy="no",
        logging_steps=1000,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=prompts,
        callbacks=[StepTimes()],
    )
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        skip = 2
        gen = statistics.median(times["gen"][skip:])
        fwd = statistics.median(times["forward"][skip:])
        step = statistics.median(steps[skip:])
        training = statistics.median(
            s - g - f for s, g, f in zip(steps[skip:], times["gen"][skip:], times["forward"][skip:])
        )
        (workdir / "trl.json").write_text(
            json.dumps(
                {
                    "step": step,
                    "generation (incl. weight sync)": gen,
                    "forward passes before the update": fwd,
                    "training (critic + actor update)": training,
                    "steps": len(steps),
                    "policy compute dtype": sorted(compute_dtypes),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--setup":
        setup(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]))

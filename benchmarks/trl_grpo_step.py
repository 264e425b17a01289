"""The quick start's real GRPO job (``smollm2_add_grpo``) run by TRL's ``GRPOTrainer``, for
``benchmarks.grpo_step --vs-trl VENV``, which writes the workload and runs this script on 2
ranks in TRL's own virtual environment (made by ``python -m benchmarks.trl_ppo_step --setup VENV``):

    VENV/bin/python -m torch.distributed.run --nproc-per-node 2 benchmarks/trl_grpo_step.py WORKDIR

``WORKDIR/workload.json`` holds the model directory, the prompts in this project's sampler order
(each step's 16, as chat messages), their ground truths and the settings. Matched to the project's
run: the same checkpoint with fp32 master weights under bf16 autocast and the reference in bf16;
4 responses per prompt, at most 32 new tokens, temperature 1 without top-k/top-p; one optimizer step
per batch (on-policy: no old-log-prob pass, as the project's); token-mean loss over the batch (TRL's
``dapo``, verl's ``token-mean``); KL to the reference as a loss (k3 = ``low_var_kl``, 0.001); group
std-normalised advantages; AdamW at a constant 1e-5 with weight decay 0.01 and gradients clipped at
1; the score is the project's own ``addition_score`` (loaded from its file: no project install here).

TRL has no phase timers: its generation (``_generate``), its log-prob passes without gradients
(``_get_per_token_logps_and_entropies``: the reference) and its scoring (``_calculate_rewards``) are
timed by wrapping those methods on the trainer; training is the rest of the step.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

__all__: list[str] = []  # a script: nothing here is imported elsewhere

SCORES = Path(__file__).resolve().parents[1] / "rewards" / "synthetic.py"


def main(workdir: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    w = json.loads((workdir / "workload.json").read_text())
    spec = importlib.util.spec_from_file_location("project_scores", SCORES)
    scores = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scores)

    def addition_reward(completions, ground_truth, **_):
        return [
            scores.addition_score(c[-1]["content"] if isinstance(c, list) else c, g)
            for c, g in zip(completions, ground_truth)
        ]

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rows = w["train_batch_size"] * w["n"]
    args = GRPOConfig(
        output_dir=str(workdir / "trl-out"),
        report_to=[],
        use_cpu=True,
        bf16=True,
        seed=0,
        dataloader_num_workers=0,
        per_device_train_batch_size=rows // world,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=w["n"],
        max_completion_length=w["response_length"],
        shuffle_dataset=False,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=w["kl_coef"],
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=w["lr"],
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_steps=w["steps"],
        save_strategy="no",
        logging_steps=1,
        disable_dropout=True,
    )
    data = Dataset.from_dict({"prompt": w["prompts"], "ground_truth": w["ground_truths"]})
    trainer = GRPOTrainer(model=w["model"], reward_funcs=addition_reward, args=args, train_dataset=data)
    if trainer.ref_model is not None:  # the project keeps its frozen reference in bf16
        trainer.ref_model.to(torch.bfloat16)

    current = {"gen": 0.0, "log_probs": 0.0, "reward": 0.0}
    times: dict[str, list[float]] = {k: [] for k in current}

    def timed(name: str, phase: str, only_without_grad: bool = False):
        fn = getattr(trainer, name)

        def wrapper(*a, **kw):
            if only_without_grad and torch.is_grad_enabled():
                return fn(*a, **kw)  # the update's own forward: training
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                current[phase] += time.perf_counter() - t0

        setattr(trainer, name, wrapper)

    timed("_generate", "gen")
    timed("_get_per_token_logps_and_entropies", "log_probs", only_without_grad=True)
    timed("_calculate_rewards", "reward")
    # the dtype the policy's matrix products run in while it trains (bf16: accelerate's autocast)
    compute_dtypes: set[str] = set()
    trainer.model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda mod, inp, out: compute_dtypes.add(str(out.dtype)) if torch.is_grad_enabled() else None
    )

    steps: list[float] = []
    rewards: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            steps.append(time.perf_counter() - self.t0)
            for k in current:
                times[k].append(current[k])
                current[k] = 0.0

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    trainer.add_callback(StepTimes())
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        skip = min(2, len(steps) - 1)
        step = statistics.median(steps[skip:])
        phases = {k: statistics.median(v[skip:]) for k, v in times.items()}
        training = statistics.median(s - sum(times[k][i] for k in times) for i, s in enumerate(steps) if i >= skip)
        (workdir / "trl.json").write_text(
            json.dumps(
                {
                    "step": step,
                    **phases,
                    "training": training,
                    "steps": steps,
                    "rewards": rewards,
                    "policy compute dtype": sorted(compute_dtypes),
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))

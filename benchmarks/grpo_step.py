"""The quick start's real GRPO job (``smollm2_add_grpo``: SmolLM2-135M-Instruct learns single-digit
addition, 16 prompts x 4 responses, 32 new tokens, 2 CPU ranks, bf16), step by step, and side by
side with TRL's ``GRPOTrainer`` on the same job in one invocation:

    python -m benchmarks.trl_ppo_step --setup ../trl-venv     # TRL 1.12 in its own venv, once
    python -m benchmarks.grpo_step [--steps 8] [--vs-trl ../trl-venv] [--before ../before]

The project runs ``launch.py recipe=smollm2_add_grpo`` (no validation, no checkpoints) and reads its
per-phase timers; TRL runs ``benchmarks/trl_grpo_step.py`` on the same prompts in the project's
sampler order (checked: TRL's chat template gives the token ids the project trains on), with the
settings matched there. ``--before DIR``: a checkout of an earlier commit runs the same job first
(its own ``launch.py`` and package, this venv). Each phase is the median over the steps after the
first two; the score of every step is printed for each (the learning curves to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rlhf_hpc.data.dataset import StatefulSampler, load_examples
from rlhf_hpc.models.tokenizer import load_tokenizer, tokenizer_path
from rlhf_hpc.recipe.load import load_config

__all__: list[str] = []  # a script: nothing here is imported elsewhere

RECIPE = "smollm2_add_grpo"
ROOT = Path(__file__).resolve().parents[2]
SKIP = 2  # warm-up steps left out of the medians
# (the row of the table, the project's timers summed into it, TRL's figure)
PHASES = [
    ("generation", ("timing_s/gen",), "gen"),
    ("log-prob passes before the update (old, reference)", ("timing_s/old_log_prob", "timing_s/ref"), "log_probs"),
    ("scoring", ("timing_s/reward",), "reward"),
    ("update (forward, backward, optimizer)", ("timing_s/update_actor",), "training"),
    ("weight sync into the engine", ("timing_s/update_weights",), None),
    ("step", ("timing_s/step",), "step"),
]


def overrides(steps: int, run_dir: Path) -> list[str]:
    return [
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
    ]


def project_run(steps: int, run_dir: Path, root: Path = ROOT) -> tuple[dict[str, float], list[float]]:
    """(median seconds per row of PHASES, the score of each step) of the project's run, from the
    checkout at ``root``."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, str(root / "launch.py"), f"recipe={RECIPE}", *overrides(steps, run_dir)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"the project's run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    phases = {
        name: statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows[SKIP:]) for name, keys, _ in PHASES
    }
    return phases, [r["critic/score/mean"] for r in rows]


def trl_workload(steps: int, workdir: Path) -> None:
    """workload.json for trl_grpo_step: the project's prompts in its sampler's order, checked to
    encode through the model's chat template (as TRL applies it) to the ids the project trains on."""
    from transformers import AutoTokenizer

    cfg = load_config(RECIPE, overrides(steps, workdir / "unused"))[0]
    tokenizer = load_tokenizer(tokenizer_path(cfg))
    examples = load_examples(cfg.data.train_files, tokenizer, cfg.data, split_seed=cfg.data.seed)
    sampler = StatefulSampler(len(examples), cfg.data.train_batch_size, cfg.data.seed, cfg.data.shuffle)
    chosen = [examples[i] for _ in range(steps) for i in sampler.next_batch()]
    model_dir = str(Path(cfg.actor_rollout_ref.model.path).expanduser())
    theirs = AutoTokenizer.from_pretrained(model_dir)
    for e in chosen:
        ids = theirs.apply_chat_template(e.messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        if list(ids["input_ids"]) != list(e.prompt_ids):
            sys.exit(f"TRL's prompt differs from the project's for {e.messages}")
    arr = cfg.actor_rollout_ref
    (workdir / "workload.json").write_text(
        json.dumps(
            {
                "model": model_dir,
                "prompts": [e.messages for e in chosen],
                "ground_truths": [e.ground_truth for e in chosen],
                "steps": steps,
                "train_batch_size": cfg.data.train_batch_size,
                "n": arr.rollout.n,
                "response_length": cfg.data.max_response_length,
                "kl_coef": arr.actor.kl_loss_coef,
                "lr": arr.actor.optim.lr,
            }
        )
    )


def trl_run(venv: Path, steps: int, workdir: Path) -> tuple[dict[str, float], list[float]]:
    trl_workload(steps, workdir)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(Path(__file__).with_name("trl_grpo_step.py")),
            str(workdir),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"the TRL run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    figures = json.loads((workdir / "trl.json").read_text())
    print(
        f"TRL: the policy trained with its matrix products in {', '.join(figures['policy compute dtype'])}", flush=True
    )
    return {name: figures[key] for name, _, key in PHASES if key}, figures["rewards"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--vs-trl", metavar="VENV", type=Path, help="TRL's virtual environment: run it on the same job")
    ap.add_argument(
        "--before", metavar="DIR", type=Path, help="a checkout of an earlier commit: run it on the same job"
    )
    args = ap.parse_args()
    if args.steps <= SKIP:
        ap.error(f"--steps must be more than the {SKIP} warm-up steps")
    with tempfile.TemporaryDirectory() as tmp:
        columns = {}
        if args.before:
            columns["before"] = project_run(args.steps, Path(tmp) / "before", args.before.resolve())
        columns["this project"] = project_run(args.steps, Path(tmp) / "project")
        if args.vs_trl:
            columns["TRL GRPOTrainer"] = trl_run(args.vs_trl, args.steps, Path(tmp))
    print(f"{RECIPE}, {args.steps} steps; median seconds of steps {SKIP + 1}-{args.steps}")
    print("| phase | " + " | ".join(columns) + " |")
    print("| --- |" + " --- |" * len(columns))
    for name, _, _ in PHASES:
        print(
            f"| {name} | " + " | ".join(f"{c[0][name]:.2f}" if name in c[0] else "-" for c in columns.values()) + " |"
        )
    for who, (_, scores) in columns.items():
        print(f"score per step, {who}: " + " ".join(f"{s:.3f}" for s in scores))
    if args.vs_trl:
        trl = columns["TRL GRPOTrainer"][0]["step"]
        for who in [w for w in columns if w != "TRL GRPOTrainer"]:
            print(f"{who}: {trl / columns[who][0]['step']:.2f}x TRL's speed per step")


if __name__ == "__main__":
    main()

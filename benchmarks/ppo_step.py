"""Seconds per KL-PPO step, per phase, on a fixed CPU workload: the real trainer (``launch.py``), run
for a few steps, timed by its own ``timing_s/*`` metrics.

    python -m benchmarks.ppo_step [--steps 8] [--repeat N] [--vs-trl VENV] [--before CHECKOUT]
        [--variant LABEL:k=v,k=v] [--demo] [--bf16] [key=value ...]

Side by side in one run (columns take turns when repeated): TRL's ``PPOTrainer`` on the same work
(``--vs-trl``, from its own virtual environment: ``python -m benchmarks.trl_ppo_step --setup
VENV``), an older checkout of this project (``--before``, e.g. a git worktree), this checkout, and
variants of its configuration.

The workload (issue #19, also what ``benchmarks/trl_ppo_step.py`` runs through TRL): a
Qwen2-shaped model of hidden 512, 4 layers, 8 heads / 2 KV heads, intermediate 1408, vocabulary
8000, untied embeddings (19.5M parameters), random weights; 64 prompts of 26 tokens per step
(``synthetic://copy``), exactly 32 new tokens each (EOS ignored); 1 PPO epoch of 4 mini-batches for
the actor and the critic; critic, reference and KL in the reward on; fp32 on 2 ranks x 1 thread
(gloo). Extra ``key=value`` arguments override the recipe (e.g. ``actor_rollout_ref.actor.fsdp_config.fsdp_size=1``
to compare layouts). The figure per phase is the median over steps 3..N (the first two warm up).
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

from rlhf_hpc.config.schema import DataConfig
from rlhf_hpc.data.dataset import load_examples
from rlhf_hpc.models.hf import tiny_fields
from rlhf_hpc.models.tokenizer import load_tokenizer

__all__ = ["MODEL", "REPO", "WORKLOAD", "model_shape", "run"]

MODEL = (
    "tiny://qwen2?hidden_size=512&num_hidden_layers=4&num_attention_heads=8&num_key_value_heads=2"
    "&intermediate_size=1408&vocab_size=8000"
)

WORKLOAD = [
    "data.train_files=synthetic://copy?size=1024",
    "data.val_files=null",
    "data.train_batch_size=64",
    "data.max_prompt_length=32",
    "data.max_response_length=32",
    f"actor_rollout_ref.model.path={MODEL}",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_epochs=1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
    "actor_rollout_ref.rollout.n=1",
    "actor_rollout_ref.rollout.ignore_eos=true",
    "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
    "critic.ppo_mini_batch_size=16",
    "critic.ppo_epochs=1",
    "algorithm.adv_estimator=gae",
    "algorithm.use_kl_in_reward=true",
    "trainer.save_freq=0",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
    "trainer.n_gpus_per_node=2",
    "trainer.guard.enable=false",
]

# the project's defaults (bf16 compute on fp32 master weights, bf16 rollout), which the tiny recipe
# pins to fp32; TRL's counterpart is its bf16=True (autocast)
BF16 = [
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bfloat16",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bfloat16",
    "critic.model.fsdp_config.mixed_precision.param_dtype=bfloat16",
    "actor_rollout_ref.rollout.dtype=bfloat16",
]

# what TRL's PPOTrainer calls its phases, and the trainer's timers that do the same work
PHASES = {
    "step": ["timing_s/step"],
    "generation (incl. weight sync)": ["timing_s/update_weights", "timing_s/gen"],
    "forward passes before the update": ["timing_s/old_log_prob", "timing_s/ref", "timing_s/values"],
    "training (critic + actor update)": ["timing_s/update_critic", "timing_s/update_actor"],
}


REPO = Path(__file__).resolve().parents[2]


def run(steps: int, overrides: list[str], run_dir: Path, repo: Path = REPO, demo: bool = False) -> list[dict]:
    """Train ``steps`` steps of the workload (``demo``: the tiny demo recipe as it is) into
    ``run_dir`` with the checkout at ``repo`` (this one, or e.g. a git worktree of an older
    commit); its metrics rows."""
    workload = ["trainer.save_freq=0", "trainer.test_freq=0"] if demo else WORKLOAD
    cmd = [
        sys.executable,
        "launch.py",
        "recipe=tiny_klppo",
        *workload,
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.logger=[console]",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def phase_times(rows: list[dict], skip: int = 2) -> dict[str, float]:
    """Median seconds per phase over the rows after the first ``skip`` steps; also every timer."""
    rows = rows[skip:]
    out = {}
    for phase, keys in PHASES.items():
        out[phase] = statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows)
    for key in sorted({k for r in rows for k in r if k.startswith("timing_s/")}):
        out[key] = statistics.median(r.get(key, 0.0) for r in rows)
    return out


def model_shape() -> dict:
    """The workload model's Qwen2 config fields (``MODEL``'s query over the tiny defaults)."""
    return tiny_fields(MODEL)[1]


def trl_workload(workdir: Path, steps: int, bf16: bool = False) -> None:
    """workload.json and the tokenizer for ``trl_ppo_step``: the same model shape, prompts (the
    project's own synthetic://copy prompts, chat-formatted: 26 tokens) and batch sizes."""
    tokenizer = load_tokenizer("tiny://chars")
    tokenizer.save_pretrained(workdir / "tokenizer")
    shape = model_shape()
    examples = load_examples("synthetic://copy?size=1024", tokenizer, DataConfig(max_prompt_length=32))
    workload = {
        "model": shape,
        "prompts": [e.prompt_ids for e in examples[: 64 * steps]],
        "steps": steps,
        "train_batch_size": 64,
        "mini_batch_size": 16,
        "response_length": 32,
        "bf16": bf16,
    }
    (workdir / "workload.json").write_text(json.dumps(workload))


def run_trl(venv: Path, steps: int, workdir: Path, bf16: bool = False) -> dict[str, float]:
    trl_workload(workdir, steps, bf16)
    script = Path(__file__).with_name("trl_ppo_step.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)
    if bf16:  # TRL's PPOTrainer builds its Accelerator without bf16=True: accelerate reads it from here
        env["ACCELERATE_MIXED_PRECISION"] = "bf16"
    proc = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
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
        f"TRL: the policy trained with its matrix products in {', '.join(figures.pop('policy compute dtype'))}",
        flush=True,
    )
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--label", default="rlhf-hpc")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument(
        "--vs-trl",
        metavar="VENV",
        type=Path,
        help="also run TRL's PPOTrainer on the same work from this virtual environment (create it with "
        "python -m benchmarks.trl_ppo_step --setup VENV) and print both side by side",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:k=v,k=v",
        help="one more configuration of this project to time in the same run",
    )
    ap.add_argument("--repeat", type=int, default=1, help="run every column this many times, in turns")
    ap.add_argument(
        "--demo",
        action="store_true",
        help="time the tiny demo (recipe tiny_klppo as it is) instead of the issue-19 workload",
    )
    ap.add_argument(
        "--before",
        metavar="CHECKOUT",
        type=Path,
        help="also time this checkout of the project (e.g. a git worktree of an older commit)",
    )
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="every column in bf16 mixed precision: this project with its default precision (bf16 "
        "compute, fp32 master weights and gradient reduction, bf16 rollout), TRL with bf16=True",
    )
    ap.add_argument("overrides", nargs="*", help="recipe key=value overrides")
    args = ap.parse_args()
    given = list(args.overrides)
    if args.bf16:
        args.overrides = BF16 + args.overrides
    columns: dict[str, dict[str, float]] = {}

    def keep(label: str, figures: dict[str, float]) -> None:
        # over repeats, each figure's best (the least disturbed by other load on the machine)
        columns[label] = {k: min(v, columns.get(label, {}).get(k, v)) for k, v in figures.items()}

    for r in range(args.repeat):  # the columns take turns, so slow stretches hit each alike
        with tempfile.TemporaryDirectory() as tmp:
            if args.vs_trl:
                keep("TRL PPOTrainer", run_trl(args.vs_trl, args.steps, Path(tmp), args.bf16))
            if args.before:
                keep(
                    "before", phase_times(run(args.steps, args.overrides, Path(tmp) / "before", args.before, args.demo))
                )
            keep(args.label, phase_times(run(args.steps, args.overrides, Path(tmp) / "run", demo=args.demo)))
            for i, variant in enumerate(args.variant):
                label, _, keys = variant.partition(":")
                extra = [k for k in keys.split(",") if k]
                keep(label, phase_times(run(args.steps, args.overrides + extra, Path(tmp) / f"run{i}", demo=args.demo)))
    print(
        f"seconds per step, median of steps 3..{args.steps}"
        + (f", best of {args.repeat} runs" if args.repeat > 1 else "")
        + (", bf16 mixed precision" if args.bf16 else "")
        + (f" ({' '.join(given)})" if given else "")
    )
    names = list(columns)
    print("| phase | " + " | ".join(names) + " |")
    print("| --- |" + " --- |" * len(names))
    rows = list(PHASES) + sorted({k for c in columns.values() for k in c if k.startswith("timing_s/")})
    for key in rows:
        print(f"| {key} | " + " | ".join(f"{c[key]:.2f}" if key in c else "" for c in columns.values()) + " |")
    if args.vs_trl:
        trl = columns["TRL PPOTrainer"]["step"]
        for name in names[1:]:
            print(f"{name}: {trl / columns[name]['step']:.2f}x TRL's speed per step")
    if args.json:
        Path(args.json).write_text(json.dumps(columns, indent=1))


if __name__ == "__main__":
    main()

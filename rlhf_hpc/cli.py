"""What ``launch.py`` calls: parse ``recipe=NAME key=value ...``, validate, then dry-run or launch."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

from rlhf_hpc.config import Config
from rlhf_hpc.recipe import (ConfigError, dump_yaml, get_key, list_recipes, load_config,
                             to_dict, write_resolved)

USAGE = """\
usage: python launch.py recipe=NAME [key.path=value ...] [--dry-run]
       python launch.py export RUN_DIR/global_step_N --out DIR [--dtype bfloat16|float32]
       python launch.py --help

  recipe=NAME      a recipe in recipes/ (NAME.yaml) or a path to a YAML file
  key.path=value   override any config key; values are YAML: lr=1e-6, x=null, a.b=[1,2]
  cluster=auto|local|slurm
                   where to run (launcher.cluster): auto = Slurm when sbatch exists, else here
  --dry-run        validate, print the resolved config and the exact command; run nothing
"""

# The keys most runs touch, shown by --help with their defaults.
MAIN_KEYS = [
    "data.train_files", "data.val_files", "data.train_batch_size", "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.model.path", "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_epochs", "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.actor.clip_ratio", "actor_rollout_ref.actor.clip_ratio_c",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size", "actor_rollout_ref.actor.fsdp_config.param_offload",
    "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization", "critic.optim.lr",
    "algorithm.adv_estimator", "algorithm.use_kl_in_reward", "algorithm.kl_ctrl.type",
    "algorithm.kl_ctrl.kl_coef", "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.device",
    "trainer.total_epochs", "trainer.total_training_steps", "trainer.save_freq", "trainer.logger",
    "trainer.default_local_dir", "trainer.resume_mode", "launcher.cluster",
]


def help_text() -> str:
    lines = [USAGE, "recipes:"]
    recipes = list_recipes()
    width = max((len(n) for n in recipes), default=0)
    lines += [f"  {name:<{width}}  {desc}" for name, desc in recipes.items()] or ["  (none)"]
    lines += ["", "main keys (default):"]
    defaults = Config()
    width = max(len(k) for k in MAIN_KEYS)
    lines += [f"  {k:<{width}}  {get_key(defaults, k)!r}" for k in MAIN_KEYS]
    lines += ["", "All keys and their meaning: rlhf_hpc/config.py. Names follow verl's ppo_trainer.yaml."]
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[Optional[str], list[str], dict[str, bool]]:
    recipe, overrides = None, []
    flags = {"dry_run": False, "help": False}
    for arg in argv:
        if arg in ("-h", "--help", "help"):
            flags["help"] = True
        elif arg == "--dry-run":
            flags["dry_run"] = True
        elif arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option '{arg}'; see python launch.py --help")
        elif "=" not in arg:
            raise ConfigError(f"argument '{arg}' is not of the form key.path=value; "
                              f"see python launch.py --help")
        else:
            overrides.append(arg)
    return recipe, overrides, flags


def export(argv: list[str]) -> int:
    """``export CKPT --out DIR``: a sharded checkpoint's actor as a Hugging Face model directory."""
    import argparse
    parser = argparse.ArgumentParser(prog="python launch.py export",
                                     description="Write the actor of a checkpoint as a Hugging Face model.")
    parser.add_argument("checkpoint", help="a global_step_N directory of a run")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = parser.parse_args(argv)
    from rlhf_hpc.checkpoint import export_hf
    try:
        out = export_hf(args.checkpoint, args.out, dtype=args.dtype)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    print(f"[rlhf-hpc] exported {args.checkpoint} -> {out}")
    return 0


def run(argv: list[str]) -> int:
    if argv and argv[0] == "export":
        return export(argv[1:])
    recipe, overrides, flags = parse_args(argv)
    if flags["help"]:
        print(help_text())
        return 0
    if not recipe:
        raise ConfigError("no recipe given: add recipe=NAME (one of: "
                          f"{', '.join(list_recipes())}) or recipe=path/to/recipe.yaml")
    dry = flags["dry_run"]
    # A dry run may be prepared away from the cluster, where the data and model paths don't exist:
    # missing files are reported but do not stop it. A real launch checks them first.
    cfg, warnings = load_config(recipe, overrides, check_files=not dry)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)

    if cfg.launcher.cluster == "slurm":
        raise ConfigError("launcher.cluster=slurm: submitting through Slurm is not implemented in this "
                          "version; run on one machine with cluster=local")

    from rlhf_hpc.launch.local import run_local, torchrun_command
    run_dir = Path(cfg.trainer.default_local_dir).expanduser()
    config_path = run_dir / "config.yaml"
    cmd = torchrun_command(cfg, config_path)
    if dry:
        print("# resolved config (written to {} at launch)".format(config_path))
        print(dump_yaml(to_dict(cfg)))
        print("# command (cluster=local)")
        print(shlex.join(cmd))
        return 0
    write_resolved(cfg, run_dir)
    print(f"[rlhf-hpc] run directory: {run_dir}\n[rlhf-hpc] {shlex.join(cmd)}", flush=True)
    return run_local(cfg, config_path)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

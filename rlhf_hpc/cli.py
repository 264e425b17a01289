"""What ``launch.py`` calls: parse ``recipe=NAME key=value ...``, validate, then dry-run or launch."""

from __future__ import annotations

import itertools
import json
import shlex
import sys
from pathlib import Path
from typing import Optional

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.config.tree import dump_yaml, get_key, to_dict
from rlhf_hpc.data.dataset import DataError, check_data_files
from rlhf_hpc.launch.first_calibration import calibrate_first_run, dry_run_note, needs_first_calibration
from rlhf_hpc.launch.local import run_local, standalone_torchrun_command
from rlhf_hpc.launch.run_lock import check_free
from rlhf_hpc.observability.compare import main as compare_main
from rlhf_hpc.observability.tracking import wandb_sync_command
from rlhf_hpc.planning.memory_plan import check_plan
from rlhf_hpc.planning.split_plan import compare_layouts
from rlhf_hpc.planning.time_plan import build_time_plan
from rlhf_hpc.ppo import checkpoint as ckpt
from rlhf_hpc.recipe.config_checks import validate
from rlhf_hpc.recipe.load import list_recipes, load_config, parse_override, write_resolved
from rlhf_hpc.rewards.code import CODE_SOURCES
from rlhf_hpc.tools.interaction_config import run_interactions
from rlhf_hpc.tools.sandbox_checks import sandbox_problems
from rlhf_hpc.tools.tool_config import run_tools

__all__ = ["main"]

USAGE = """\
usage: python launch.py [recipe=NAME] [key.path=value ...] [sweep.key.path=[v1,v2] ...] [--dry-run]
       python launch.py preflight [recipe=NAME] [key.path=value ...] [--dry-run]
       python launch.py plan [recipe=NAME] [key.path=value ...] [sweep.key.path=[v1,v2] ...]
       python launch.py status|logs|cancel RUN_DIR
       python launch.py compare RUN_DIR [RUN_DIR ...] [--metrics a,b] [--out DIR]
       python launch.py export RUN_DIR/global_step_N --out DIR [--dtype bfloat16|float32]
       python launch.py prepare [recipe=NAME] [key.path=value ...]
       python launch.py calibrate [--ranks N] [--out FILE]
       python launch.py gpu-check OUT_DIR [--cpu-smoke] [--budget-s S] [--only TEXT]
       python launch.py --help

  recipe=NAME      a recipe in recipes/ (NAME.yaml) or a path to a YAML file; without it the
                   defaults (verl's ppo_trainer.yaml values) are the base
  key.path=value   override any config key; values are YAML: lr=1e-6, x=null, a.b=[1,2]
  cluster=auto|local|slurm
                   where to run (launcher.cluster): auto = Slurm when sbatch exists, else here
  sweep.key=[a,b]  one run per value (several sweep keys: the grid); on Slurm one array job
  --dry-run        validate, print the resolved config and the exact command (for Slurm: the
                   sbatch script); run nothing
  preflight recipe=NAME [key=value ...]
                   the same job, checking the allocation instead of training: process group,
                   bandwidth per mesh dimension, engine start + weight sync + generation, sleep/wake,
                   one actor micro-batch against the memory plan (<run dir>/preflight/preflight.txt)
  plan recipe=NAME [sweep.key=[a,b] ...]
                   the time plan of each layout of the sweep's grid: the ones whose memory plan
                   fits, fastest first, with predicted step time, tokens/s per GPU, the slowest
                   phase and its bound; then the ones that do not fit, with why
"""

# The keys most runs touch, shown by --help with their defaults.
MAIN_KEYS = [
    "data.train_files",
    "data.val_files",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_c",
    "actor_rollout_ref.actor.fsdp_config.fsdp_size",
    "actor_rollout_ref.actor.fsdp_config.param_offload",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "critic.optim.lr",
    "algorithm.adv_estimator",
    "algorithm.use_kl_in_reward",
    "algorithm.kl_ctrl.type",
    "algorithm.kl_ctrl.kl_coef",
    "reward_model.enable",
    "reward_model.model.path",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.device",
    "trainer.total_epochs",
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.logger",
    "trainer.default_local_dir",
    "trainer.resume_mode",
    "launcher.cluster",
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
    lines += ["", "All keys and their meaning: rlhf_hpc/config/schema.py. Names follow verl's ppo_trainer.yaml."]
    return "\n".join(lines)


# verl's Hydra config names (``--config-name``): the one whose defaults are this project's base, and
# the ones whose backend is not here
VERL_BASE_CONFIGS = ("ppo_trainer",)
VERL_OTHER_BACKENDS = {
    "ppo_veomni_trainer": "the VeOmni backend (FSDP2 trains here)",
    "ppo_torchtitan_trainer": "the torchtitan backend (FSDP2 trains here)",
}


def _hydra_option(name: str, value: str) -> list[str]:
    """verl's ``--config-path`` / ``--config-name`` (Hydra's) -> the overrides they stand for: verl's
    own ppo_trainer config is the base here already (none); its Megatron config is its strategy,
    which the checks refuse by name with the rest of the line's Megatron keys; another backend's
    config is refused by its name, and a config directory or file of one's own with the way to
    bring it (a recipe)."""
    stem = value.strip().strip("'\"").removesuffix(".yaml")
    if name == "--config-path":
        if stem.rstrip("/") in ("config", "pkg://verl.trainer.config", "verl/trainer/config"):
            return []  # verl's packaged configs, as its examples name them
        raise ConfigError(
            f"--config-path={value}: a config directory of your own is not read here; write it as a "
            f"recipe (recipes/NAME.yaml, or a path) and pass recipe=NAME"
        )
    if stem in VERL_BASE_CONFIGS:
        return []
    if stem == "ppo_megatron_trainer":
        return ["actor_rollout_ref.actor.strategy=megatron"]
    if stem in VERL_OTHER_BACKENDS:
        raise ConfigError(f"--config-name={value}: {VERL_OTHER_BACKENDS[stem]} is not available in rlhf-hpc")
    raise ConfigError(
        f"--config-name={value}: verl config files other than ppo_trainer are not read here; write "
        f"yours as a recipe (recipes/NAME.yaml, or a path) and pass recipe=NAME"
    )


def parse_args(argv: list[str]) -> tuple[Optional[str], list[str], dict[str, list], dict[str, bool]]:
    recipe, overrides, sweeps = None, [], {}
    flags = {"dry_run": False, "help": False}
    argv, backend = list(argv), []
    while argv:
        arg = argv.pop(0)
        option = arg.split("=", 1)[0]
        if option in ("--config-path", "--config-name", "-cp", "-cn"):
            name = {"-cp": "--config-path", "-cn": "--config-name"}.get(option, option)
            if "=" not in arg and not argv:
                raise ConfigError(f"{arg} needs a value, e.g. {name}=ppo_trainer")
            backend += _hydra_option(name, arg.split("=", 1)[1] if "=" in arg else argv.pop(0))
        elif arg in ("-h", "--help", "help"):
            flags["help"] = True
        elif arg == "--dry-run":
            flags["dry_run"] = True
        elif arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option '{arg}'; see python launch.py --help")
        elif "=" not in arg:
            raise ConfigError(f"argument '{arg}' is not of the form key.path=value; see python launch.py --help")
        elif arg.startswith("sweep."):
            key, value = parse_override(arg[len("sweep.") :])
            if not isinstance(value, list) or not value:
                raise ConfigError(f"{arg}: a sweep needs a non-empty list of values, e.g. sweep.{key}=[1,2]")
            sweeps[key] = value
        else:
            overrides.append(arg)
    return recipe, overrides + backend, sweeps, flags


def sweep_elements(overrides: list[str], sweeps: dict[str, list]) -> list[tuple[list[str], str]]:
    """(overrides, name suffix) per element of the grid of sweep values."""
    if not sweeps:
        return [(overrides, "")]
    keys = list(sweeps)
    out = []
    for values in itertools.product(*(sweeps[k] for k in keys)):
        extra = [f"{k}={json.dumps(v)}" for k, v in zip(keys, values)]
        suffix = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(keys, values))
        out.append((overrides + extra, suffix))
    return out


def export(argv: list[str]) -> int:
    """``export CKPT --out DIR``: a sharded checkpoint's actor as a Hugging Face model directory."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python launch.py export", description="Write the actor of a checkpoint as a Hugging Face model."
    )
    parser.add_argument("checkpoint", help="a global_step_N directory of a run")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = parser.parse_args(argv)
    try:
        out = ckpt.export_hf(args.checkpoint, args.out, dtype=args.dtype)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    print(f"[rlhf-hpc] exported {args.checkpoint} -> {out}")
    return 0


def run(argv: list[str]) -> int:
    if argv and argv[0] == "export":
        return export(argv[1:])
    if argv and argv[0] in ("status", "logs", "cancel"):
        return jobs_command(argv[0], argv[1:])
    if argv and argv[0] == "prepare":
        return prepare_run(argv[1:])
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    if argv and argv[0] == "preflight":
        return run(preflight_args(argv[1:]))
    if argv and argv[0] == "plan":
        return print_layout_table(argv[1:])
    if argv and argv[0] == "calibrate":
        # (imports the measuring code only for this command: a run starts it as a subprocess)
        from rlhf_hpc.hardware_checks.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv and argv[0] == "gpu-check":
        # (imports the GPU check's cases, vLLM among them where installed, only for this command)
        from rlhf_hpc.hardware_checks.gpu_check import main as gpu_check_main

        return gpu_check_main(argv[1:])
    recipe, overrides, sweeps, flags = parse_args(argv)
    if flags["help"]:
        print(help_text())
        return 0
    dry = flags["dry_run"]
    # without recipe= the defaults (verl's) are the base, so a verl command line runs as it is
    if recipe and not any(o.startswith("trainer.recipe=") for o in overrides):
        overrides = [f"trainer.recipe={Path(recipe).stem}"] + overrides
    elements = resolve_elements(recipe, overrides, sweeps, dry)
    run_dirs = [Path(c.trainer.default_local_dir).expanduser() for c in elements]
    if len(set(run_dirs)) < len(run_dirs):
        raise ConfigError(
            "sweep elements share one trainer.default_local_dir: put ${trainer.experiment_name} in it "
            "so each element gets its own run directory"
        )
    cfg = elements[0]
    for c in elements:
        check_data(c)
    if not dry and len(elements) == 1 and needs_first_calibration(cfg):
        calibrate_first_run(cfg)  # then the layout and the plans again, by what it measured
        elements = resolve_elements(recipe, overrides, sweeps, dry, quiet=True)
        cfg = elements[0]
    if not dry:  # an impossible memory plan is refused before anything is queued
        for c in elements:
            check_memory_plan(c, show=True)
    if cfg.launcher.cluster == "slurm":
        return launch_slurm(elements, run_dirs, dry)
    if len(elements) > 1:
        raise ConfigError("sweeps need cluster=slurm (one array job); locally, run the elements one by one")

    run_dir = run_dirs[0]
    config_path = run_dir / "config.yaml"
    cmd = standalone_torchrun_command(cfg, config_path)
    if dry:
        print("# resolved config (written to {} at launch)".format(config_path))
        print(dump_yaml(to_dict(cfg)))
        note = dry_run_note(cfg)
        if note:
            print(note)
        check_memory_plan(cfg, show=True)
        print("# command (cluster=local)")
        print(shlex.join(cmd))
        return 0
    check_before_start(cfg, run_dir)
    return run_local(cfg, config_path)  # (locks the run directory, then writes its config)


def resolve_elements(
    recipe: Optional[str], overrides: list[str], sweeps: dict[str, list], dry: bool, quiet: bool = False
) -> list:
    """The config of each sweep element (one without a sweep). A dry run may be prepared away from
    the cluster, where the data and model paths don't exist: missing files are reported but do not
    stop it. A real launch checks them first."""
    elements = []
    for element_overrides, suffix in sweep_elements(overrides, sweeps):
        cfg, warnings = load_config(recipe, element_overrides, check_files=not dry)
        if suffix:
            cfg, _ = load_config(
                recipe,
                element_overrides + [f"trainer.experiment_name={cfg.trainer.experiment_name}_{suffix}"],
                check_files=not dry,
            )
        for w in warnings if not quiet else ():
            print(f"warning: {w}", file=sys.stderr)
        elements.append(cfg)
    return elements


class BadData(ConfigError):
    def __str__(self) -> str:
        return f"bad data: {self.errors[0]}"


def check_data(cfg) -> None:
    """Bad rows are found here, on the launching machine in about a second, not after the queue
    and the workers' start-up; one line names the file, the row and the column. Rows scored by
    running their code (``rewards.code``) and a code tool need a sandbox: checked here too, with the fix."""
    try:
        _, sources = check_data_files(cfg.data, [e.name for e in run_interactions(cfg)])
    except DataError as e:
        raise BadData(str(e)) from None
    if sources & set(CODE_SOURCES) or any(t.sandbox for t in run_tools(cfg)):
        errors, warnings, notes = sandbox_problems(cfg)
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        for note in notes:
            print(f"# {note}", flush=True)
        if errors:
            raise ConfigError(errors)


def check_memory_plan(cfg, show: bool) -> None:
    """Print the per-GPU memory plan (comment lines: the dry run's output stays YAML-readable);
    refuse (ConfigError naming the keys) a plan that cannot fit."""
    plan, errors, warnings = check_plan(cfg)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if show and plan is not None:
        print(plan.render(), flush=True)
    if errors:
        raise ConfigError(errors)
    if show and plan is not None:
        time_plan = build_time_plan(cfg, advise=lambda c: validate(c, check_files=False))
        print(time_plan.render(), flush=True)
        if cfg.split:  # which layout is faster for this workload
            for line in compare_layouts(cfg, time_plan, lambda c: validate(c, check_files=False)):
                print(f"# layouts: {line}", flush=True)


def print_layout_table(argv: list[str]) -> int:
    """``launch.py plan``: one table of the sweep's layouts, those that fit fastest first."""
    recipe, overrides, sweeps, flags = parse_args(argv)
    if flags["help"]:
        print(help_text())
        return 0
    fits, refused = [], []
    for element_overrides, suffix in sweep_elements(overrides, sweeps):
        label = suffix or "as written"
        try:
            cfg, _ = load_config(recipe, element_overrides, check_files=False)
            memory, errors, _ = check_plan(cfg)
        except ConfigError as e:
            refused.append((label, "; ".join(e.errors)))
            continue
        if errors:
            refused.append((label, errors[0]))
            continue
        plan = build_time_plan(cfg)
        slowest = max((p for p in plan.phases if p.name != "save_checkpoint"), key=lambda p: p.seconds)
        fits.append((plan.step_s, label, memory.peak / 2**30 if memory else float("nan"), plan, slowest))
    first = fits[0][3] if fits else None
    if first is not None:
        print(
            f"# {first.world} x {first.hardware.name}; {first.workload.rows} responses of "
            f"{first.workload.prompt:.0f} + "
            f"{first.workload.response:.0f} tokens ({first.workload.source})"
        )
    print("| layout | step (s) | tokens/s per GPU | slowest phase (bound) | communication | peak memory (GiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for step_s, label, peak, plan, slowest in sorted(fits, key=lambda f: f[0]):
        print(
            f"| {label} | {step_s:.3g} | {plan.tokens_per_s_per_gpu:,.0f} | {slowest.name} {slowest.seconds:.3g} s "
            f"({slowest.bound}) | {plan.comm_share:.0%} | {peak:.1f} |"
        )
    for label, why in refused:
        print(f"| {label} | does not fit: {why} | | | | |")
    return 0 if fits else 1


def check_before_start(cfg, run_dir: Path) -> None:
    """The run directory is writable with room to spare, and a checkpoint it would resume from
    belongs to the same run (model, tokenizer, data, ...)."""
    ckpt.check_run_dir(run_dir, cfg.trainer.min_free_disk_gb)
    check_free(run_dir)  # another run holds it: refused before anything is written or queued
    if cfg.trainer.resume_mode == "auto":
        latest = ckpt.choose_resume(run_dir, log=lambda *_: None, content=False)  # (the workers read the content)
        if latest is not None:
            ckpt.check_resume_compatible(latest, cfg)


PREFLIGHT_TIME_MIN = 30  # a preflight's time limit at most (short jobs start sooner)


def preflight_args(argv: list[str]) -> list[str]:
    """``preflight recipe=... [k=v]`` -> the run's arguments for a job that checks the allocation
    (rlhf_hpc.preflight) instead of training: in ``<run dir>/preflight``, named ``<name>_preflight``,
    with a time limit of at most ``PREFLIGHT_TIME_MIN`` minutes."""
    recipe, overrides, sweeps, _ = parse_args(argv)
    if sweeps:
        raise ConfigError(
            "usage: python launch.py preflight [recipe=NAME] [key=value ...] (no sweeps: one "
            "allocation is checked at a time)"
        )
    cfg, _ = load_config(recipe, overrides, check_files=False)
    tr = cfg.trainer
    return argv + [
        "trainer.preflight=true",
        f"trainer.experiment_name={tr.experiment_name}_preflight",
        f"trainer.default_local_dir={Path(tr.default_local_dir).expanduser() / 'preflight'}",
        f"launcher.time_min={min(cfg.launcher.time_min, PREFLIGHT_TIME_MIN)}",
    ]


def prepare_run(argv: list[str]) -> int:
    """``prepare recipe=... [k=v]``: validate and write the run's config.yaml, print its path. What
    slurm/klppo.sbatch runs first, so a plain sbatch job uses the same resolved config."""
    recipe, overrides, sweeps, _ = parse_args(argv)
    if sweeps:
        raise ConfigError("usage: python launch.py prepare [recipe=NAME] [key=value ...] (no sweeps)")
    cfg, warnings = load_config(recipe, overrides + ["launcher.cluster=slurm"])
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    check_data(cfg)
    print(write_resolved(cfg, Path(cfg.trainer.default_local_dir).expanduser()).resolve())
    return 0


def launch_slurm(elements: list, run_dirs: list[Path], dry: bool) -> int:
    from rlhf_hpc.launch import slurm  # (imports submitit: only for cluster=slurm)

    cfg = elements[0]
    if dry:
        for c, d in zip(elements, run_dirs):
            print(f"# resolved config (written to {d / 'config.yaml'} at submission)")
            print(dump_yaml(to_dict(c)))
            check_memory_plan(c, show=True)
        # (before the script: the script is the output's tail, as it is written)
        print(f"# then on each node: {shlex.join(slurm.node_command_preview(cfg, run_dirs[0] / 'config.yaml'))}")
        print(f"# sbatch script (cluster=slurm{', array of %d' % len(elements) if len(elements) > 1 else ''})")
        print(slurm.sbatch_text(cfg, run_dirs[0] / "slurm"))
        return 0
    if not slurm.have_slurm():
        raise ConfigError(
            "launcher.cluster=slurm but sbatch is not on PATH: run on a login node of the cluster, "
            "or cluster=local to run here"
        )
    slurm.check_cluster(cfg)
    for c, d in zip(elements, run_dirs):
        check_before_start(c, d)
    paths = [write_resolved(c, d) for c, d in zip(elements, run_dirs)]
    ids = slurm.submit(list(zip(elements, paths)))
    for job_id, d in zip(ids, run_dirs):
        print(f"[rlhf-hpc] submitted job {job_id}: run directory {d}")
    return 0


def jobs_command(what: str, argv: list[str]) -> int:
    from rlhf_hpc.launch import slurm  # (imports submitit: only for Slurm jobs)

    if len(argv) != 1:
        raise ConfigError(f"usage: python launch.py {what} RUN_DIR")
    records = slurm.run_jobs(Path(argv[0]))
    for rec in records:
        if what == "status":
            print(f"{rec['job_id']}\t{slurm.job_state(rec['job_id'])}")
        elif what == "cancel":
            slurm.cancel(rec["job_id"])
            print(f"[rlhf-hpc] cancelled {rec['job_id']}")
        else:
            for f in slurm.log_files(rec):
                print(f"==> {f} <==")
                print(f.read_text(errors="replace")[-20000:])
    library_logs = sorted((Path(argv[0]) / "logs").glob("libraries.rank*.log"))
    if what == "logs" and library_logs:
        print(f"[rlhf-hpc] vLLM's and torch's warnings, by rank: {', '.join(map(str, library_logs))}")
    if what == "logs" and any((Path(argv[0]) / "wandb").glob("offline-run-*")):
        print(f"[rlhf-hpc] this run's W&B records are offline; upload them with: {wandb_sync_command(argv[0])}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

"""Cross-field checks of a resolved config, by topic: every problem with its key and, where
possible, the fix (``validate`` collects them)."""

from __future__ import annotations

import os
import re
from typing import Any, Optional

from rlhf_hpc.config.errors import ConfigError, did_you_mean
from rlhf_hpc.config.schema import ATTN_IMPLEMENTATIONS, Config
from rlhf_hpc.config.tree import get_key
from rlhf_hpc.config.verl_recipes import VERL_RECIPE_CODE, verl_recipe_code
from rlhf_hpc.models.lora import lora_enabled
from rlhf_hpc.ops.batching import per_rank_mini_batch
from rlhf_hpc.planning.hardware import cpu_dtype_warnings, hardware_problems
from rlhf_hpc.recipe.algorithm_checks import algorithm_problems, algorithm_warnings, rollout_correction_problems
from rlhf_hpc.recipe.defaults import deprecated_key_warnings
from rlhf_hpc.recipe.input_checks import input_problems
from rlhf_hpc.recipe.model_checks import (
    lora_problems,
    lora_warnings,
    model_architecture_problems,
    model_file_problems,
    reward_model_problems,
    router_aux_loss_problems,
    routing_replay_problems,
    sequence_parallel_problems,
)
from rlhf_hpc.recipe.multi_turn_checks import multi_turn_problems
from rlhf_hpc.recipe.packages import config_package_problems
from rlhf_hpc.recipe.split_checks import split_layout_problems, split_layout_warnings

__all__ = ["validate"]


def _looks_like_hub_id(path: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path) is not None and not path.startswith((".", "~", "/"))


def profiler_problems(cfg: Config) -> list[str]:
    gp, problems = cfg.global_profiler, []
    if gp.tool != "torch":
        problems.append(
            f"global_profiler.tool={gp.tool!r}: rlhf-hpc traces steps with torch.profiler (tool torch); "
            f"for Nsight Systems set launcher.nsys=true (the whole job, phases as NVTX ranges)"
        )
    bad_steps = [s for s in gp.steps or [] if s < 1]
    if bad_steps:
        problems.append(f"global_profiler.steps: {bad_steps} are not global steps (they count from 1)")
    bad_ranks = [r for r in gp.ranks or [] if not 0 <= r < cfg.world_size]
    if bad_ranks:
        problems.append(f"global_profiler.ranks: {bad_ranks} are not ranks of this job (0..{cfg.world_size - 1})")
    if cfg.launcher.nsys and cfg.launcher.cluster == "local":
        problems.append(
            "launcher.nsys=true wraps the nodes of a Slurm job (cluster=slurm); for a local run start "
            "it under Nsight Systems yourself: nsys profile -t cuda,nvtx python launch.py ..."
        )
    return problems


def missing_files(cfg: Config) -> list[str]:
    """Files/directories the config names that do not exist on this machine."""
    problems = []

    def check(key: str, path: Optional[str], hub_ok: bool = False) -> None:
        if not path or path.startswith(("tiny://", "synthetic://")):
            return
        if os.path.exists(os.path.expanduser(path)):
            return
        if hub_ok and _looks_like_hub_id(path):
            return  # a hub name: resolved from HF_HOME's cache where the job runs
        problems.append(f"{key}: '{path}' does not exist")

    def check_files(key: str, value: Any) -> None:
        for i, p in enumerate([value] if isinstance(value, str) else (value or [])):
            check(key if isinstance(value, str) else f"{key}[{i}]", p)

    d, arr = cfg.data, cfg.actor_rollout_ref
    check_files("data.train_files", d.train_files)
    check_files("data.val_files", d.val_files)
    check("data.tokenizer", d.tokenizer, hub_ok=True)
    check("actor_rollout_ref.model.path", arr.model.path, hub_ok=True)
    check("actor_rollout_ref.model.tokenizer_path", arr.model.tokenizer_path, hub_ok=True)
    if cfg.critic.enable and cfg.critic.model.path != arr.model.path:
        check("critic.model.path", cfg.critic.model.path, hub_ok=True)
    if cfg.reward_model.enable:
        check("reward_model.model.path", cfg.reward_model.model.path, hub_ok=True)
    crf = cfg.custom_reward_function
    if not verl_recipe_code(crf.path, crf.name):  # (a recipe's file with an equivalent here is never read)
        check("custom_reward_function.path", crf.path)
    return problems


def verl_recipe_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """(errors, notes): verl's custom dataset class and reward function where they name code of
    verl's recipes that has an equivalent here (said in one line), a dataset class that has none
    (refused: the data here is verl's parquet format)."""
    errors, notes = [], []
    crf, cls = cfg.custom_reward_function, cfg.data.custom_cls
    for key, path, name in (("custom_reward_function", crf.path, crf.name), ("data.custom_cls", cls.path, cls.name)):
        code = verl_recipe_code(path, name)
        if code is not None:
            notes.append(
                f"{key}.path={path} ({key}.name={name}) is {code.what}: its equivalent here runs "
                f"({code.entry}); the file, which imports verl, is not read"
            )
    if (cls.path or cls.name) and verl_recipe_code(cls.path, cls.name) is None:
        here = ", ".join(f"{c.file}:{c.name}" for c in VERL_RECIPE_CODE if c.entry.startswith("rlhf_hpc.data."))
        errors.append(
            f"data.custom_cls.path={cls.path!r} data.custom_cls.name={cls.name!r}: this class is not "
            f"available in rlhf-hpc; custom dataset classes here are those of verl's recipes with an "
            f"equivalent ({here}); other data is parquet in verl's format"
        )
    return errors, notes


def validate(cfg: Config, check_files: bool = True) -> list[str]:
    """Cross-field checks on a resolved config, by topic. Raises ConfigError listing every problem;
    returns warnings (notes that do not stop a run). With ``check_files`` False (a dry run prepared
    away from the cluster) missing files are warnings too."""
    errors, warnings = rollout_correction_problems(cfg)
    size_errors, sizes_ok = size_problems(cfg)
    errors += size_errors
    if sizes_ok:  # the batch arithmetic needs positive sizes
        batch_errors, batch_warnings = batch_size_problems(cfg)
        errors += batch_errors
        warnings += batch_warnings
    errors += mesh_problems(cfg)
    errors += algorithm_problems(cfg)
    checkpoint_errors, checkpoint_warnings = checkpoint_content_problems(cfg)
    errors += checkpoint_errors
    warnings += checkpoint_warnings
    errors += profiler_problems(cfg)
    for topic_errors, topic_warnings in (
        sequence_parallel_problems(cfg),
        model_architecture_problems(cfg),
        model_file_problems(cfg, check_files),
        config_package_problems(cfg),
    ):
        errors += topic_errors
        warnings += topic_warnings
    if cfg.launcher.cluster == "local" and cfg.trainer.nnodes > 1:
        errors.append(
            f"trainer.nnodes={cfg.trainer.nnodes} needs several machines: use cluster=slurm "
            f"(launcher.cluster), or trainer.nnodes=1 to run here"
        )
    errors += unsupported_values(cfg)
    errors += reward_model_problems(cfg)
    errors += routing_replay_problems(cfg)
    errors += split_layout_problems(cfg)
    errors += router_aux_loss_problems(cfg)
    errors += lora_problems(cfg)
    errors += hardware_problems(cfg)
    errors += input_problems(cfg)  # plan.*, the data files on this machine
    errors += multi_turn_problems(cfg, check_files)
    recipe_errors, recipe_notes = verl_recipe_problems(cfg)
    errors += recipe_errors
    warnings += recipe_notes
    warnings += algorithm_warnings(cfg)
    warnings += lora_warnings(cfg)
    warnings += strategy_warnings(cfg)
    warnings += deprecated_key_warnings(cfg)
    warnings += cpu_dtype_warnings(cfg)
    warnings += split_layout_warnings(cfg)
    files = missing_files(cfg)
    if check_files:
        errors += files
    else:
        warnings += [f"{f} on this machine (it must exist where the job runs)" for f in files]
    if errors:
        raise ConfigError(errors)
    return warnings


CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")  # verl's


def checkpoint_content_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """``checkpoint.save_contents`` / ``load_contents`` of the actor and the critic: verl's values; a
    resume loads a model (else it is a new run); ``hf_model`` where a Hugging Face model can be
    written from a live model (the full actor); a warning where the guard's rollbacks have nothing to
    go back to."""
    errors, warnings = [], []
    sections = [
        ("actor_rollout_ref.actor", cfg.actor_rollout_ref.actor.checkpoint, "actor"),
        ("critic", cfg.critic.checkpoint, "critic"),
    ]
    for key, ck, name in sections:
        for which, values in (("save_contents", ck.save_contents), ("load_contents", ck.load_contents)):
            if values is None:
                continue
            allowed = CHECKPOINT_CONTENTS if which == "save_contents" else CHECKPOINT_CONTENTS[:3]
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                errors.append(
                    f"{key}.checkpoint.{which}={values}: each entry one of {', '.join(allowed)}"
                    + ("" if values else " (at least one)")
                )
        if ck.load_contents is not None and "model" not in ck.load_contents:
            errors.append(
                f"{key}.checkpoint.load_contents={ck.load_contents}: a resume that loads no model is a new "
                f"run; add model, or set trainer.resume_mode=disable"
            )
        if "hf_model" in ck.save_contents and name == "critic":
            errors.append(
                f"{key}.checkpoint.save_contents: hf_model is written for the actor only here (a value model "
                f"is no causal LM); remove it"
            )
        if "hf_model" in ck.save_contents and name == "actor" and lora_enabled(cfg.actor_rollout_ref.model):
            errors.append(
                f"{key}.checkpoint.save_contents: hf_model with LoRA: its checkpoints hold the adapter; "
                f"python launch.py export CHECKPOINT writes the merged model and the adapter beside it"
            )
        guard = cfg.trainer.guard
        if (
            guard.enable
            and cfg.trainer.save_freq > 0
            and not {"model", "optimizer"} <= set(ck.save_contents)
            and (name == "actor" or cfg.critic.enable is not False)
        ):
            warnings.append(
                f"{key}.checkpoint.save_contents={ck.save_contents} writes no "
                f"{' and no '.join(p for p in ('model', 'optimizer') if p not in ck.save_contents)} state: "
                f"the stability guard cannot roll back to such a checkpoint, so a divergence stops the run "
                f"(trainer.guard); a resume says what it lacks"
            )
    return errors, warnings


def size_problems(cfg: Config) -> tuple[list[str], bool]:
    """(errors, whether the sizes the batch arithmetic divides by are positive): counts, lengths,
    learning rates that must be > 0, and the attention implementations named."""
    errors: list[str] = []
    d, arr, tr = cfg.data, cfg.actor_rollout_ref, cfg.trainer
    actor, rollout, critic = arr.actor, arr.rollout, cfg.critic

    def positive(key: str, value: Optional[float], allow_zero: bool = False) -> bool:
        if value is None or value > 0 or (allow_zero and value == 0):
            return True
        errors.append(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")
        return False

    ok = all(
        [
            positive("trainer.nnodes", tr.nnodes),
            positive("trainer.n_gpus_per_node", tr.n_gpus_per_node),
            positive("data.train_batch_size", d.train_batch_size),
            positive("actor_rollout_ref.rollout.n", rollout.n),
            positive("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
            positive("critic.ppo_mini_batch_size", critic.ppo_mini_batch_size),
        ]
    )
    for key, override in (
        ("actor_rollout_ref.model", arr.model.override_config),
        ("critic.model", critic.model.override_config),
        ("reward_model.model", cfg.reward_model.model.override_config),
    ):
        attn = override.get("attn_implementation")
        if attn is not None and attn not in ATTN_IMPLEMENTATIONS:
            errors.append(
                f"{key}.override_config.attn_implementation={attn!r} is not one of "
                f"{', '.join(ATTN_IMPLEMENTATIONS)}{did_you_mean(str(attn), ATTN_IMPLEMENTATIONS)}"
            )
    for key in (
        "data.max_prompt_length",
        "data.max_response_length",
        "actor_rollout_ref.actor.ppo_epochs",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "critic.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.update_weights_bucket_mb",
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "trainer.total_epochs",
        "trainer.total_training_steps",
        "actor_rollout_ref.actor.optim.lr",
        "critic.optim.lr",
    ):
        ok &= positive(key, get_key(cfg, key))
    return errors, ok


def batch_size_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """(errors, warnings) of the batch sizes, as verl accepts them: prompts x n responses are
    spread evenly over the ranks (rlhf_hpc.distributed.rows), each rank's share is cut into mini-batches
    of ppo_mini_batch_size x n / ranks rows (rounded down; the last one may be smaller), those into
    micro-batches. Sizes are positive here (size_problems)."""
    errors: list[str] = []
    warnings: list[str] = []
    d, arr, world = cfg.data, cfg.actor_rollout_ref, cfg.world_size
    actor, rollout, critic = arr.actor, arr.rollout, cfg.critic
    if d.train_batch_size * rollout.n % world:
        errors.append(
            f"data.train_batch_size ({d.train_batch_size}) x actor_rollout_ref.rollout.n "
            f"({rollout.n}) = {d.train_batch_size * rollout.n} responses must be divisible by "
            f"the number of ranks, trainer.nnodes x trainer.n_gpus_per_node = {world}, so every "
            f"rank trains on the same number of responses"
        )
    for who, mbs, micro, dyn in (
        (
            "actor_rollout_ref.actor",
            actor.ppo_mini_batch_size,
            actor.ppo_micro_batch_size_per_gpu,
            actor.use_dynamic_bsz,
        ),
        ("critic", critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu, critic.use_dynamic_bsz),
    ):
        if who == "critic" and not critic.enable:
            continue
        per_rank = per_rank_mini_batch(mbs, rollout.n, world)
        if mbs > d.train_batch_size:
            errors.append(
                f"{who}.ppo_mini_batch_size ({mbs}) is larger than data.train_batch_size "
                f"({d.train_batch_size}): a step holds at most one mini-batch"
            )
        elif per_rank == 0:
            errors.append(
                f"{who}.ppo_mini_batch_size ({mbs}) x actor_rollout_ref.rollout.n ({rollout.n}) "
                f"must be at least the number of ranks ({world}): each rank needs a row per "
                f"mini-batch"
            )
        else:
            if d.train_batch_size % mbs:
                warnings.append(
                    f"{who}.ppo_mini_batch_size ({mbs}) does not divide data.train_batch_size "
                    f"({d.train_batch_size}): the last mini-batch of each epoch is smaller"
                )
            if mbs * rollout.n % world:
                warnings.append(
                    f"{who}.ppo_mini_batch_size ({mbs}) x rollout.n ({rollout.n}) is not divisible "
                    f"by the {world} ranks: mini-batches hold {per_rank} rows per rank, "
                    f"{per_rank * world} in all"
                )
            if not dyn and micro > per_rank:
                warnings.append(
                    f"{who}.ppo_micro_batch_size_per_gpu ({micro}) is larger than the per-rank "
                    f"mini-batch ({per_rank}): each mini-batch runs as one micro-batch"
                )
            elif not dyn and per_rank % micro:  # (the losses are normalised by the mini-batch's counts)
                warnings.append(
                    f"{who}.ppo_micro_batch_size_per_gpu ({micro}) does not divide the per-rank "
                    f"mini-batch ({who}.ppo_mini_batch_size x rollout.n / ranks = {per_rank}): its last "
                    f"micro-batch holds {per_rank % micro} rows, as in verl"
                )
    seq_len = d.max_prompt_length + d.max_response_length
    for key in ("actor_rollout_ref.actor", "critic"):
        section = get_key(cfg, key)
        if section.use_dynamic_bsz and section.ppo_max_token_len_per_gpu < seq_len:
            errors.append(
                f"{key}.ppo_max_token_len_per_gpu ({section.ppo_max_token_len_per_gpu}) is smaller "
                f"than one full sequence, data.max_prompt_length + data.max_response_length = {seq_len}"
            )
    for key in ("actor_rollout_ref.rollout", "actor_rollout_ref.ref"):
        section = get_key(cfg, key)
        if section.log_prob_use_dynamic_bsz and section.log_prob_max_token_len_per_gpu < seq_len:
            errors.append(
                f"{key}.log_prob_max_token_len_per_gpu ({section.log_prob_max_token_len_per_gpu}) "
                f"is smaller than one full sequence ({seq_len} tokens)"
            )
    return errors, warnings


def mesh_problems(cfg: Config) -> list[str]:
    """Meshes: (replicate, shard) must multiply to the world size; a tensor-parallel group of the
    rollout stays inside one node."""
    errors: list[str] = []
    world, tr, rollout = cfg.world_size, cfg.trainer, cfg.actor_rollout_ref.rollout
    if world > 0:
        for key in (
            "actor_rollout_ref.actor.fsdp_config",
            "actor_rollout_ref.ref.fsdp_config",
            "critic.model.fsdp_config",
            "reward_model.model.fsdp_config",
        ):
            size = get_key(cfg, key).fsdp_size
            if size == -1 or (size is None and not key.startswith("reward_model")):  # null: rlhf_hpc.planning.layout
                continue
            if size is None or size <= 0 or world % size:
                errors.append(
                    f"{key}.fsdp_size ({size}) must divide the world size, trainer.nnodes x "
                    f"trainer.n_gpus_per_node = {world}, giving a (replicate, shard) mesh; "
                    f"use -1 to shard over all ranks"
                )
        tp = rollout.tensor_model_parallel_size
        if tp and tp > 0 and (tp > tr.n_gpus_per_node or tr.n_gpus_per_node % tp):
            spans = tp > tr.n_gpus_per_node  # (a model too large for one node's engine)
            errors.append(
                f"actor_rollout_ref.rollout.tensor_model_parallel_size ({tp}) must divide "
                f"trainer.n_gpus_per_node ({tr.n_gpus_per_node}): a tensor-parallel group stays "
                f"inside one node"
                + (
                    " (an engine spanning nodes, with tensor parallelism over the "
                    "inter-node network, is not available in rlhf-hpc)"
                    if spans
                    else ""
                )
            )
    return errors


def strategy_warnings(cfg: Config) -> list[str]:
    fsdp1 = [
        key
        for key in ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.ref.strategy", "critic.strategy")
        if get_key(cfg, key) == "fsdp"
    ]
    fsdp1 += ["reward_model.strategy"] if cfg.reward_model.enable and cfg.reward_model.strategy == "fsdp" else []
    if not fsdp1:
        return []
    return [
        f"{', '.join(k + '=fsdp' for k in fsdp1)}: the engine here is FSDP2 (fully_shard) whatever "
        f"the strategy; verl's fsdp would be FSDP1. Set fsdp2 to say what runs"
    ]


def unsupported_values(cfg: Config) -> list[str]:
    """Keys the config has (verl's names) for features this project does not have: their default
    is accepted, any other value refused here, so no key is taken and then ignored."""
    errors = []
    d, arr = cfg.data, cfg.actor_rollout_ref
    # inference-only models: no gradients to reduce, no optimizer to offload
    for key in ("actor_rollout_ref.ref.fsdp_config", "reward_model.model.fsdp_config"):
        fsdp = get_key(cfg, key)
        if fsdp.mixed_precision.reduce_dtype not in ("float32", "fp32"):
            errors.append(
                f"{key}.mixed_precision.reduce_dtype={fsdp.mixed_precision.reduce_dtype}: this model only "
                f"runs forward passes, so no gradient is ever reduced; remove the key"
            )
    if arr.ref.fsdp_config.optimizer_offload:
        errors.append(
            "actor_rollout_ref.ref.fsdp_config.optimizer_offload=true: the reference model has no optimizer; "
            "use actor_rollout_ref.ref.fsdp_config.param_offload to move its weights to the host"
        )
    if d.dataloader_num_workers != 0:
        errors.append(
            f"data.dataloader_num_workers={d.dataloader_num_workers}: there is no data loader pool here "
            f"(prompts are tokenised once at start-up); remove the key or set it to 0"
        )
    if d.reward_fn_key != "data_source":
        errors.append(
            f"data.reward_fn_key={d.reward_fn_key!r}: rewards are chosen by the data_source column only; remove the key"
        )
    if cfg.trainer.log_val_generations < 0:
        errors.append(
            f"trainer.log_val_generations={cfg.trainer.log_val_generations}: the number of validation "
            f"generations to log must be 0 (none) or more"
        )
    if cfg.trainer.val_only and not d.val_files:
        errors.append("trainer.val_only=true: an evaluation run needs a validation set; set data.val_files")
    for key in (
        "actor_rollout_ref.actor.fsdp_config",
        "actor_rollout_ref.ref.fsdp_config",
        "critic.model.fsdp_config",
        "reward_model.model.fsdp_config",
    ):
        if get_key(cfg, key).mixed_precision.buffer_dtype not in ("float32", "fp32"):
            errors.append(
                f"{key}.mixed_precision.buffer_dtype: FSDP2 keeps buffers in the model's dtype; only "
                f"float32 is accepted"
            )
    template = arr.model.custom_chat_template
    if template is not None:
        import jinja2

        try:
            jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError as e:
            errors.append(f"actor_rollout_ref.model.custom_chat_template: not a valid Jinja template ({e})")
    for key in ("actor_rollout_ref.model.external_lib", "critic.model.external_lib", "reward_model.model.external_lib"):
        lib = get_key(cfg, key)
        if lib and _module_missing(lib):
            errors.append(f"{key}={lib!r}: no such Python module here (it must be importable by the workers)")
    return errors


def _module_missing(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


# ---------------------------------------------------------------------------------- entry points

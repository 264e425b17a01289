"""Sharded checkpoints (torch.distributed.checkpoint), published atomically, and HF export.

Layout under the run directory (the reference system's)::

    global_step_N/
        actor/        DCP shards of {"model", "optimizer"}   (any world size can load them)
          huggingface/  the actor as a Hugging Face model, where save_contents has hf_model
        critic/       same, when there is a critic
        extra.pt      trainer state: schedulers, KL controller, sampler, step (rank 0)
        rng/rank_R.pt RNG states of each rank (restored only on the same world size)

What a model's checkpoints hold is its ``checkpoint.save_contents`` (verl's: ``model``,
``optimizer``, ``extra`` = its LR schedule and, for the actor, the RNG states, ``hf_model``), recorded
in the manifest; a resume loads its ``load_contents`` of that, and says in one line what the
checkpoint lacks (that part starts fresh) or why it cannot continue from it (no model shards).
        COMPLETE      written last, before the directory gets its final name: the manifest, every
                      file's size and SHA-256 (rlhf_hpc.ppo.checkpoint_manifest)
    latest_checkpointed_iteration.txt   N of the newest complete checkpoint

A checkpoint is written under ``.tmp-global_step_N`` and renamed when every rank has finished;
``latest_checkpointed_iteration.txt`` is replaced (not rewritten in place) after that. A crash at
any moment leaves the previous checkpoint complete and ``latest`` pointing at it. A resume checks
the newest checkpoint's files against its manifest and loads it; damage found either way (a file
missing, truncated, or of other content; a load that fails on any rank) sends it to the previous
complete checkpoint, with one line naming the file or component (``resume``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.config.tree import flatten, parse_yaml, to_dict
from rlhf_hpc.distributed.loading import materialize
from rlhf_hpc.models.hf import build_causal_lm, local_path, torch_dtype
from rlhf_hpc.models.lora import apply_lora, is_adapter, lora_enabled
from rlhf_hpc.ppo.checkpoint_manifest import CHECKSUM, gather_manifest, verify_manifest
from rlhf_hpc.recipe.load import load_resolved

__all__ = [
    "COMPLETE",
    "CONTENTS",
    "CheckpointLoadError",
    "HF_DIR",
    "LATEST",
    "LORA_ADAPTER_DIR",
    "RESUME_KEYS",
    "check_resume_compatible",
    "contents_notes",
    "model_missing",
    "saved_contents",
    "save_hf_model",
    "check_run_dir",
    "choose_resume",
    "export_hf",
    "find_resume_checkpoint",
    "full_model_state",
    "incompatible_keys",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "mark_latest",
    "resume",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "step_dir",
    "verify_checkpoint",
]

LATEST = "latest_checkpointed_iteration.txt"
COMPLETE = "COMPLETE"
CONTENTS = ("model", "optimizer", "extra", "hf_model")  # verl's checkpoint.save_contents values
ALL = frozenset(("model", "optimizer", "extra"))  # what a checkpoint from before save_contents holds
HF_DIR = "huggingface"  # verl's: global_step_N/<model>/huggingface


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def rng_state() -> dict[str, Any]:
    """RNG states as tensors and plain Python values (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    root: str | Path,
    step: int,
    components: dict[str, tuple[nn.Module, Optional[torch.optim.Optimizer]]],
    extra: dict[str, Any],
    max_to_keep: Optional[int] = None,
    good: bool = True,
    config_text: Optional[str] = None,
    after_component: Optional[Callable[[str], None]] = None,
    contents: Optional[dict[str, set[str]]] = None,
    hf_writer: Optional[Callable[[str, nn.Module, Path], None]] = None,
) -> Path:
    """Collective: every rank calls it. ``components``: name -> (model, optimizer or None).
    ``extra``: trainer state, plain Python values and tensors only (loaded with weights_only).
    ``good``: whether the stability guard vouches for it (rollbacks only go to good ones).
    ``config_text``: the run's resolved config, kept with the checkpoint for compatibility checks.
    ``after_component``: called with each component's name once it is written (fault injection).
    ``contents``: name -> its ``save_contents`` (default: model, optimizer, extra); ``hf_writer(name,
    model, dir)`` writes a model's ``hf_model`` (collective)."""
    root = Path(root)
    final, tmp = step_dir(root, step), root / f".tmp-global_step_{step}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash during an earlier attempt at this step
            shutil.rmtree(tmp)
    _barrier()
    contents = {name: set(contents.get(name, ALL)) if contents else set(ALL) for name in components}
    for name, (model, optimizer) in components.items():
        parts = contents[name]
        model_sd, optim_sd = _state(model, optimizer)
        state = {
            **({"model": model_sd} if "model" in parts else {}),
            **({"optimizer": optim_sd} if "optimizer" in parts and optimizer is not None else {}),
        }
        if state:
            dcp.save(state, checkpoint_id=str(tmp / name))
        if "hf_model" in parts:
            if hf_writer is None:
                raise ValueError(f"{name}: save_contents has hf_model, but no writer of Hugging Face models was given")
            hf_writer(name, model, tmp / name / HF_DIR)
        if after_component is not None:
            after_component(name)
    if "extra" in contents.get("actor", ALL):
        (tmp / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
    if _rank() == 0:
        torch.save(extra, tmp / "extra.pt")
        if config_text is not None:
            (tmp / "config.yaml").write_text(config_text)
    _barrier()
    # the manifest (every file's size and SHA-256, each rank hashing the files it wrote) lets a resume
    # detect a damaged checkpoint before loading it
    sizes, digests = gather_manifest(tmp)
    if _rank() == 0:
        _write_atomic(
            tmp / COMPLETE,
            json.dumps(
                {
                    "step": step,
                    "world_size": _world(),
                    "good": good,
                    "components": sorted(components),
                    "files": sizes,
                    "contents": {n: sorted(p) for n, p in contents.items()},
                    CHECKSUM: digests,
                }
            ),
        )
        if final.exists():  # an older save of the same step (e.g. re-run after a rollback)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(root / LATEST, str(step))
        if max_to_keep:
            for old in sorted(list_checkpoints(root))[:-max_to_keep]:
                shutil.rmtree(step_dir(root, old), ignore_errors=True)
    _barrier()
    return final


def _options(model: nn.Module) -> StateDictOptions:
    """A LoRA model's frozen base is not written: it is the pretrained checkpoint the run starts
    from, read again at every start (megabytes of adapter per save instead of the whole model)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]):
    if optimizer is None:
        return get_model_state_dict(model, options=_options(model)), {}
    return get_state_dict(model, optimizer, options=_options(model))


def save_hf_model(model: nn.Module, mcfg, out_dir: Path, dtype: str) -> None:
    """Collective: ``model`` (sharded) as a Hugging Face model directory in ``dtype`` on rank 0, as
    ``export_hf`` writes one (``mcfg``: its model section, for the structure and the tokenizer)."""
    state = full_model_state(model)
    if _rank() == 0:
        _write_hf(mcfg, state, out_dir, dtype)
    _barrier()


def _write_hf(mcfg, state: dict, out_dir: Path, dtype: str) -> None:
    """The structure of ``mcfg.path``'s model with ``state``'s weights, saved with its tokenizer."""
    model = materialize(
        build_causal_lm(
            mcfg.path, torch.float32, "meta", mcfg.override_config, trust_remote_code=mcfg.trust_remote_code
        ),
        torch.device("cpu"),
    )
    model.load_state_dict(state)
    model.to(torch_dtype(dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    _save_tokenizer(mcfg, out_dir)


def _save_tokenizer(mcfg, out_dir: Path) -> None:
    tok = mcfg.tokenizer_path or mcfg.path
    if not tok.startswith("tiny://"):
        from transformers import AutoTokenizer  # (a Hugging Face model's: the training path loads no tokenizer class)

        AutoTokenizer.from_pretrained(local_path(tok), trust_remote_code=mcfg.trust_remote_code).save_pretrained(
            out_dir
        )


def list_checkpoints(root: str | Path) -> list[int]:
    """Steps of complete checkpoints under ``root`` (ascending)."""
    root = Path(root)
    steps = []
    for p in root.glob("global_step_*") if root.is_dir() else []:
        if (p / COMPLETE).is_file() and p.name.split("_")[-1].isdigit():
            steps.append(int(p.name.split("_")[-1]))
    return sorted(steps)


def verify_checkpoint(path: str | Path, content: bool = True) -> Optional[str]:
    """None if every file the manifest lists is there with its size and (``content``) its SHA-256,
    else what is wrong. Collective in a process group (the ranks share the reading: rlhf_hpc.ppo.
    checkpoint_manifest). A checkpoint written before checksums is checked by size."""
    path = Path(path)
    try:
        meta = json.loads((path / COMPLETE).read_text())
    except (OSError, ValueError) as e:
        meta = f"no readable {COMPLETE} marker ({e})"
    return verify_manifest(path, meta, content)


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    """The checkpoint ``latest_checkpointed_iteration.txt`` names, if it is complete."""
    root = Path(root)
    try:
        step = int((root / LATEST).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    path = step_dir(root, step)
    return path if (path / COMPLETE).is_file() else None


def saved_contents(path: str | Path) -> dict[str, set[str]]:
    """Each component's ``save_contents`` as the checkpoint's manifest records it (one from before
    save_contents: model, optimizer, extra)."""
    meta = json.loads((Path(path) / COMPLETE).read_text())
    return {name: set(meta.get("contents", {}).get(name, ALL)) for name in meta.get("components", [])}


def contents_notes(path: str | Path, load: Optional[dict[str, set[str]]] = None) -> list[str]:
    """One line for each part a resume from ``path`` would want (``load``: name -> its
    ``load_contents``; default model, optimizer, extra) and the checkpoint does not hold: that part
    starts fresh. (No model shards: ``resume`` refuses the checkpoint instead.)"""
    saved, notes = saved_contents(path), []
    what = {
        "optimizer": "optimizer state (the optimizer starts fresh)",
        "extra": "LR schedule or RNG states (the schedule starts over; the RNG is seeded anew)",
    }
    for name, parts in saved.items():
        for part in ("optimizer", "extra"):
            if part in (load or {}).get(name, ALL) and part not in parts:
                notes.append(
                    f"{path}: the {name}'s checkpoint holds no {what[part]}: it was saved with "
                    f"{name}.checkpoint.save_contents={sorted(parts)}"
                )
    return notes


def model_missing(path: Path, load: Optional[dict[str, set[str]]]) -> Optional[str]:
    """Why a resume cannot continue from ``path``: a model to load whose shards it does not hold."""
    for name, parts in saved_contents(path).items():
        if "model" in (load or {}).get(name, ALL) and "model" not in parts:
            hf = (
                f"; its Hugging Face model {path / name / HF_DIR} can start a new run (model.path)"
                if "hf_model" in parts
                else ""
            )
            return (
                f"its {name} holds no model shards (saved with save_contents={sorted(parts)}), so no run can "
                f"continue from it{hf}"
            )
    return None


def load_checkpoint(
    path: str | Path,
    components: dict[str, tuple[nn.Module, Optional[torch.optim.Optimizer]]],
    restore_rng: bool = True,
    load: Optional[dict[str, set[str]]] = None,
) -> dict[str, Any]:
    """Collective: load shards into the (already sharded) models and optimizers, resharding when
    the world size or mesh differs from the one that saved. Returns the ``extra`` dict. A failure
    on any rank raises ``CheckpointLoadError`` on every rank, naming the part (component, extra.pt).
    ``load``: name -> its ``load_contents`` (default model, optimizer, extra): of those, what the
    checkpoint holds is loaded; the RNG states with the actor's ``extra``."""
    path = Path(path)
    saved = saved_contents(path)
    for name, (model, optimizer) in components.items():
        parts = (load or {}).get(name, ALL) & saved.get(name, ALL)
        if "model" in parts:
            _agreed(name, lambda: _load_component(path / name, model, optimizer if "optimizer" in parts else None))
    rng = restore_rng and "extra" in (load or {}).get("actor", ALL) & saved.get("actor", ALL)
    return _agreed("extra.pt / rng", lambda: _load_extra(path, rng))


class CheckpointLoadError(RuntimeError):
    """Loading a checkpoint failed on some rank (every rank raises it, with the same message)."""


def _agreed(part: str, load: Callable[[], Any]) -> Any:
    """``load()`` on every rank, then the ranks agree whether it failed anywhere (collective): all
    raise ``CheckpointLoadError`` naming the part and the first failure, or all go on. A rank never
    leaves the others waiting in the next part's collectives."""
    error = None
    try:
        result, problem = load(), None
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - whatever damage raises (DCP's: a BaseException)
        result, problem, error = None, _one_line(e), e
    if _world() > 1:
        problems = [None] * _world()
        dist.all_gather_object(problems, problem)
        problem = next((f"rank {r}: {p}" for r, p in enumerate(problems) if p), None)
    if problem:
        raise CheckpointLoadError(f"{part}: {problem}") from error
    return result


def _one_line(e: BaseException) -> str:
    """An exception as one line: DCP's CheckpointException carries each rank's exception and traceback."""
    if isinstance(e, dcp.CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]  # (exception, traceback) of the first rank that failed
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}"


def _load_component(path: Path, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
    model_sd, optim_sd = _state(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd} if optimizer is not None else {"model": model_sd}
    dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=_options(model))
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=_options(model),
        )


def _load_extra(path: Path, restore_rng: bool) -> dict[str, Any]:
    meta = json.loads((path / COMPLETE).read_text())
    rng_file = path / "rng" / f"rank_{_rank()}.pt"
    if restore_rng and meta["world_size"] == _world() and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return torch.load(path / "extra.pt", weights_only=True)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded model state on rank 0's CPU (other ranks get an empty dict)."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ------------------------------------------------------------------------------------ HF export
LORA_ADAPTER_DIR = "lora_adapter"  # beside an export's merged weights


def export_hf(ckpt_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write the actor of a sharded checkpoint as a Hugging Face model directory (config.json,
    safetensors in ``dtype``, the tokenizer when the model has one), loadable by
    ``AutoModelForCausalLM.from_pretrained`` and vLLM. With LoRA (whose checkpoints hold the adapter,
    the base being the run's pretrained model, read again here) the model is merged (W + s B A) and
    the adapter alone is written beside it, in PEFT's format, to ``OUT/lora_adapter`` (what
    ``lora_adapter_path`` and vLLM's LoRA requests read). One process, no process group needed."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if not (ckpt_dir / COMPLETE).is_file():
        raise FileNotFoundError(f"{ckpt_dir} is not a complete checkpoint (no {COMPLETE} marker)")
    actor = saved_contents(ckpt_dir).get("actor", ALL)
    if "model" not in actor:  # (save_contents without model: its Hugging Face model is the export)
        if "hf_model" not in actor:
            raise FileNotFoundError(
                f"{ckpt_dir}: the actor's checkpoint holds no model (save_contents={sorted(actor)})"
            )
        shutil.copytree(ckpt_dir / "actor" / HF_DIR, out_dir, dirs_exist_ok=True)
        return out_dir
    cfg = load_resolved(ckpt_dir.parent / "config.yaml", check_files=False)
    mcfg = cfg.actor_rollout_ref.model
    if lora_enabled(mcfg):  # the checkpoint holds the adapter: the base is the run's pretrained model
        model = apply_lora(
            build_causal_lm(
                mcfg.path,
                torch.float32,
                "cpu",
                mcfg.override_config,
                cfg.trainer.seed,
                trust_remote_code=mcfg.trust_remote_code,
            ),
            mcfg,
            seed=0,
        )
        state = {"model": {k: v for k, v in model.state_dict().items() if is_adapter(k)}}
    else:  # the structure, then the checkpoint's weights: the original checkpoint is not read again
        model = materialize(
            build_causal_lm(
                mcfg.path, torch.float32, "meta", mcfg.override_config, trust_remote_code=mcfg.trust_remote_code
            ),
            torch.device("cpu"),
        )
        state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt_dir / "actor"), no_dist=True)
    model.load_state_dict(state["model"], strict=not lora_enabled(mcfg))
    model.to(torch_dtype(dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    if lora_enabled(mcfg):  # the adapter alone (PEFT's format, as verl's lora_adapter/), then merged
        model.save_pretrained(out_dir / LORA_ADAPTER_DIR, safe_serialization=True)
        model = model.merge_and_unload()
    model.save_pretrained(out_dir, safe_serialization=True)
    _save_tokenizer(mcfg, out_dir)
    return out_dir


# ------------------------------------------------------------------------------ resume safety
# Keys that must match for a checkpoint to continue the same run; anything else (world size, mesh,
# micro-batches, learning rate, loggers, Slurm resources, total steps) may change between restarts.
RESUME_KEYS = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.override_config",
    "actor_rollout_ref.model.tokenizer_path",
    "data.tokenizer",
    "data.train_files",
    "data.train_batch_size",
    "data.shuffle",
    "data.seed",
    "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.rollout.n",
    "critic.enable",
    "critic.model.path",
    "critic.model.override_config",
    "algorithm.adv_estimator",
    "algorithm.kl_ctrl.type",
    "reward_model.enable",
    "reward_model.model.path",
    # a LoRA run's checkpoint holds its adapter: another adapter shape cannot load it
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.target_modules",
    "actor_rollout_ref.model.exclude_modules",
    "critic.model.lora_rank",
    "critic.model.target_modules",
)


def incompatible_keys(saved_config_text: str, cfg) -> list[str]:
    """``key: saved -> now`` for every RESUME_KEYS entry that differs."""
    saved = flatten(parse_yaml(saved_config_text) or {})
    now = flatten(to_dict(cfg))
    default = flatten(to_dict(type(cfg)()))
    out = []
    for key in RESUME_KEYS:
        old = {k: v for k, v in saved.items() if k == key or k.startswith(key + ".")}
        new = {k: v for k, v in now.items() if k == key or k.startswith(key + ".")}
        if not old and all(default.get(k) == v for k, v in new.items()):
            continue  # a key newer than the checkpoint, at its default: the run it wrote had that value
        if old != new:
            out.append(f"{key}: {_shown(old, key)} -> {_shown(new, key)}")
    return out


def _shown(values: dict, key: str) -> str:
    """One side of a changed key as an override writes it (``0``, ``false``, ``null``, ``[]``), its
    sub-keys (a mapping), or ``(absent)`` (a config from before the key)."""
    if key not in values:
        return str({k[len(key) + 1 :]: v for k, v in values.items()}) if values else "(absent)"
    value = values[key]
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    return repr(value) if value == "" else str(value)


def _candidates(root: Path, at_most: Optional[int] = None) -> list[Path]:
    """The complete checkpoints under ``root`` in the order a resume tries them: ``latest`` first,
    then the others newest first; ``at_most``: only those of that step or earlier."""
    latest = latest_checkpoint(root)
    order = ([latest] if latest else []) + [
        step_dir(root, s) for s in reversed(list_checkpoints(root)) if latest is None or step_dir(root, s) != latest
    ]
    return [p for p in order if at_most is None or int(p.name.split("_")[-1]) <= at_most]


def choose_resume(root: str | Path, log=print, at_most: Optional[int] = None, content: bool = True) -> Optional[Path]:
    """The newest complete, undamaged checkpoint under ``root``: ``latest`` first; a damaged one
    (a file missing, truncated, or with ``content`` of another checksum than the manifest's) is
    skipped, and the log says so. ``at_most``: only checkpoints of that step or earlier (a rollback
    past a suspect one). Collective in a process group (``verify_checkpoint``)."""
    for path in _candidates(Path(root), at_most):
        problem = verify_checkpoint(path, content)
        if problem is None:
            return path
        log(f"[rlhf-hpc] checkpoint {path} is damaged ({problem}); falling back to the previous one")
    return None


def mark_latest(root: str | Path, path: Path) -> None:
    """Point ``latest_checkpointed_iteration.txt`` at ``path`` (rank 0): after a rollback a restart
    continues from where training went back to, not from the rejected steps' checkpoints."""
    if _rank() == 0:
        _write_atomic(Path(root) / LATEST, path.name.split("_")[-1])
    _barrier()


def check_resume_compatible(path: Path, cfg) -> None:
    saved = path / "config.yaml"
    if not saved.is_file():
        return
    try:
        diff = incompatible_keys(saved.read_text(), cfg)
    except Exception:  # noqa: BLE001 - damaged bytes: the resume's content check names the file and falls back
        return
    if diff:
        raise ConfigError(
            [f"cannot resume from {path}: the run's config changed in keys that define it"]
            + diff
            + ["use a new trainer.default_local_dir, or trainer.resume_mode=disable to start over"]
        )


def check_run_dir(run_dir: str | Path, min_free_gb: float) -> None:
    """Before anything starts: the run directory can be created and written, with enough free space."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"trainer.default_local_dir: cannot write to '{run_dir}' ({e.strerror or e}); choose a "
            f"directory you can write, on a filesystem every node sees"
        ) from None
    free_gb = shutil.disk_usage(run_dir).free / 2**30
    if free_gb < min_free_gb:
        raise ConfigError(
            f"trainer.default_local_dir: only {free_gb:.2f} GB free at '{run_dir}', less than "
            f"trainer.min_free_disk_gb={min_free_gb}; checkpoints would not fit"
        )


def find_resume_checkpoint(cfg: Config, run_dir: Path, log=print) -> Optional[Path]:
    """The checkpoint a run continues from, by ``trainer.resume_mode`` (``disable``, ``auto``: the
    newest good one under ``run_dir``, or a path), checked against the run's config; None to start.
    (``resume`` also loads it, falling back from one that does not load.)"""
    mode = cfg.trainer.resume_mode
    if mode == "disable":
        return None
    if mode == "auto":
        path = choose_resume(run_dir, log)
    else:
        path = _named_checkpoint(mode)
    if path is not None:
        check_resume_compatible(path, cfg)
    return path


def _named_checkpoint(mode: str) -> Path:
    path = Path(mode).expanduser()
    problem = verify_checkpoint(path)
    if problem:
        raise RuntimeError(f"trainer.resume_mode: {path} is not a usable checkpoint: {problem}")
    return path


def resume(
    cfg: Config,
    run_dir: Path,
    components: dict[str, tuple[nn.Module, Optional[torch.optim.Optimizer]]],
    log=print,
    apply: Optional[Callable[[dict], None]] = None,
    load: Optional[dict[str, set[str]]] = None,
) -> tuple[Optional[Path], Optional[dict]]:
    """Collective: (checkpoint, its extra) a run continues from, loaded into ``components`` and given
    to ``apply`` (the trainer's own state); (None, None) to start. ``trainer.resume_mode=auto``: the
    newest checkpoint whose files match its manifest and that loads on every rank; one that does
    not is skipped with a line naming the file or the part that failed. A path: that one, or an
    error. Every checkpoint tried is checked against the run's config first. ``load``: name -> its
    ``load_contents``; one that holds no model shards to load is passed over (auto) or refused (a
    path), what else it lacks is said in a line, and that part starts fresh."""
    mode = cfg.trainer.resume_mode
    if mode == "disable":
        return None, None
    if mode != "auto":
        path = _named_checkpoint(mode)
        check_resume_compatible(path, cfg)
        missing = model_missing(path, load)
        if missing:
            raise RuntimeError(f"trainer.resume_mode: {path}: {missing}")
        try:
            return path, _load_and_apply(path, components, apply, load, log)
        except CheckpointLoadError as e:
            raise RuntimeError(f"trainer.resume_mode: {path} could not be loaded ({e})") from e
    failed = None
    for path in _candidates(Path(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None and model_missing(path, load):
            log(f"[rlhf-hpc] checkpoint {path}: {model_missing(path, load)}; trying the previous one")
            continue
        if problem is None:
            check_resume_compatible(path, cfg)
            try:
                return path, _load_and_apply(path, components, apply, load, log)
            except CheckpointLoadError as e:
                problem, failed = f"loading failed: {e}", path
        log(f"[rlhf-hpc] checkpoint {path} is damaged ({problem}); falling back to the previous one")
    if failed is not None:  # the models hold part of a checkpoint: starting over from them would be wrong
        raise RuntimeError(
            f"no checkpoint under {run_dir} loads (the last tried: {failed}); set "
            f"trainer.resume_mode=disable to start over, or to a checkpoint's path"
        )
    return None, None


def _load_and_apply(
    path: Path,
    components,
    apply: Optional[Callable[[dict], None]],
    load: Optional[dict[str, set[str]]] = None,
    log=print,
) -> dict:
    extra = load_checkpoint(path, components, load=load)
    for note in contents_notes(path, load):
        log(f"[rlhf-hpc] {note}")
    if apply is not None:
        _agreed("trainer state (extra.pt)", lambda: apply(extra))
    return extra

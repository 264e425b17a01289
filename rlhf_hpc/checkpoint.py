"""Sharded checkpoints (torch.distributed.checkpoint), published atomically, and HF export.

Layout under the run directory (the reference system's)::

    global_step_N/
        actor/        DCP shards of {"model", "optimizer"}   (any world size can load them)
        critic/       same, when there is a critic
        extra.pt      trainer state: schedulers, KL controller, sampler, step (rank 0)
        rng/rank_R.pt RNG states of each rank (restored only on the same world size)
        COMPLETE      written last, before the directory gets its final name
    latest_checkpointed_iteration.txt   N of the newest complete checkpoint

A checkpoint is written under ``.tmp-global_step_N`` and renamed when every rank has finished;
``latest_checkpointed_iteration.txt`` is replaced (not rewritten in place) after that. A crash at
any moment leaves the previous checkpoint complete and ``latest`` pointing at it.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

LATEST = "latest_checkpointed_iteration.txt"
COMPLETE = "COMPLETE"


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
    state = {"torch": torch.get_rng_state(), "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos,
                                                       has_gauss, cached],
             "python": random.getstate()}
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


def save_checkpoint(root: str | Path, step: int, components: dict[str, tuple[nn.Module, Optional[torch.optim.Optimizer]]],
                    extra: dict[str, Any], max_to_keep: Optional[int] = None) -> Path:
    """Collective: every rank calls it. ``components``: name -> (model, optimizer or None).
    ``extra``: trainer state, plain Python values and tensors only (loaded with weights_only)."""
    root = Path(root)
    final, tmp = step_dir(root, step), root / f".tmp-global_step_{step}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crash during an earlier attempt at this step
            shutil.rmtree(tmp)
    _barrier()
    for name, (model, optimizer) in components.items():
        model_sd, optim_sd = _state(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp / name))
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), tmp / "rng" / f"rank_{_rank()}.pt")
    if _rank() == 0:
        torch.save(extra, tmp / "extra.pt")
    _barrier()
    if _rank() == 0:
        _write_atomic(tmp / COMPLETE, json.dumps({"step": step, "world_size": _world(),
                                                  "components": sorted(components)}))
        if final.exists():  # an older save of the same step (e.g. re-run after a rollback)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_atomic(root / LATEST, str(step))
        if max_to_keep:
            for old in sorted(list_checkpoints(root))[:-max_to_keep]:
                shutil.rmtree(step_dir(root, old), ignore_errors=True)
    _barrier()
    return final


def _state(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]):
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(model), {}
    return get_state_dict(model, optimizer)


def list_checkpoints(root: str | Path) -> list[int]:
    """Steps of complete checkpoints under ``root`` (ascending)."""
    root = Path(root)
    steps = []
    for p in root.glob("global_step_*") if root.is_dir() else []:
        if (p / COMPLETE).is_file() and p.name.split("_")[-1].isdigit():
            steps.append(int(p.name.split("_")[-1]))
    return sorted(steps)


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    """The checkpoint ``latest_checkpointed_iteration.txt`` names, if it is complete."""
    root = Path(root)
    try:
        step = int((root / LATEST).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    path = step_dir(root, step)
    return path if (path / COMPLETE).is_file() else None


def load_checkpoint(path: str | Path, components: dict[str, tuple[nn.Module, Optional[torch.optim.Optimizer]]],
                    restore_rng: bool = True) -> dict[str, Any]:
    """Collective: load shards into the (already sharded) models and optimizers, resharding when
    the world size or mesh differs from the one that saved. Returns the ``extra`` dict."""
    path = Path(path)
    for name, (model, optimizer) in components.items():
        model_sd, optim_sd = _state(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd} if optimizer is not None else {"model": model_sd}
        dcp.load(state, checkpoint_id=str(path / name))
        if optimizer is None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    meta = json.loads((path / COMPLETE).read_text())
    rng_file = path / "rng" / f"rank_{_rank()}.pt"
    if restore_rng and meta["world_size"] == _world() and rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=True))
    return torch.load(path / "extra.pt", weights_only=True)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the unsharded model state on rank 0's CPU (other ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ------------------------------------------------------------------------------------ HF export
def export_hf(ckpt_dir: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write the actor of a sharded checkpoint as a Hugging Face model directory (config.json,
    safetensors in ``dtype``, the tokenizer when the model has one), loadable by
    ``AutoModelForCausalLM.from_pretrained`` and vLLM. One process, no process group needed."""
    from rlhf_hpc.models import build_causal_lm, torch_dtype
    from rlhf_hpc.recipe import load_resolved
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if not (ckpt_dir / COMPLETE).is_file():
        raise FileNotFoundError(f"{ckpt_dir} is not a complete checkpoint (no {COMPLETE} marker)")
    cfg = load_resolved(ckpt_dir.parent / "config.yaml", check_files=False)
    mcfg = cfg.actor_rollout_ref.model
    model = build_causal_lm(mcfg.path, torch.float32, "cpu", mcfg.override_config, seed=cfg.trainer.seed,
                            trust_remote_code=mcfg.trust_remote_code)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt_dir / "actor"), no_dist=True)
    model.load_state_dict(state["model"])
    model.to(torch_dtype(dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok = mcfg.tokenizer_path or mcfg.path
    if not tok.startswith("tiny://"):
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(tok, trust_remote_code=mcfg.trust_remote_code).save_pretrained(out_dir)
    return out_dir

"""A model directory's weights against what its config builds, without reading a tensor: the
weight files are there (an index's shards too), and the safetensors headers' names and shapes are
the parameters the config makes (a meta-device build; a tied head needs no tensor of its own).

What it catches before anything starts: a directory with ``config.json`` and no weights, a shard
missing, weights of another size of the model (transformers refuses them while loading, on every
rank), tensors the config defines that the files lack (transformers would initialise them at
random, with a warning). Checked for presence only: weights in PyTorch's ``.bin`` format,
architectures whose checkpoints transformers renames or fuses while loading
(``transformers.conversion_mapping``: MoE experts, some multimodal models), quantized checkpoints.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from torch import nn

__all__ = ["no_weight_files", "safetensors_shapes", "weight_files", "weights_problems"]

INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def weight_files(directory: Path) -> tuple[list[Path], list[str]]:
    """(the weight files of a model directory, what is wrong with them): the shards an index lists
    (each must exist), else every ``*.safetensors``, else PyTorch's ``*.bin``."""
    for index in (INDEX, BIN_INDEX):
        if (directory / index).is_file():
            try:
                shards = sorted(set(json.loads((directory / index).read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as e:
                return [], [f"{index} is unreadable ({e})"]
            missing = [s for s in shards if not (directory / s).is_file()]
            if missing:
                return [], [
                    f"{index} lists {len(shards)} shards and {', '.join(missing[:3])}"
                    f"{' ...' if len(missing) > 3 else ''} {'is' if len(missing) == 1 else 'are'} missing"
                ]
            return [directory / s for s in shards], []
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))
    files = [f for f in files if f.name != "training_args.bin"]
    if not files:
        return [], [f"no weights in {directory} (config.json is there, but no *.safetensors or pytorch_model*.bin)"]
    return files, []


def no_weight_files(directory: Path) -> bool:
    """The directory holds no weight file and no index of one (a config.json before the download)."""
    return not any((directory / index).is_file() for index in (INDEX, BIN_INDEX)) and not any(
        f.name != "training_args.bin" for pattern in ("*.safetensors", "*.bin") for f in directory.glob(pattern)
    )


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of safetensors files, from their headers (no tensor is read)."""
    from safetensors import safe_open  # (a transformers dependency; only checks of a model directory need it)

    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _renamed_on_load(model_type: str) -> bool:
    """Whether transformers renames or fuses this architecture's checkpoint tensors while loading."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # (transformers 5 only: optional)
    except ImportError:
        return False
    return get_checkpoint_conversion_mapping(model_type) is not None


def weights_problems(directory: str | Path, model: Optional[nn.Module] = None, limit: int = 3) -> list[str]:
    """What keeps the weights in ``directory`` from loading into ``model`` (its config's build on
    the meta device; None: the files' presence only): missing files, tensors the config defines
    that the files lack, shapes that differ. At most ``limit`` tensors are named per kind."""
    directory = Path(directory)
    files, problems = weight_files(directory)
    if problems or model is None or any(f.suffix != ".safetensors" for f in files):
        return problems
    if _renamed_on_load(getattr(model.config, "model_type", "")) or getattr(model.config, "quantization_config", None):
        return []  # (tensors renamed, fused or packed while loading: their names and shapes are not the model's)
    try:
        found = safetensors_shapes(files)
    except Exception as e:  # noqa: BLE001 - a damaged header: whatever safetensors raises
        return [f"the weights' headers do not read ({type(e).__name__}: {e})"]
    prefix = getattr(model, "base_model_prefix", "") or ""
    may_miss = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or []]
    missing, wrong = [], []
    for name, param in model.named_parameters():  # (a tied head is the embedding's parameter: listed once)
        names = (name, name[len(prefix) + 1 :] if name.startswith(prefix + ".") else f"{prefix}.{name}")
        stored = next((n for n in names if n in found), None)
        if stored is None:
            if not any(p.search(name) for p in may_miss):  # (transformers fills those itself)
                missing.append(name)
        elif found[stored] != tuple(param.shape):
            wrong.append(f"{stored} is {list(found[stored])}, the config makes {list(param.shape)}")
    if wrong:
        problems.append(
            f"weights of another shape than config.json's: {'; '.join(wrong[:limit])}"
            + (f" (and {len(wrong) - limit} more)" if len(wrong) > limit else "")
        )
    if missing:
        problems.append(
            f"{len(missing)} of the config's {sum(1 for _ in model.parameters())} tensors are not in "
            f"the weights ({', '.join(missing[:limit])}{' ...' if len(missing) > limit else ''}): "
            f"transformers would initialise them at random"
        )
    return problems

"""Prompt datasets in the reference (verl) parquet format, tokenised once at start-up.

A row: ``data_source`` (str), ``prompt`` (a list of chat messages ``{role, content}``),
``ability`` (str, optional), ``reward_model`` (``{style, ground_truth}``), ``extra_info`` (dict,
optional). Prompts go through the tokenizer's chat template with the generation prompt appended.
Every problem is found before training starts and named by file, row index and column.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from rlhf_hpc.config.plugin_class import import_entry
from rlhf_hpc.config.schema import CustomClsConfig, DataConfig
from rlhf_hpc.config.verl_recipes import verl_recipe_code
from rlhf_hpc.data.synthetic_tasks import synthetic_rows

__all__ = [
    "DataError",
    "Example",
    "StatefulSampler",
    "chat_token_ids",
    "check_data_files",
    "load_examples",
    "read_rows",
]


class DataError(ValueError):
    """A bad data file or row; the message names the file, the row and the column."""


@dataclass
class Example:
    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    index: int = 0
    messages: list[dict] = field(default_factory=list)  # the prompt's chat messages (reward-model re-encoding)
    reward_style: str = "rule"  # reward_model.style: "model" rows are scored by a reward model only


def read_rows(path: str, split_seed: int = 0, custom_cls: Optional[CustomClsConfig] = None) -> list[dict]:
    """Rows of a parquet file (or a ``synthetic://`` task) as dicts; with ``data.custom_cls`` naming a
    class of verl's recipes, as its equivalent here reads ``path`` (rlhf_hpc/config/verl_recipes.py)."""
    if path.startswith("synthetic://"):
        return synthetic_rows(path, split_seed)
    recipe_code = verl_recipe_code(custom_cls.path, custom_cls.name) if custom_cls else None
    if recipe_code is not None:
        try:
            return import_entry(recipe_code.entry)(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: not readable as {recipe_code.what} ({type(e).__name__}: {e})") from None
    import pyarrow.parquet as pq

    p = Path(path).expanduser()
    if p.is_dir():
        raise DataError(f"{path}: a directory, not a parquet file: name the file in it (e.g. {path}/train.parquet)")
    if not p.is_file():
        raise DataError(f"{path}: no such file")
    try:
        return pq.read_table(p).to_pylist()
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None


def _check_row(row: dict, where: str, prompt_key: str) -> None:
    def bad(column: str, what: str) -> DataError:
        return DataError(f"{where}, column '{column}': {what}")

    for col in ("data_source", prompt_key, "reward_model"):
        if col not in row or row[col] is None:
            raise bad(col, "missing")
    if not isinstance(row["data_source"], str):
        raise bad("data_source", f"expected a string, got {type(row['data_source']).__name__}")
    msgs = row[prompt_key]
    if (
        not isinstance(msgs, list)
        or not msgs
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        )
    ):
        raise bad(
            prompt_key,
            f"expected a non-empty list of chat messages {{role: str, content: str}}, got {str(msgs)[:80]!r}",
        )
    rm = row["reward_model"]
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise bad("reward_model", f"expected a mapping with a non-null 'ground_truth', got {str(rm)[:80]!r}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise bad("extra_info", f"expected a mapping, got {type(extra).__name__}")


def check_data_files(data: DataConfig, interactions: Optional[list[str]] = None) -> tuple[int, set[str]]:
    """Every row of the train and validation files has the columns training needs, checked where
    the launch command runs, before anything starts or is queued. Raises ``DataError`` naming the
    file, row and column of the first bad row; returns the number of rows checked and the
    ``data_source`` values they hold (what scores them). With ``interactions`` (a multi-turn run's
    interaction names) each row names one in ``extra_info.interaction_kwargs.name``, as verl requires.
    Prompt lengths need the tokenizer and are checked by the workers at start-up."""
    n, sources = 0, set()
    for key in ("train_files", "val_files"):
        value = getattr(data, key)
        for path in [value] if isinstance(value, str) else list(value or []):
            if (
                path.startswith("synthetic://")
                or not Path(path).expanduser().exists()
                or (Path(path).expanduser().is_dir() and not data.custom_cls.path)
            ):
                continue  # built in code / reported by the config check
            for i, row in enumerate(read_rows(path, custom_cls=data.custom_cls)):
                _check_row(row, f"{path}, row {i}", data.prompt_key)
                if interactions:
                    _check_interaction(row, f"{path}, row {i}", interactions)
                sources.add(row["data_source"])
                n += 1
    return n, sources


def _check_interaction(row: dict, where: str, interactions: list[str]) -> None:
    name = ((row.get("extra_info") or {}).get("interaction_kwargs") or {}).get("name")
    if name not in interactions:
        raise DataError(
            f"{where}, column 'extra_info': interaction_kwargs.name={name!r} is not an interaction of "
            f"actor_rollout_ref.rollout.multi_turn.interaction_config_path ({', '.join(interactions)}); "
            f"each row names the interaction that answers it (verl's format)"
        )


def chat_token_ids(
    tokenizer, messages: list[dict], template_kwargs: Optional[dict] = None, tools: Optional[list[dict]] = None
) -> list[int]:
    """Token ids of the chat-formatted prompt, generation prompt appended; ``template_kwargs``
    (``data.apply_chat_template_kwargs``) go to the template, e.g. ``enable_thinking``; ``tools``
    (a multi-turn run's tool schemas) too, as the template shows them to the model."""
    extra = dict(template_kwargs or {}, **({"tools": tools} if tools else {}))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def load_examples(
    files: str | list[str], tokenizer, data: DataConfig, split_seed: int = 0, tools: Optional[list[dict]] = None
) -> list[Example]:
    """Read, check and tokenise every row (``tools``: the schemas a multi-turn run shows the
    model); apply ``max_prompt_length`` with ``truncation`` (error | left | right) and
    ``filter_overlong_prompts``."""
    files = [files] if isinstance(files, str) else list(files)
    out: list[Example] = []
    read = 0
    for path in files:
        rows = read_rows(path, split_seed, data.custom_cls)
        read += len(rows)
        for i, row in enumerate(rows):
            where = f"{path}, row {i}"
            _check_row(row, where, data.prompt_key)
            ids = chat_token_ids(tokenizer, row[data.prompt_key], data.apply_chat_template_kwargs, tools)
            if len(ids) > data.max_prompt_length:
                if data.filter_overlong_prompts:
                    continue
                if data.truncation == "error":
                    raise DataError(
                        f"{where}, column '{data.prompt_key}': the prompt is {len(ids)} tokens, more than "
                        f"data.max_prompt_length={data.max_prompt_length} (set data.truncation=left|right "
                        f"or data.filter_overlong_prompts=true)"
                    )
                ids = ids[-data.max_prompt_length :] if data.truncation == "left" else ids[: data.max_prompt_length]
            out.append(
                Example(
                    prompt_ids=ids,
                    data_source=row["data_source"],
                    ground_truth=row["reward_model"]["ground_truth"],
                    extra_info=dict(row.get("extra_info") or {}),
                    index=len(out),
                    messages=list(row[data.prompt_key]),
                    reward_style=str(row["reward_model"].get("style") or "rule"),
                )
            )
    if not read:
        raise DataError(f"{', '.join(files)}: no rows (an empty data file)")
    if not out:  # only data.filter_overlong_prompts drops rows
        raise DataError(
            f"{', '.join(files)}: all {read} rows filtered out as longer than data.max_prompt_length="
            f"{data.max_prompt_length} tokens (data.filter_overlong_prompts=true): raise "
            f"data.max_prompt_length, or set data.truncation=left|right with filter_overlong_prompts=false"
        )
    return out


class StatefulSampler:
    """Batches of example indices: a new permutation per epoch (seeded), position saved in
    checkpoints, so a resumed run continues mid-epoch with the prompts an uninterrupted run would
    have used. The last incomplete batch of an epoch is dropped (every step has a full batch)."""

    def __init__(self, n: int, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size > n:
            raise DataError(
                f"data.train_batch_size={batch_size} is larger than the dataset ({n} prompts, counted "
                f"after the data.max_prompt_length filter): lower data.train_batch_size or add rows"
            )
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.epoch, self.pos = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def next_batch(self) -> list[int]:
        if self.pos + self.batch_size > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
        idx = self._order()[self.pos : self.pos + self.batch_size].tolist()
        self.pos += self.batch_size
        return idx

    def next_prompts(self, size: int) -> list[int]:
        """The next ``size`` example indices (DAPO's generation batches, data.gen_batch_size): the
        position advances by what was taken, so a resume continues exactly; an epoch's tail shorter
        than ``size`` is dropped, as ``next_batch`` does."""
        if size > self.n:
            raise DataError(f"data.gen_batch_size={size} is larger than the dataset ({self.n} prompts)")
        if self.pos + size > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
        idx = self._order()[self.pos : self.pos + size].tolist()
        self.pos += size
        return idx

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise DataError(
                f"the checkpoint's sampler saw {state['n']} prompts, this dataset has {self.n}: "
                f"resuming on different training data would not continue the same run"
            )
        self.epoch, self.pos = state["epoch"], state["pos"]

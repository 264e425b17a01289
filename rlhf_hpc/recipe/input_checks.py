"""What validation can know of a run's inputs beside the algorithm's keys, so that the dry run
refuses them naming the key: the data files (each a file, not a directory; a parquet file with
rows; the training files together at least one batch) and the data lengths the time plan assumes
(``plan.*``). The CPU calibration file is checked with the hardware keys
(rlhf_hpc.planning.hardware.hardware_problems).

Cheap on a login node: a parquet file's rows are counted from its footer (no row is read), once per
file version. A file that is not on this machine is ``missing_files``' business (a warning at a dry
run); one that is here is judged here."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Optional

from rlhf_hpc.config.schema import Config
from rlhf_hpc.config.tree import get_key

__all__ = ["data_file_problems", "input_problems", "parquet_rows", "plan_problems"]

PREPARE = "python -m rlhf_hpc.data.prepare writes them"


def input_problems(cfg: Config) -> list[str]:
    """Every problem of the plan keys and the data files, one message each naming its key."""
    return plan_problems(cfg) + data_file_problems(cfg)


def plan_problems(cfg: Config) -> list[str]:
    """``plan.prompt_length`` / ``plan.response_length``: the data's mean tokens per prompt and per
    response, null (unset) for the maxima; one that is set is > 0 and at most its maximum. The
    multi-turn keys (``plan.assistant_turns``, ``tool_response_length``, ``tool_seconds``) only with
    multi-turn, each in its range."""
    out = []
    for name, limit_key in (
        ("prompt_length", "data.max_prompt_length"),
        ("response_length", "data.max_response_length"),
    ):
        value, limit = getattr(cfg.plan, name), get_key(cfg, limit_key)
        what = name.split("_")[0]
        if value is None:
            continue
        if value <= 0:
            out.append(
                f"plan.{name}={value}: the data's mean {what} length in tokens must be > 0; to plan with "
                f"the maximum ({limit_key}={limit}) leave plan.{name} unset (null)"
            )
        elif limit > 0 and value > limit:
            out.append(
                f"plan.{name}={value} is larger than {limit_key}={limit}: a mean cannot pass the maximum; "
                f"set plan.{name} <= {limit} (or null: plan with the maximum), or raise {limit_key}"
            )
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    turn_keys = {k: getattr(cfg.plan, k) for k in ("assistant_turns", "tool_response_length", "tool_seconds")}
    if not mt.enable:
        out += [
            f"plan.{k}={v}: planned for multi-turn runs only; set actor_rollout_ref.rollout.multi_turn.enable=true "
            f"or leave plan.{k} unset (null)"
            for k, v in turn_keys.items()
            if v is not None
        ]
        return out
    turns = turn_keys["assistant_turns"]
    if turns is not None and (turns < 1 or (mt.max_assistant_turns and turns > mt.max_assistant_turns)):
        out.append(
            f"plan.assistant_turns={turns}: the mean assistant turns of a conversation is at least 1"
            + (
                f" and at most multi_turn.max_assistant_turns={mt.max_assistant_turns}"
                if mt.max_assistant_turns
                else ""
            )
        )
    if turn_keys["tool_response_length"] is not None and turn_keys["tool_response_length"] <= 0:
        out.append(
            f"plan.tool_response_length={turn_keys['tool_response_length']}: the mean tokens of a tool turn "
            f"must be > 0 (null: multi_turn.max_tool_response_length characters / 4)"
        )
    if turn_keys["tool_seconds"] is not None and turn_keys["tool_seconds"] < 0:
        out.append(f"plan.tool_seconds={turn_keys['tool_seconds']}: seconds cannot be negative")
    return out


@functools.lru_cache(maxsize=64)
def _footer_rows(path: str, mtime_ns: int, size: int) -> int:
    """Rows of a parquet file from its footer; (mtime_ns, size) key the cache: validation runs
    again for each candidate the time plan's advice tries."""
    import pyarrow.parquet as pq  # (only configs naming data files need pyarrow)

    return pq.ParquetFile(path).metadata.num_rows


def parquet_rows(path: str) -> int:
    """Rows of the parquet file at ``path`` from its footer, without reading them (raises what
    pyarrow raises for a file that is not parquet)."""
    st = os.stat(path)
    return _footer_rows(path, st.st_mtime_ns, st.st_size)


def _file_rows(key: str, path: str) -> tuple[Optional[int], Optional[str]]:
    """(rows of one data file, or None where they cannot be counted here; a problem, or None)."""
    if path.startswith("synthetic://"):
        return None, None  # built in code
    p = Path(path).expanduser()
    if not p.exists():
        return None, None  # missing_files: an error at a launch, a warning at a dry run
    if p.is_dir():
        inside = sorted(f.name for f in p.glob("*.parquet") if f.is_file())
        hint = (
            f"it holds {', '.join(inside[:4])}{', ...' if len(inside) > 4 else ''}: name one, or list them "
            f"({key}=[{p / inside[0]}, ...])"
            if inside
            else f"{PREPARE} as <dir>/train.parquet, <dir>/test.parquet"
        )
        return None, f"{key}: '{path}' is a directory; a data file is one parquet file in verl's format ({hint})"
    if not p.is_file():
        return None, f"{key}: '{path}' is not a regular file; expected a parquet file in verl's format"
    if p.stat().st_size == 0:
        return None, f"{key}: '{path}' is empty (0 bytes); expected a parquet file with rows ({PREPARE})"
    try:
        rows = parquet_rows(str(p))
    except Exception as e:  # pyarrow raises several types (ArrowInvalid, OSError, ...) for a file that is not parquet
        return None, (
            f"{key}: '{path}' is not a readable parquet file ({type(e).__name__}: {str(e)[:160]}); data "
            f"files are parquet in verl's format ({PREPARE})"
        )
    if rows == 0:
        return 0, f"{key}: '{path}' has no rows ({PREPARE})"
    return rows, None


def _paths(value: Any) -> list[tuple[int, str]]:
    return [(-1, value)] if isinstance(value, str) else list(enumerate(value or []))


def data_file_problems(cfg: Config) -> list[str]:
    """The train and validation files that are on this machine: each a parquet file (not a
    directory) with rows; the train files together hold at least one batch (data.train_batch_size,
    or data.gen_batch_size with DAPO's dynamic sampling). The count is the files' raw rows: the
    ranks count again after the data.max_prompt_length filter, which can only lower it."""
    d, out = cfg.data, []
    counts: dict[str, list[Optional[int]]] = {}
    for key in ("data.train_files", "data.val_files"):
        counts[key] = []
        for i, path in _paths(get_key(cfg, key)):
            rows, problem = (
                (None, None)
                if d.custom_cls.path
                # (read by its class: the ranks count them)
                else _file_rows(key if i < 0 else f"{key}[{i}]", path)
            )
            counts[key].append(rows)
            if problem:
                out.append(problem)
    train = counts["data.train_files"]
    need, need_key = d.train_batch_size, "data.train_batch_size"
    if cfg.algorithm.filter_groups.enable and (d.gen_batch_size or 0) > need:
        need, need_key = d.gen_batch_size, "data.gen_batch_size"
    if train and None not in train and 0 < sum(train) < need:
        out.append(
            f"data.train_files: {sum(train)} rows in all, fewer than {need_key}={need} prompts a step "
            f"takes, so not one batch (rows counted in the files, before the data.max_prompt_length "
            f"filter, which can only lower the count; the ranks count again after it); lower {need_key} "
            f"or add rows"
        )
    return out

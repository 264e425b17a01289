"""Code of verl's recipes that a verl command line names by file (``custom_reward_function.path`` /
``.name``, ``data.custom_cls.path`` / ``.name``) and that has an equivalent here. Those files import
verl, which is not here, so they are never read: the equivalent (``entry``, ``module:name``,
imported where it runs) takes their place, and the dry run says so in one line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Optional

__all__ = ["VERL_RECIPE_CODE", "VerlRecipeCode", "verl_recipe_code"]


@dataclass(frozen=True)
class VerlRecipeCode:
    file: str  # the file's path in verl's recipes, matched by the end of the path given
    name: str  # the function or class the command line names in it
    entry: str  # this project's equivalent
    what: str  # what it is, for the dry run's note


VERL_RECIPE_CODE = (
    VerlRecipeCode(
        "retool/retool.py",
        "compute_score",
        "rlhf_hpc.rewards.retool_reward:compute_score",
        "ReTool's reward (\\boxed{} strict, -1 wrong, less negative the more turns)",
    ),
    VerlRecipeCode(
        "retool/retool.py",
        "CustomRLHFDataset",
        "rlhf_hpc.data.retool_dataset:retool_rows",
        "ReTool's dataset (DAPO-Math-17k and AIME directories, its answer format appended)",
    ),
)


def verl_recipe_code(path: Optional[str], name: Optional[str]) -> Optional[VerlRecipeCode]:
    """The entry for ``path`` (any prefix before the recipe's own path: ``$PROJECT_DIR/recipe/...``)
    and ``name``; None if it is not one."""
    if not path or not name:
        return None
    given = PurePosixPath(str(path).replace("\\", "/"))
    for code in VERL_RECIPE_CODE:
        parts = PurePosixPath(code.file).parts
        if code.name == name and given.parts[-len(parts) :] == parts:
            return code
    return None

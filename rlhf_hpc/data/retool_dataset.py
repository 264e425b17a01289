"""ReTool's dataset (verl-recipe ``retool/retool.py: CustomRLHFDataset``): its train and test sets
as downloaded from the Hugging Face hub, each a directory of parquet files. AIME 2024/2025
(``Maxwell-Jia/AIME_2024``, ``yentinglin/aime_2025``, named by the directory's last two parts as
ReTool names them) become verl rows from their problem and answer columns; any other set
(DAPO-Math-17k) is in verl's format already. Every prompt gets ReTool's answer format."""

from __future__ import annotations

from pathlib import Path

__all__ = ["ANSWER_FORMAT", "retool_rows"]

ANSWER_FORMAT = "\nThe answer format must be: \\boxed{'The final answer goes here.'}"
AIME_COLUMNS = {"Maxwell-Jia/AIME_2024": ("Problem", "Answer"), "yentinglin/aime_2025": ("problem", "answer")}


def retool_rows(path: str) -> list[dict]:
    """The rows of one of ReTool's data directories (or a parquet file) as ReTool maps them."""
    import pyarrow.parquet as pq

    p = Path(path).expanduser()
    files = sorted(f for f in p.rglob("*.parquet") if f.is_file()) if p.is_dir() else [p]
    if not files:
        raise ValueError(
            f"{path}: no parquet files in the directory (ReTool's sets as the hub holds them: "
            f"hf download --repo-type dataset <name> --local-dir <dir>)"
        )
    records = [r for f in files for r in pq.read_table(f).to_pylist()]
    source = "/".join(str(path).rstrip("/").split("/")[-2:])
    if source in AIME_COLUMNS:
        problem, answer = AIME_COLUMNS[source]
        return [
            {
                "data_source": source.split("/")[1].lower(),
                "prompt": [{"role": "user", "content": r[problem] + ANSWER_FORMAT}],
                "ability": "MATH",
                "reward_model": {"ground_truth": str(r[answer])},
                "agent_name": "tool_agent",
            }
            for r in records
        ]
    for r in records:
        r["prompt"][0]["content"] += ANSWER_FORMAT
        r["agent_name"] = "tool_agent"
    return records

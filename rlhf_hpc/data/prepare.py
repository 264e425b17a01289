"""Write train/test parquet in the reference format from a dataset's original files.

    python -m rlhf_hpc.data.prepare gsm8k --src DIR_OR_HF_NAME --out DIR
    python -m rlhf_hpc.data.prepare gsm8k_multiturn --src DIR_OR_HF_NAME --out DIR
    python -m rlhf_hpc.data.prepare gsm8k_multiturn_w_interaction --src DIR_OR_HF_NAME --out DIR
    python -m rlhf_hpc.data.prepare search_r1 --src DIR --out DIR

``gsm8k_multiturn`` writes the rows of verl's ``gsm8k_multiturn_w_tool.py``: a system prompt asking
for the ``calc_gsm8k_reward`` tool, and each row's ground truth as that tool's ``create_kwargs``
(``extra_info.tools_kwargs``), for a multi-turn run with verl's GSM8K tool config.
``gsm8k_multiturn_w_interaction`` writes those of ``gsm8k_multiturn_w_interaction.py``: a system
prompt asking to reconsider an answer the user calls wrong, and each row's
``extra_info.interaction_kwargs`` naming verl's GSM8K interaction. ``search_r1`` writes those of
verl's ``preprocess_search_r1_dataset.py`` from Search-R1's ``train.parquet``/``test.parquet``
(``PeterJinGo/nq_hotpotqa_train`` as the hub holds it, in ``--src``): Search-R1's instruction,
``data_source`` ``searchR1_<set>``, the golden answers as the ground truth, the search tool's
arguments.

``--src`` is a directory holding GSM8K's original ``train.jsonl``/``test.jsonl`` (``question``,
``answer`` ending in ``#### N``) or a Hugging Face datasets name (``openai/gsm8k``; needs the
``datasets`` package and the dataset in its cache or network access).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlhf_hpc.rewards.gsm8k import ground_truth_from_answer

__all__ = ["gsm8k_interaction_rows", "gsm8k_multiturn_rows", "gsm8k_rows", "main", "search_r1_rows"]

GSM8K_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(records: list[dict], split: str) -> list[dict]:
    rows = []
    for i, rec in enumerate(records):
        try:
            truth = ground_truth_from_answer(rec["answer"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"{split} record {i}: {e}") from None
        rows.append(
            {
                "data_source": GSM8K_SOURCE,
                "prompt": [{"role": "user", "content": rec["question"] + " " + GSM8K_INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": split, "index": i, "answer": rec["answer"], "question": rec["question"]},
            }
        )
    return rows


# the system prompt of verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py (data: the same prompts)
GSM8K_TOOL_SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. You should use the `calc_gsm8k_reward` tool after "
    "step by step solving the question, before generate final answer at least once and refine your "
    "answer if necessary. Put your final answer in the format of `#### <answer>`."
)
GSM8K_TOOL_INSTRUCTION = "Let's think step by step and output the final answer after `####`."


def gsm8k_multiturn_rows(records: list[dict], split: str) -> list[dict]:
    """``gsm8k_rows`` for the multi-turn example: verl's system prompt and instruction, the tool's arguments."""
    rows = gsm8k_rows(records, split)
    for row, rec in zip(rows, records):
        truth = row["reward_model"]["ground_truth"]
        row["prompt"] = [
            {"role": "system", "content": GSM8K_TOOL_SYSTEM},
            {"role": "user", "content": rec["question"] + " " + GSM8K_TOOL_INSTRUCTION},
        ]
        row["extra_info"].update(
            need_tools_kwargs=True,
            tools_kwargs={"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
            interaction_kwargs={"query": rec["question"], "ground_truth": truth},
        )
    return rows


# the system prompt of verl's examples/data_preprocess/gsm8k_multiturn_w_interaction.py
GSM8K_INTERACTION_SYSTEM = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "You should rethinking carefully if user point out your answer is wrong. Put your final "
    "answer in the format of `#### <answer>`."
)


def gsm8k_interaction_rows(records: list[dict], split: str) -> list[dict]:
    """``gsm8k_rows`` for verl's interaction example: its system prompt and instruction, and the
    interaction each row names (``gsm8k``) with its query and ground truth."""
    rows = gsm8k_rows(records, split)
    for row, rec in zip(rows, records):
        question = rec["question"] + " " + GSM8K_TOOL_INSTRUCTION
        row["prompt"] = [{"role": "system", "content": GSM8K_INTERACTION_SYSTEM}, {"role": "user", "content": question}]
        row["extra_info"]["interaction_kwargs"] = {
            "name": "gsm8k",
            "query": question,
            "ground_truth": row["reward_model"]["ground_truth"],
        }
    return rows


# the prompt of verl's examples/data_preprocess/preprocess_search_r1_dataset.py
SEARCH_R1_SYSTEM = "You are a helpful and harmless assistant."
SEARCH_R1_INSTRUCTION = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. After reasoning, if you find you lack some knowledge, you can call a search engine by <tool_call> "
    "query </tool_call> and it will return the top searched results between <tool_response> and </tool_response>. "
    "You can search as many times as your want. If you find no further external knowledge needed, you can directly "
    "provide the answer inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing "
    "</answer>. Question: "
)


def search_r1_rows(records: list[dict], split: str) -> list[dict]:
    """Search-R1's records (``question``, ``golden_answers``, ``data_source``, ...) as verl's rows."""
    rows = []
    for i, rec in enumerate(records):
        try:
            question = rec["question"]
            truth = (rec.get("reward_model") or {}).get("ground_truth") or {"target": list(rec["golden_answers"])}
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"{split} record {i}: {type(e).__name__}: {e} (expected Search-R1's question and golden_answers)"
            ) from None
        source = f"searchR1_{rec.get('data_source', '')}"
        tools_kwargs = {
            "search": {"create_kwargs": {"ground_truth": truth, "question": question, "data_source": source}}
        }
        rows.append(
            {
                "data_source": source,
                "prompt": [
                    {"role": "system", "content": SEARCH_R1_SYSTEM},
                    {"role": "user", "content": SEARCH_R1_INSTRUCTION + question},
                ],
                "ability": rec.get("ability") or "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {
                    "index": i,
                    "need_tools_kwargs": True,
                    "question": question,
                    "split": split,
                    "tools_kwargs": tools_kwargs,
                },
            }
        )
    return rows


def read_parquet_split(src: str, split: str) -> list[dict]:
    import pyarrow.parquet as pq

    file = Path(src).expanduser() / f"{split}.parquet"
    if not file.is_file():
        raise SystemExit(f"error: {file}: missing (expected the set's {split}.parquet)")
    return pq.read_table(file).to_pylist()


ROW_WRITERS = {
    "gsm8k": gsm8k_rows,
    "gsm8k_multiturn": gsm8k_multiturn_rows,
    "gsm8k_multiturn_w_interaction": gsm8k_interaction_rows,
    "search_r1": search_r1_rows,
}


def read_gsm8k(src: str, split: str) -> list[dict]:
    path = Path(src).expanduser()
    if path.is_dir():
        file = path / f"{split}.jsonl"
        if not file.is_file():
            raise SystemExit(f"error: {file}: missing (expected GSM8K's original {split}.jsonl)")
        records = []
        for n, line in enumerate(file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError as e:  # json's JSONDecodeError
                raise SystemExit(f"error: {file}, line {n}: not a JSON record ({e})") from None
        return records
    try:
        import datasets
    except ImportError:
        raise SystemExit(
            f"--src {src} is not a directory, and reading a datasets name needs the 'datasets' "
            f"package (pip install datasets)"
        ) from None
    return list(datasets.load_dataset(src, "main", split=split))


def write_parquet(rows: list[dict], out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_hpc.data.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", choices=list(ROW_WRITERS))
    ap.add_argument("--src", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    for split in ("train", "test"):
        records = read_parquet_split(args.src, split) if args.dataset == "search_r1" else read_gsm8k(args.src, split)
        try:
            rows = ROW_WRITERS[args.dataset](records, split)
        except ValueError as e:
            raise SystemExit(f"error: --src {args.src}: {e}") from None
        if not rows:  # an empty parquet would only be refused at the launch
            raise SystemExit(f"error: --src {args.src}: the {split} split has no records; nothing written")
        write_parquet(rows, Path(args.out) / f"{split}.parquet")
        print(f"{split}: {len(rows)} rows -> {Path(args.out) / f'{split}.parquet'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

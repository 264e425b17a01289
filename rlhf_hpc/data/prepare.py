"""Write train/test parquet in the reference format from a dataset's original files.

    python -m rlhf_hpc.data.prepare gsm8k --src DIR_OR_HF_NAME --out DIR

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

__all__ = ["gsm8k_rows", "main"]

GSM8K_SOURCE = "openai/gsm8k"
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def gsm8k_rows(records: list[dict], split: str) -> list[dict]:
    rows = []
    for i, rec in enumerate(records):
        try:
            truth = ground_truth_from_answer(rec["answer"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"{split} record {i}: {e}") from None
        rows.append({"data_source": GSM8K_SOURCE,
                     "prompt": [{"role": "user", "content": rec["question"] + " " + GSM8K_INSTRUCTION}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": truth},
                     "extra_info": {"split": split, "index": i, "answer": rec["answer"], "question": rec["question"]}})
    return rows


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
        raise SystemExit(f"--src {src} is not a directory, and reading a datasets name needs the 'datasets' "
                         f"package (pip install datasets)") from None
    return list(datasets.load_dataset(src, "main", split=split))


def write_parquet(rows: list[dict], out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_hpc.data.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("dataset", choices=["gsm8k"])
    ap.add_argument("--src", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    for split in ("train", "test"):
        rows = gsm8k_rows(read_gsm8k(args.src, split), split)
        if not rows:  # an empty parquet would only be refused at the launch
            raise SystemExit(f"error: --src {args.src}: the {split} split has no records; nothing written")
        write_parquet(rows, Path(args.out) / f"{split}.parquet")
        print(f"{split}: {len(rows)} rows -> {Path(args.out) / f'{split}.parquet'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Data in the reference format, the stateful sampler, GSM8K preparation and rule rewards."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_hpc.config.schema import DataConfig
from rlhf_hpc.data.dataset import DataError, StatefulSampler, load_examples
from rlhf_hpc.data.prepare import gsm8k_rows
from rlhf_hpc.data.synthetic_tasks import synthetic_rows
from rlhf_hpc.models.tokenizer import build_tiny_tokenizer
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rewards import RewardFunction, rule_score
from rlhf_hpc.rewards.gsm8k import extract_answer, gsm8k_score
from rlhf_hpc.rewards.math import boxed_score, last_boxed
from rlhf_hpc.rewards.synthetic_scores import copy_score
from tests.conftest import REPO

TOK = build_tiny_tokenizer()


def row(content="copy: 1", **kw):
    r = {
        "data_source": "synthetic/copy",
        "prompt": [{"role": "user", "content": content}],
        "ability": "copy",
        "reward_model": {"style": "rule", "ground_truth": "1"},
        "extra_info": {"index": 0},
    }
    r.update(kw)
    return r


def write(tmp_path, rows, name="d.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# --------------------------------------------------------------------------------------- dataset
def test_rows_become_chat_formatted_prompts(tmp_path):
    path = write(tmp_path, [row("copy: 1"), row("copy: 22")])
    ex = load_examples(path, TOK, DataConfig(max_prompt_length=64))
    assert TOK.decode(ex[1].prompt_ids) == "<|im_start|>user\ncopy: 22<|im_end|>\n<|im_start|>assistant\n"
    assert (ex[0].data_source, ex[0].ground_truth, ex[0].extra_info) == ("synthetic/copy", "1", {"index": 0})


@pytest.mark.parametrize(
    "bad,column,what",
    [
        ({"data_source": None}, "data_source", "missing"),
        ({"prompt": "copy: 1"}, "prompt", "expected a non-empty list of chat messages"),
        ({"reward_model": {"style": "rule"}}, "reward_model", "expected a mapping with a non-null 'ground_truth'"),
    ],
)
def test_a_bad_row_names_file_row_and_column(tmp_path, bad, column, what):
    rows = [row(), row(), {**row(), **bad}]
    path = write(tmp_path, rows) if column != "prompt" else None
    if path is None:  # parquet cannot mix list and string in one column: a file of its own
        path = write(tmp_path, [row(), row(), {**row(), "prompt": None}])
        what = "missing"
    with pytest.raises(DataError) as e:
        load_examples(path, TOK, DataConfig(max_prompt_length=64))
    assert str(e.value).startswith(f"{path}, row 2, column '{column}': {what}")


def test_wrong_type_in_messages(tmp_path):
    path = write(tmp_path, [row(), {**row(), "prompt": [{"role": "user", "text": "x"}]}])
    with pytest.raises(DataError, match=r"row 1, column 'prompt': expected a non-empty list of chat messages"):
        load_examples(path, TOK, DataConfig(max_prompt_length=64))


def test_overlong_prompts_error_truncate_or_filter(tmp_path):
    path = write(tmp_path, [row("copy: 1"), row("copy: " + "9" * 40)])
    with pytest.raises(DataError) as e:
        load_examples(path, TOK, DataConfig(max_prompt_length=32))
    assert str(e.value).startswith(
        f"{path}, row 1, column 'prompt': the prompt is 65 tokens, more than "
        "data.max_prompt_length=32 (set data.truncation=left|right"
    )
    left = load_examples(path, TOK, DataConfig(max_prompt_length=32, truncation="left"))
    right = load_examples(path, TOK, DataConfig(max_prompt_length=32, truncation="right"))
    assert len(left[1].prompt_ids) == len(right[1].prompt_ids) == 32
    assert TOK.decode(left[1].prompt_ids).endswith("<|im_start|>assistant\n")
    assert TOK.decode(right[1].prompt_ids).startswith("<|im_start|>user\ncopy: 9")
    kept = load_examples(path, TOK, DataConfig(max_prompt_length=32, filter_overlong_prompts=True))
    assert len(kept) == 1


def test_not_parquet_and_missing_files(tmp_path):
    (tmp_path / "x.parquet").write_text("hello")
    with pytest.raises(DataError, match="x.parquet: not a readable parquet file"):
        load_examples(str(tmp_path / "x.parquet"), TOK, DataConfig())
    with pytest.raises(DataError, match="nope.parquet: no such file"):
        load_examples(str(tmp_path / "nope.parquet"), TOK, DataConfig())


# --------------------------------------------------------------------------------------- sampler
def test_sampler_resumes_mid_epoch_with_the_same_prompts():
    a = StatefulSampler(10, 3, seed=5)
    uninterrupted = [a.next_batch() for _ in range(7)]  # crosses two epoch boundaries
    b = StatefulSampler(10, 3, seed=5)
    first = [b.next_batch() for _ in range(4)]
    c = StatefulSampler(10, 3, seed=5)
    c.load_state_dict(b.state_dict())
    assert first + [c.next_batch() for _ in range(3)] == uninterrupted
    assert uninterrupted[0] != uninterrupted[3]  # a new permutation each epoch
    assert all(len(set(x)) == 3 for x in uninterrupted)
    with pytest.raises(DataError, match="saw 10 prompts, this dataset has 11"):
        StatefulSampler(11, 3, seed=5).load_state_dict(b.state_dict())


# ------------------------------------------------------------------------------------- rewards
def test_synthetic_task_and_score():
    rows = synthetic_rows("synthetic://copy?targets=ab&size=5", 0)
    assert len(rows) == 5 and {r["reward_model"]["ground_truth"] for r in rows} <= {"a", "b"}
    assert copy_score("aaab", "a") == 0.75 and copy_score("", "a") == 0.0 and copy_score(" a \n", "a") == 1.0


def test_gsm8k_strict_and_flexible():
    assert gsm8k_score("so the answer is\n#### 1,234", "1234") == 1.0
    assert gsm8k_score("#### 12 and later #### 13", "13") == 1.0
    assert gsm8k_score("the answer is 13", "13") == 0.0  # strict needs the #### format
    assert extract_answer("the answer is 13.", "flexible") == "13"
    assert extract_answer("x = 5, y = 13", "flexible") == "13"
    assert extract_answer("no digits", "flexible") is None


# formats of a correct final answer a person reads as the number itself
RIGHT = [
    "#### 18",
    "#### $18",
    "####18",
    "#### 18.00",
    "#### 18.",
    "#### $ 18",
    "#### 18 dollars",
    "so she makes $18.\n#### 18.0",
    "#### 1,234 is wrong, the total is\n#### 18",
]


@pytest.mark.parametrize("text", RIGHT)
def test_gsm8k_formats_of_a_right_answer_score_one(text):
    assert gsm8k_score(text, "18") == 1.0
    assert gsm8k_score(text, "18", method="flexible") == 1.0  # the last number is the answer too


@pytest.mark.parametrize(
    "text,truth",
    [
        ("#### 1,234", "1234"),
        ("#### $1,234.00", "1234"),
        ("#### -7", "-7"),
        ("#### 0.50", "0.5"),
        ("#### .5", "0.5"),
        ("#### 1,234,567", "1234567"),
    ],
)
def test_gsm8k_number_formats(text, truth):
    assert gsm8k_score(text, truth) == 1.0 and gsm8k_score(text, truth, method="flexible") == 1.0


@pytest.mark.parametrize(
    "text", ["#### 19", "#### 18.5", "#### 180", "#### 1,8", "#### -18", "#### eighteen", "18", "#### 18 then #### 17"]
)
def test_gsm8k_wrong_answers_stay_wrong(text):
    assert gsm8k_score(text, "18") == 0.0


def test_boxed_math():
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{3}") == "3"
    assert boxed_score(r"answer: \boxed{\dfrac{1}{2}}", r"\frac{1}{2}") == 1.0
    assert boxed_score(r"\boxed{4.0}", "4") == 1.0
    assert boxed_score(r"\boxed{5}", "4") == 0.0 and boxed_score("5", "5") == 0.0


def test_dispatch_and_custom_function(tmp_path):
    assert rule_score("openai/gsm8k", "#### 7", "7", {}) == 1.0
    with pytest.raises(ValueError, match="no rule reward for data_source 'my/data'"):
        rule_score("my/data", "x", "y", {})
    fn = tmp_path / "reward.py"
    fn.write_text(
        "def score(data_source, response, ground_truth, extra_info):\n"
        "    return float(len(response) == int(ground_truth))\n"
    )
    cfg, _ = load_config("tiny_klppo", [f"custom_reward_function.path={fn}", "custom_reward_function.name=score"])
    reward = RewardFunction(cfg.custom_reward_function)
    assert reward("my/data", "abc", "3", {}) == 1.0
    with pytest.raises(RuntimeError, match=r"failed on prompt row 17 \(data_source 'my/data'\): ValueError"):
        reward("my/data", "abc", "three", {}, row=17)
    cfg.custom_reward_function.name = "nope"
    with pytest.raises(ValueError, match="has no function 'nope'"):
        RewardFunction(cfg.custom_reward_function)


# ------------------------------------------------------------------------------- real GSM8K
def test_gsm8k_reference_answers_score_one_and_perturbed_zero(shared_dir):
    records = [json.loads(line) for line in (shared_dir / "data/gsm8k/test.jsonl").read_text().splitlines()]
    rows = gsm8k_rows(records, "test")  # every ground truth parses, or this raises naming the record
    assert len(rows) == 1319
    for rec, r in zip(records, rows):
        truth = r["reward_model"]["ground_truth"]
        assert gsm8k_score(rec["answer"], truth) == 1.0
        assert gsm8k_score(rec["answer"], truth, method="flexible") == 1.0
        perturbed = rec["answer"].rsplit("#### ", 1)[0] + f"#### {int(float(truth)) + 1}"
        assert gsm8k_score(perturbed, truth) == 0.0


@pytest.mark.slow
def test_prepare_cli_and_loading_with_the_real_qwen2_tokenizer(shared_dir, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_hpc.data.prepare",
            "gsm8k",
            "--src",
            str(shared_dir / "data/gsm8k"),
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "train: 7473 rows" in out.stdout and "test: 1319 rows" in out.stdout
    table = pq.read_table(tmp_path / "test.parquet")
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    first = table.slice(0, 1).to_pylist()[0]
    assert first["data_source"] == "openai/gsm8k" and first["reward_model"]["ground_truth"] == "18"
    assert first["prompt"][0]["content"].endswith('output the final answer after "####".')
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(shared_dir / "assets/qwen2-tokenizer")
    ex = load_examples(str(tmp_path / "test.parquet"), tok, DataConfig(max_prompt_length=512))
    assert len(ex) == 1319
    text = tok.decode(ex[0].prompt_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nJanet")
    assert text.endswith("<|im_start|>assistant\n")

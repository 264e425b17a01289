"""Tasks built in code: ``synthetic://copy`` (the CPU demo) and ``synthetic://add`` (the smallest
real run).

``copy``: the prompt names a target character ("copy: 3"); the reward is the share of the
response's characters that equal it. A randomly initialised tiny model starts near chance (1/50 per
character with the ``tiny://chars`` tokenizer) and PPO measurably teaches it to copy within minutes
on a CPU: the signal is dense (every character counts) and needs the model to read its prompt.
Options: ``synthetic://copy?targets=0123&size=512`` (characters to copy, number of rows).

``add``: "What is 7 + 5? Answer with only the number."; the reward is 1 when the last integer of
the response is the sum. A real instruction-tuned model knows the format and some sums, which is
what RL needs to start from: SmolLM2-135M-Instruct answers single-digit sums right about one time
in five at temperature 1 (BENCHMARKS.md). Options: ``synthetic://add?max=9&size=512`` (largest
operand, number of rows).

``lookup``: "code of ab?"; the code is a digit only the ``lookup`` tool returns (a multi-turn run,
``actor_rollout_ref.rollout.multi_turn``); the reward is 1 when the model ends with ``#### <code>``.
Keys are two lowercase letters. Options: ``synthetic://lookup?size=512``. A model that makes the
calls: ``python -m rlhf_hpc.data.tool_warm_start`` (rlhf_hpc/data/tool_warm_start.py).

``code``: "Write a Python program that reads an integer n and prints n + 3." (a few kinds of one-line
stdin/stdout programs, ``CODE_TASKS``); the reward is verl's code score: the share of the row's
3 test cases the response's last ```python block passes, each run in the sandbox
(rlhf_hpc/tools/sandbox.py). Options: ``synthetic://code?size=512``.

Rows come out in the reference data format, so they go through the same pipeline as parquet data.
"""

from __future__ import annotations

import json
import random
from urllib.parse import parse_qsl, urlparse

from rlhf_hpc.rewards.synthetic_scores import ADD_SOURCE, CODE_SOURCE, LOOKUP_SOURCE
from rlhf_hpc.rewards.synthetic_scores import COPY_SOURCE as DATA_SOURCE
from rlhf_hpc.tools.lookup_tool import lookup_code

__all__ = [
    "CODE_TASKS",
    "LOOKUP_KEYS",
    "addition_rows",
    "code_rows",
    "lookup_question",
    "lookup_rows",
    "synthetic_rows",
]

LOOKUP_KEYS = [a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]


def synthetic_rows(url: str, split_seed: int) -> list[dict]:
    """Rows for ``synthetic://<task>[?...]`` (copy, add, lookup, code); ``split_seed`` tells train
    from val."""
    parsed = urlparse(url)
    if parsed.netloc not in ("copy", "add", "lookup", "code"):
        raise ValueError(
            f"unknown synthetic task '{url}'; the built-in ones are synthetic://copy, synthetic://add, "
            f"synthetic://lookup and synthetic://code"
        )
    opts = dict(parse_qsl(parsed.query))
    if parsed.netloc == "code":
        return code_rows(int(opts.get("size", 512)), split_seed)
    if parsed.netloc == "add":
        return addition_rows(int(opts.get("max", 9)), int(opts.get("size", 512)), split_seed)
    if parsed.netloc == "lookup":
        rng = random.Random(split_seed)
        return lookup_rows([rng.choice(LOOKUP_KEYS) for _ in range(int(opts.get("size", 512)))])
    targets = opts.get("targets", "0123")
    size = int(opts.get("size", 512))
    rng = random.Random(split_seed)
    rows = []
    for i in range(size):
        target = rng.choice(targets)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"copy: {target}"}],
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": target},
                "extra_info": {"index": i},
            }
        )
    return rows


def addition_rows(largest: int, size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        a, b = rng.randint(0, largest), rng.randint(0, largest)
        rows.append(
            {
                "data_source": ADD_SOURCE,
                "prompt": [{"role": "user", "content": f"What is {a} + {b}? Answer with only the number."}],
                "ability": "arithmetic",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": i},
            }
        )
    return rows


# (the task's words, the answer a case's input gets); k: the row's constant, 2-9
CODE_TASKS: list[tuple[str, object]] = [
    ("reads an integer n and prints n + {k}", lambda n, k: n + k),
    ("reads an integer n and prints n * {k}", lambda n, k: n * k),
    ("reads an integer n and prints n - {k}", lambda n, k: n - k),
    ("reads an integer n and prints the remainder of n divided by {k}", lambda n, k: n % k),
    ("reads an integer n and prints n squared plus {k}", lambda n, k: n * n + k),
    ("reads an integer n and prints the larger of n and {k}", lambda n, k: max(n, k)),
]


def code_rows(size: int, seed: int) -> list[dict]:
    """Rows in verl's code format: ``ground_truth`` = ``{"inputs": [...], "outputs": [...]}``
    (stdin, expected stdout), as its code sets have them."""
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        words, answer = rng.choice(CODE_TASKS)
        k = rng.randint(2, 9)
        inputs = [rng.randint(0, 50) for _ in range(3)]
        task = words.format(k=k)
        rows.append(
            {
                "data_source": CODE_SOURCE,
                "prompt": [
                    {
                        "role": "user",
                        "content": f"Write a Python program that {task}. Give only the program, in a ```python block.",
                    }
                ],
                "ability": "code",
                "reward_model": {
                    "style": "rule",
                    "ground_truth": json.dumps(
                        {"inputs": [f"{n}\n" for n in inputs], "outputs": [f"{answer(n, k)}\n" for n in inputs]}
                    ),
                },
                "extra_info": {"index": i},
            }
        )
    return rows


def lookup_question(key: str) -> list[dict]:
    return [{"role": "user", "content": f"code of {key}?"}]


def lookup_rows(keys: list[str]) -> list[dict]:
    return [
        {
            "data_source": LOOKUP_SOURCE,
            "prompt": lookup_question(key),
            "ability": "tools",
            "reward_model": {"style": "rule", "ground_truth": str(lookup_code(key))},
            "extra_info": {"index": i, "tools_kwargs": {"lookup": {"create_kwargs": {"key": key}}}},
        }
        for i, key in enumerate(keys)
    ]

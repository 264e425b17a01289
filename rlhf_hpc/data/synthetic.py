"""A task built in code for the CPU demo: ``synthetic://copy``.

The prompt names a target character ("copy: 3"); the reward is the share of the response's
characters that equal it. A randomly initialised tiny model starts near chance (1/50 per character
with the ``tiny://chars`` tokenizer) and PPO measurably teaches it to copy within minutes on a CPU:
the signal is dense (every character counts) and needs the model to read its prompt.

Rows come out in the reference data format, so they go through the same pipeline as parquet data.
Options in the URL: ``synthetic://copy?targets=0123&size=512`` (characters to copy, number of rows).
"""
from __future__ import annotations

import random
from urllib.parse import parse_qsl, urlparse

DATA_SOURCE = "synthetic/copy"


def synthetic_rows(url: str, split_seed: int) -> list[dict]:
    """Rows for ``synthetic://copy[?targets=...&size=...]``; ``split_seed`` tells train from val."""
    parsed = urlparse(url)
    if parsed.netloc != "copy":
        raise ValueError(f"unknown synthetic task '{url}'; the built-in one is synthetic://copy")
    opts = dict(parse_qsl(parsed.query))
    targets = opts.get("targets", "0123")
    size = int(opts.get("size", 512))
    rng = random.Random(split_seed)
    rows = []
    for i in range(size):
        target = rng.choice(targets)
        rows.append({"data_source": DATA_SOURCE,
                     "prompt": [{"role": "user", "content": f"copy: {target}"}],
                     "ability": "copy",
                     "reward_model": {"style": "rule", "ground_truth": target},
                     "extra_info": {"index": i}})
    return rows


def copy_score(response: str, ground_truth: str) -> float:
    """Share of the response's characters equal to the target (0 for an empty response)."""
    text = response.strip()
    return sum(c == ground_truth for c in text) / len(text) if text else 0.0

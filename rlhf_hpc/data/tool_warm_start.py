"""A model that calls a tool, for the built-in tool task (``synthetic://lookup``, the ``lookup``
tool): the tiny demo model (``tiny://qwen2?vocab_size=64``, the ``tiny://chars`` tokenizer) taught
the task's conversation by next-token training on the model's turns: call ``lookup`` with the
prompt's key, read the code back, end with ``#### <code>``. It is what the multi-turn pipeline is run
with on CPU (tests/test_agent_loop.py, tests/test_multi_turn.py). ``--copy-share`` is the share of
the taught conversations whose answer is the tool's code (the rest answer a random digit). Taught on
64 keys, the model memorises their codes rather than learning to copy the tool's answer: on other
keys it answers at chance (BENCHMARKS.md has no learning figure for this task yet).

    python -m rlhf_hpc.data.tool_warm_start --out ~/.cache/rlhf-hpc/models/tiny-lookup
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Optional

import torch

from rlhf_hpc.data.synthetic import LOOKUP_KEYS, lookup_question
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.models.tokenizer import build_tiny_tokenizer
from rlhf_hpc.tools.lookup_tool import LOOKUP_SCHEMA, lookup_code

__all__ = ["TINY_MODEL", "lookup_call", "lookup_conversation", "main", "teach"]

TINY_MODEL = "tiny://qwen2?vocab_size=64"


def lookup_call(key: str) -> str:
    """The model's turn that calls the tool (hermes)."""
    return f'<tool_call>{json.dumps({"name": "lookup", "arguments": {"key": key}})}</tool_call>'


def lookup_conversation(key: str, answer: int) -> list[dict]:
    return [*lookup_question(key), {"role": "assistant", "content": lookup_call(key)},
            {"role": "tool", "content": str(lookup_code(key))}, {"role": "assistant", "content": f"#### {answer}"}]


def teach(out_dir: Path, keys: Optional[list[str]] = None, copy_share: float = 1.0, steps: int = 200,
          seed: int = 0, lr: float = 3e-3) -> Path:
    """The taught model written to ``out_dir`` (transformers format, float32); ``keys``: the
    conversations' keys (default: 64 drawn from the task's)."""
    rng = random.Random(seed)
    keys = keys or rng.sample(LOOKUP_KEYS, 64)
    tok = build_tiny_tokenizer()
    model = build_causal_lm(TINY_MODEL, torch.float32, "cpu", seed=seed)
    rows = []
    for key in keys:
        answer = lookup_code(key) if rng.random() < copy_share else rng.randrange(10)
        ids = tok.encode(tok.apply_chat_template(lookup_conversation(key, answer), tools=[LOOKUP_SCHEMA],
                                                 tokenize=False), add_special_tokens=False)
        prompt = tok.encode(tok.apply_chat_template(lookup_question(key), tools=[LOOKUP_SCHEMA], tokenize=False,
                                                    add_generation_prompt=True), add_special_tokens=False)
        rows.append((ids, [-100] * len(prompt) + ids[len(prompt):]))  # (the tool's turn is learned too: harmless)
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    attention = (torch.arange(width)[None] < torch.tensor([len(ids) for ids, _ in rows])[:, None]).long()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out_dir)
    return Path(out_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_hpc.data.tool_warm_start", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--copy-share", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = teach(Path(args.out).expanduser(), copy_share=args.copy_share, steps=args.steps, seed=args.seed)
    print(f"the tool task's starting model -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

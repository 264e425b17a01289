"""A model that calls a tool, for the built-in tool task (``synthetic://lookup``, the ``lookup``
tool): the tiny demo model (``tiny://qwen2?vocab_size=64``, the ``tiny://chars`` tokenizer) taught
the task's conversation by next-token training on the model's turns: call ``lookup`` with the
prompt's key, read the code back, end with ``#### <code>``.

- ``call_share``: the share of taught conversations that call the tool; the others answer a random
  digit at once. Below 1 the model starts out mostly guessing, and RL has the calling to learn
  (``recipes/tiny_lookup_grpo.yaml``, docs/agentic.md's tool demo).
- ``fresh_codes``: each taught conversation's tool answer is a fresh random digit, so only copying
  the tool's answer fits the data: no key's code is learned, and the real tool's codes are read, not
  recalled. Without it the tool answers the key's true code, which a model taught on a few keys
  memorises (the tests' model, tests/tool_model.py: quick to teach, and it answers its own keys
  right).

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

from rlhf_hpc.data.synthetic_tasks import LOOKUP_KEYS, lookup_question
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.models.tokenizer import build_tiny_tokenizer
from rlhf_hpc.tools.lookup_tool import LOOKUP_SCHEMA, lookup_code

__all__ = ["DEMO_TEACHING", "TINY_MODEL", "lookup_call", "lookup_conversation", "main", "teach"]

TINY_MODEL = "tiny://qwen2?vocab_size=64"
# the tool demo's starting model (the command line's defaults): the copying is learned at about step
# 250 of the calling steps (BENCHMARKS.md, "RL learns to call a tool"), then a fifth of the calls kept
DEMO_TEACHING = dict(call_share=0.2, fresh_codes=True, steps=450, calling_steps=350, batch_size=64, lr=1e-3)


def lookup_call(key: str) -> str:
    """The model's turn that calls the tool (hermes)."""
    return f"<tool_call>{json.dumps({'name': 'lookup', 'arguments': {'key': key}})}</tool_call>"


def lookup_conversation(key: str, answer: int, tool_code: Optional[int] = None) -> list[dict]:
    """The conversation that calls the tool (answering ``tool_code``, default the key's code), then
    answers ``answer``."""
    code = lookup_code(key) if tool_code is None else tool_code
    return [
        *lookup_question(key),
        {"role": "assistant", "content": lookup_call(key)},
        {"role": "tool", "content": str(code)},
        {"role": "assistant", "content": f"#### {answer}"},
    ]


class _TaughtRows:
    """Token ids and labels of the taught conversations, encoded once each. With fresh codes the
    labels are the model's turns only (the tool's answer is noise there); with the keys' own codes the
    tool's turn is learned too, which helps memorising them."""

    def __init__(self, learn_tool_turn: bool):
        self.tok = build_tiny_tokenizer()
        self.learn_tool_turn = learn_tool_turn
        self._cache: dict[tuple, tuple[list[int], list[int]]] = {}

    def _encode(self, messages: list[dict], generation_prompt: bool = False) -> list[int]:
        text = self.tok.apply_chat_template(
            messages, tools=[LOOKUP_SCHEMA], tokenize=False, add_generation_prompt=generation_prompt
        )
        return self.tok.encode(text, add_special_tokens=False)

    def row(self, key: str, tool_code: Optional[int], answer: int) -> tuple[list[int], list[int]]:
        """``tool_code`` None: no call, the answer at once."""
        if (key, tool_code, answer) not in self._cache:
            question = lookup_question(key)
            prompt = len(self._encode(question, generation_prompt=True))
            if tool_code is None:
                ids = self._encode([*question, {"role": "assistant", "content": f"#### {answer}"}])
                labels = [-100] * prompt + ids[prompt:]
            else:
                conversation = lookup_conversation(key, answer, tool_code)
                ids = self._encode(conversation)
                call_end = len(self._encode(conversation[:2]))
                answer_start = (
                    call_end if self.learn_tool_turn else len(self._encode(conversation[:3], generation_prompt=True))
                )
                labels = (
                    [-100] * prompt + ids[prompt:call_end] + [-100] * (answer_start - call_end) + ids[answer_start:]
                )
            self._cache[key, tool_code, answer] = ids, labels
        return self._cache[key, tool_code, answer]


def teach(
    out_dir: Path,
    keys: Optional[list[str]] = None,
    call_share: float = 1.0,
    fresh_codes: bool = False,
    steps: int = 200,
    calling_steps: int = 0,
    batch_size: Optional[int] = None,
    seed: int = 0,
    lr: float = 3e-3,
) -> Path:
    """The taught model written to ``out_dir`` (transformers format, float32). ``keys``: the
    conversations' keys (default: every key of the task); ``batch_size``: conversations per step
    (default: one per key, the same each step, when the codes are the keys' own); ``calling_steps``:
    the first steps, in which every conversation calls (the copying is learned on all of them) before
    ``call_share`` sets the rate at which the model calls."""
    rng = random.Random(seed)
    keys = keys or LOOKUP_KEYS
    rows = _TaughtRows(learn_tool_turn=not fresh_codes)
    model = build_causal_lm(TINY_MODEL, torch.float32, "cpu", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        batch = []
        for key in rng.choices(keys, k=batch_size) if batch_size else keys:
            if step >= calling_steps and rng.random() >= call_share:
                batch.append(rows.row(key, None, rng.randrange(10)))
            else:
                code = rng.randrange(10) if fresh_codes else lookup_code(key)
                batch.append(rows.row(key, code, code))
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        attention = (torch.arange(width)[None] < torch.tensor([len(ids) for ids, _ in batch])[:, None]).long()
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out_dir)
    return Path(out_dir)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_hpc.data.tool_warm_start", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    d = DEMO_TEACHING
    ap.add_argument(
        "--call-share",
        type=float,
        default=d["call_share"],
        help="share of the taught conversations that call the tool, once the copying is learned "
        f"(default {d['call_share']}: RL has the rest to learn)",
    )
    ap.add_argument("--steps", type=int, default=d["steps"])
    ap.add_argument(
        "--calling-steps",
        type=int,
        default=d["calling_steps"],
        help="the first steps, in which every conversation calls the tool",
    )
    ap.add_argument("--batch-size", type=int, default=d["batch_size"])
    ap.add_argument("--lr", type=float, default=d["lr"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = teach(
        Path(args.out).expanduser(),
        call_share=args.call_share,
        fresh_codes=True,
        steps=args.steps,
        calling_steps=args.calling_steps,
        batch_size=args.batch_size,
        seed=args.seed,
        lr=args.lr,
    )
    print(f"the tool task's starting model -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

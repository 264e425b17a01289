"""A tiny model that calls a tool, for the agent-loop tests: ``tiny://qwen2?vocab_size=64`` taught
(a few hundred steps of next-token training on the model's turns) to answer "code of <key>?" by
calling ``lookup`` and then writing ``#### <code>`` from the tool's answer; ``LookupTool`` (a
user's tool class, named by its dotted path in a tool config) answers with the key's code."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.models.tokenizer import build_tiny_tokenizer
from rlhf_hpc.tools.tool import Tool, ToolOutput

MODEL = "tiny://qwen2?vocab_size=64"
SCHEMA = {"type": "function", "function": {"name": "lookup", "description": "the code of a key",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                          "required": ["key"]}}}
KEYS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]


def code_of(key: str) -> int:
    return sum(ord(ch) * (i + 3) for i, ch in enumerate(key)) % 97


class LookupTool(Tool):
    def execute(self, arguments, create_kwargs):
        key = arguments.get("key")
        if not isinstance(key, str):
            raise ValueError("lookup needs a key")
        return ToolOutput(str(code_of(key)))


def question(key: str) -> list[dict]:
    return [{"role": "user", "content": f"code of {key}?"}]


def call_text(key: str) -> str:
    return f'<tool_call>{json.dumps({"name": "lookup", "arguments": {"key": key}})}</tool_call>'


def conversation(key: str) -> list[dict]:
    return [*question(key), {"role": "assistant", "content": call_text(key)},
            {"role": "tool", "content": str(code_of(key))}, {"role": "assistant", "content": f"#### {code_of(key)}"}]


def teach(out_dir: Path, steps: int = 300, seed: int = 0) -> Path:
    """The taught model saved in ``out_dir`` (transformers format, float32); its tokenizer is tiny://chars."""
    tok = build_tiny_tokenizer()
    model = build_causal_lm(MODEL, torch.float32, "cpu", seed=seed)
    rows = []
    for key in KEYS:
        messages = conversation(key)
        ids = tok.apply_chat_template(messages, tools=[SCHEMA], tokenize=False)
        ids = tok.encode(ids, add_special_tokens=False)
        prompt = tok.encode(tok.apply_chat_template(question(key), tools=[SCHEMA], tokenize=False,
                                                    add_generation_prompt=True), add_special_tokens=False)
        labels = list(ids)
        labels[:len(prompt)] = [-100] * len(prompt)  # the model's turns (and, harmlessly, the tool's) are learned
        rows.append((ids, labels))
    width = max(len(i) for i, _ in rows)
    input_ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    attn = (torch.arange(width)[None] < torch.tensor([len(i) for i, _ in rows])[:, None]).long()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    random.seed(seed)
    for _ in range(steps):
        loss = model(input_ids=input_ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out_dir)
    return out_dir


def write_tool_config(path: Path) -> Path:
    path.write_text(json.dumps({"tools": [{"class_name": "tests.tool_model.LookupTool", "config": {"type": "native"},
                                           "tool_schema": SCHEMA}]}))
    return path


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """The task's reward (a custom_reward_function, verl's signature): 1 for ``#### <code>`` at the end."""
    return 1.0 if solution_str.strip().endswith(f"#### {ground_truth}") else 0.0


def write_rows(path: Path, keys: list[str]) -> Path:
    """The task as verl's parquet rows: chat prompt, ground truth, the tool's per-row arguments."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [{"data_source": "lookup", "prompt": question(k), "ability": "tools",
             "reward_model": {"style": "rule", "ground_truth": str(code_of(k))},
             "extra_info": {"index": i, "tools_kwargs": {"lookup": {"create_kwargs": {"key": k}}}}}
            for i, k in enumerate(keys)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# A chat template with Qwen2.5's tool layout (the tools' JSON schemas in the system turn, tool answers
# as <tool_response> blocks of one user turn), for the Qwen2 tokenizer in ../shared, whose own
# template has no tool support: what a user sets as actor_rollout_ref.model.custom_chat_template
HERMES_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

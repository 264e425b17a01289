"""The agent-loop tests' model and task: the built-in tool task (``synthetic://lookup``, the
``lookup`` tool) on 8 keys, the tiny model taught (rlhf_hpc/data/tool_warm_start.py) to call the tool
and answer with its code every time; a tool config naming the tool by its dotted path (as a user's
own class is named)."""
from __future__ import annotations

import json
from pathlib import Path

from rlhf_hpc.data.synthetic import lookup_question as question, lookup_rows
from rlhf_hpc.tools.interaction import Interaction, UserTurn, last_assistant_text
from rlhf_hpc.data.tool_warm_start import lookup_call as call_text, teach as teach_task
from rlhf_hpc.tools.lookup_tool import LOOKUP_SCHEMA as SCHEMA, LookupTool, lookup_code as code_of

__all__ = ["CodeCheckInteraction", "HERMES_TEMPLATE", "KEYS", "LookupTool", "SCHEMA", "call_text", "code_of", "question",
           "teach", "teach_gsm8k_caller", "teach_tool_caller", "write_interaction_config", "write_rows", "write_tool_config"]

KEYS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]


def teach(out_dir: Path, steps: int = 200) -> Path:
    return teach_task(out_dir, keys=KEYS, steps=steps)


def write_rows(path: Path, keys: list[str], interaction: str = "") -> Path:
    """The task as verl's parquet rows (``interaction``: the name each row gives its interaction)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = lookup_rows(keys)
    for row in rows if interaction else ():
        row["extra_info"]["interaction_kwargs"] = {"name": interaction, "ground_truth": row["reward_model"]["ground_truth"]}
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


class CodeCheckInteraction(Interaction):
    """A user who checks the model's answer against the row's code: right ends the conversation,
    wrong asks again (a user's own interaction, named by its dotted path; the tiny vocabulary has
    no capitals)."""
    def respond(self, messages, interaction_kwargs):
        if last_assistant_text(messages).strip().removeprefix("####").strip() == str(interaction_kwargs["ground_truth"]):
            return UserTurn("right", done=True, score=1.0)
        return UserTurn("wrong, try again", score=0.0)


def write_interaction_config(path: Path, name: str = "check") -> Path:
    path.write_text(json.dumps({"interaction": [{"name": name, "class_name": "tests.tool_model.CodeCheckInteraction",
                                                 "config": {}}]}))
    return path


def write_tool_config(path: Path) -> Path:
    path.write_text(json.dumps({"tools": [{"class_name": "rlhf_hpc.tools.lookup_tool.LookupTool",
                                           "config": {"type": "native"}, "tool_schema": SCHEMA}]}))
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


def teach_gsm8k_caller(out_dir: Path, tokenizer_dir: Path, rows: list[dict], tools: list[dict], steps: int = 120,
                       seed: int = 0, lr: float = 3e-3) -> Path:
    """The tiny Qwen2 on the real Qwen2 tokenizer (``tokenizer_dir``) taught the shape of verl's GSM8K
    multi-turn conversation on ``rows`` (``rlhf_hpc.data.prepare.gsm8k_multiturn_rows``): call
    ``calc_gsm8k_reward`` with a number, read the tool's verdict, end with ``#### <number>`` (a random
    number per row: it is the format that is taught, not arithmetic), with ``tools`` (the tool config's
    schemas) in its prompts."""
    def turns(row: dict, rng) -> list[dict]:
        answer = str(rng.randrange(100))
        call = '<tool_call>\n' + json.dumps({"name": "calc_gsm8k_reward", "arguments": {"answer": answer}}) + '\n</tool_call>'
        return [{"role": "assistant", "content": call},
                {"role": "tool", "content": f"Current parsed answer='{answer}' reward=0.0"},
                {"role": "assistant", "content": f"#### {answer}"}]
    return teach_tool_caller(out_dir, tokenizer_dir, rows, tools, turns, steps, seed, lr)


def teach_tool_caller(out_dir: Path, tokenizer_dir: Path, rows: list[dict], tools: list[dict], turns,
                      steps: int = 120, seed: int = 0, lr: float = 3e-3, positions: int = 2048) -> Path:
    """The tiny Qwen2 on the real Qwen2 tokenizer (``tokenizer_dir``) taught, by next-token training on
    the assistant turns only, the conversations ``turns(row, rng)`` continues each of ``rows``' prompts
    with (assistant, tool, assistant), ``tools`` (the tool config's schemas) in its prompts. Written
    with the tokenizer and the hermes template: a model directory as a user gives one."""
    import random

    import torch
    from transformers import AutoTokenizer

    from rlhf_hpc.models.hf import build_causal_lm
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = HERMES_TEMPLATE
    model = build_causal_lm(f"tiny://qwen2?vocab_size=151936&tie_word_embeddings=true&max_position_embeddings={positions}",
                            torch.float32, "cpu", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def ids_of(messages: list[dict], generation_prompt: bool = False) -> list[int]:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
        return tok.encode(text, add_special_tokens=False)

    def taught(row: dict) -> tuple[list[int], list[int]]:
        """(the conversation's ids, the positions of the model's tokens)"""
        conversation = [*row["prompt"], *turns(row, rng)]
        model_tokens = []
        for end in [i + 1 for i, m in enumerate(conversation) if m["role"] == "assistant"]:
            # each assistant turn: from its generation prompt to its end
            start, stop = len(ids_of(conversation[:end - 1], generation_prompt=True)), len(ids_of(conversation[:end]))
            model_tokens += range(start, stop - 1)  # (the template's newline after <|im_end|> is not the model's)
        return ids_of(conversation), model_tokens

    examples = [taught(row) for row in rows]  # (encoded once: the shared tokenizer has no fast version)
    for _ in range(steps):
        batch = rng.sample(examples, 4)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])
        hidden = model.model(input_ids=input_ids).last_hidden_state
        # the head only where a model token is predicted (the whole 152k-wide logits would be GBs)
        rows_at = torch.tensor([i for i, (_, pos) in enumerate(batch) for _ in pos])
        at = torch.tensor([p for _, pos in batch for p in pos])
        logits = model.lm_head(hidden[rows_at, at - 1])
        loss = torch.nn.functional.cross_entropy(logits, input_ids[rows_at, at])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return Path(out_dir)

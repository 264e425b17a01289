"""The agent-loop tests' model and task: the built-in tool task (``synthetic://lookup``, the
``lookup`` tool) on 8 keys, the tiny model taught (rlhf_hpc/data/tool_warm_start.py) to call the tool
and answer with its code every time; a tool config naming the tool by its dotted path (as a user's
own class is named)."""
from __future__ import annotations

import json
from pathlib import Path

from rlhf_hpc.data.synthetic import lookup_question as question, lookup_rows
from rlhf_hpc.data.tool_warm_start import lookup_call as call_text, teach as teach_task
from rlhf_hpc.tools.lookup_tool import LOOKUP_SCHEMA as SCHEMA, LookupTool, lookup_code as code_of

__all__ = ["HERMES_TEMPLATE", "KEYS", "LookupTool", "SCHEMA", "call_text", "code_of", "question", "teach",
           "write_rows", "write_tool_config"]

KEYS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]


def teach(out_dir: Path, steps: int = 200) -> Path:
    return teach_task(out_dir, keys=KEYS, steps=steps)


def write_rows(path: Path, keys: list[str]) -> Path:
    """The task as verl's parquet rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(lookup_rows(keys)), path)
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

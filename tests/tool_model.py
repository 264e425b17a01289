"""The agent-loop tests' model and task: the built-in tool task (``synthetic://lookup``, the
``lookup`` tool) on 8 keys, the tiny model taught (rlhf_hpc/data/tool_warm_start.py) to call the tool
and answer with its code every time; a tool config naming the tool by its dotted path (as a user's
own class is named)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Optional

from rlhf_hpc.data.synthetic_tasks import lookup_question as question
from rlhf_hpc.data.synthetic_tasks import lookup_rows
from rlhf_hpc.data.tool_warm_start import lookup_call as call_text
from rlhf_hpc.data.tool_warm_start import teach as teach_task
from rlhf_hpc.tools.interaction import Interaction, UserTurn, last_assistant_text
from rlhf_hpc.tools.lookup_tool import LOOKUP_SCHEMA as SCHEMA
from rlhf_hpc.tools.lookup_tool import LookupTool
from rlhf_hpc.tools.lookup_tool import lookup_code as code_of
from tests.conftest import seed_base

__all__ = [
    "CodeCheckInteraction",
    "HERMES_TEMPLATE",
    "KEYS",
    "LookupTool",
    "SCHEMA",
    "call_text",
    "code_of",
    "question",
    "teach",
    "teach_gsm8k_caller",
    "teach_tool_caller",
    "write_interaction_config",
    "write_rows",
    "write_tool_config",
]

# the teaching checks its model: well-formed calls in at least this share of first turns sampled at
# temperature 1 (CALL_CHECK_SAMPLES of them) before a test runs it
MIN_CALL_RATE = 0.8
CALL_CHECK_SAMPLES = 128
# the lookup model's (tool_model.teach) check: right whole conversations, sampled
MIN_LOOKUP_RATE = 0.9
LOOKUP_CHECK_SAMPLES = 64
KEYS = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]


# taught models, by the hash of the code that teaches them and its arguments (a fresh machine teaches
# each once; RLHF_HPC_TEST_CACHE moves the folder)
CACHE = Path(os.environ.get("RLHF_HPC_TEST_CACHE", "~/.cache/rlhf-hpc/test-models")).expanduser()
TEACHING_CODE = [
    Path(__file__),
    *(Path(__file__).parent.parent / "rlhf_hpc" / p for p in ("data/tool_warm_start.py", "data/synthetic_tasks.py")),
    *(Path(__file__).parent.parent / "rlhf_hpc" / "models" / p for p in ("hf.py", "tokenizer.py")),
]


def cached_model(out_dir: Path, name: str, args: dict, build) -> Path:
    """``build(dir)``'s model copied into ``out_dir``; built once per hash of the teaching code, the
    arguments, torch's version and the thread count (the floating-point path), then read from
    ``CACHE``."""
    import torch

    key = hashlib.sha256()
    for path in TEACHING_CODE:
        key.update(path.read_bytes())
    key.update(json.dumps([name, args, torch.__version__, torch.get_num_threads()], sort_keys=True).encode())
    done = CACHE / f"{name}-{key.hexdigest()[:16]}"
    if not (done / "config.json").is_file():
        tmp = CACHE / f".tmp-{done.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        try:
            os.replace(tmp, done)  # atomic: a concurrent run's copy, if first, is kept
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(done, out_dir, dirs_exist_ok=True)
    return Path(out_dir)


def teach(out_dir: Path, steps: int = 200, min_rate: Optional[float] = MIN_LOOKUP_RATE) -> Path:
    """The lookup model on ``KEYS`` (taught once per machine: ``cached_model``). The teaching
    checks its model: of ``LOOKUP_CHECK_SAMPLES`` conversations sampled at temperature 1 (the
    question, the call, the tool's answer, the answer), at least ``min_rate`` call the tool with
    the question's key and answer the tool's code back; else it teaches again from the start
    with half as many steps more, twice at most, then fails with the rates it reached (how well
    200 steps teach depends on the seed and the floating-point path)."""
    args = {"keys": KEYS, "steps": steps, "min_rate": min_rate, "seed": seed_base()}
    return cached_model(out_dir, "lookup", args, lambda d: _teach_lookup(d, steps, min_rate))


def _teach_lookup(out_dir: Path, steps: int, min_rate: Optional[float]) -> Path:
    tried = []
    for more in range(3):
        path = teach_task(out_dir, keys=KEYS, steps=steps + more * steps // 2, seed=seed_base())
        if not min_rate:
            return path
        tried.append(sampled_lookup_rate(path, seed=seed_base()))
        if tried[-1] >= min_rate:
            return path
    raise AssertionError(
        f"the lookup model answers right in {', '.join(f'{r:.2f}' for r in tried)} of its sampled "
        f"conversations after {steps}, {steps * 3 // 2} and {steps * 2} teaching steps; the tests "
        f"that run it need {min_rate}"
    )


def sampled_lookup_rate(model_dir: Path, samples: int = None, seed: int = 0) -> float:
    """The share of conversations, sampled at temperature 1 from the lookup model in ``model_dir`` on
    each of ``KEYS`` in turn, that call ``lookup`` with the question's key, end that turn on the
    template's end of turn, and answer ``#### <the tool's code>`` after the tool's turn."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_hpc.data.dataset import chat_token_ids
    from rlhf_hpc.models.tokenizer import build_tiny_tokenizer, tool_turn_ids
    from rlhf_hpc.tools.tool_calls import hermes_calls

    samples = samples or LOOKUP_CHECK_SAMPLES
    tok = build_tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    end, stops = tok.eos_token_id, {tok.eos_token_id, tok.pad_token_id}
    gen = torch.Generator().manual_seed(seed)

    def turn(ids: list[int]) -> list[int]:
        out, past, x = [], None, torch.tensor([ids])
        with torch.no_grad():
            for _ in range(96):  # (one token a character)
                o = model(input_ids=x, past_key_values=past, use_cache=True)
                past = o.past_key_values
                t = int(torch.multinomial(torch.softmax(o.logits[0, -1].float(), -1), 1, generator=gen))
                out.append(t)
                if t in stops:
                    break
                x = torch.tensor([[t]])
        return out

    right = 0
    for i in range(samples):
        key = KEYS[i % len(KEYS)]
        ids = chat_token_ids(tok, question(key), tools=[SCHEMA])
        first = turn(ids)
        calls = hermes_calls(tok.decode(first[:-1])).calls
        if first[-1] != end or [(c.name, c.arguments) for c in calls] != [("lookup", {"key": key})]:
            continue
        ids += first + tool_turn_ids(tok, [{"role": "tool", "content": str(code_of(key))}], {})
        second = turn(ids)
        right += second[-1] == end and tok.decode(second[:-1]).strip() == f"#### {code_of(key)}"
    return right / samples


def write_rows(path: Path, keys: list[str], interaction: str = "") -> Path:
    """The task as verl's parquet rows (``interaction``: the name each row gives its interaction)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = lookup_rows(keys)
    for row in rows if interaction else ():
        row["extra_info"]["interaction_kwargs"] = {
            "name": interaction,
            "ground_truth": row["reward_model"]["ground_truth"],
        }
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


class CodeCheckInteraction(Interaction):
    """A user who checks the model's answer against the row's code: right ends the conversation,
    wrong asks again (a user's own interaction, named by its dotted path; the tiny vocabulary has
    no capitals)."""

    def respond(self, messages, interaction_kwargs):
        if last_assistant_text(messages).strip().removeprefix("####").strip() == str(
            interaction_kwargs["ground_truth"]
        ):
            return UserTurn("right", done=True, score=1.0)
        return UserTurn("wrong, try again", score=0.0)


def write_interaction_config(path: Path, name: str = "check") -> Path:
    path.write_text(
        json.dumps(
            {"interaction": [{"name": name, "class_name": "tests.tool_model.CodeCheckInteraction", "config": {}}]}
        )
    )
    return path


def write_tool_config(path: Path) -> Path:
    path.write_text(
        json.dumps(
            {
                "tools": [
                    {
                        "class_name": "rlhf_hpc.tools.lookup_tool.LookupTool",
                        "config": {"type": "native"},
                        "tool_schema": SCHEMA,
                    }
                ]
            }
        )
    )
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
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
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
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def teach_gsm8k_caller(
    out_dir: Path,
    tokenizer_dir: Path,
    rows: list[dict],
    tools: list[dict],
    steps: int = 120,
    seed: int = 0,
    lr: float = 3e-3,
    check_rows: Optional[list[dict]] = None,
) -> Path:
    """The tiny Qwen2 on the real Qwen2 tokenizer (``tokenizer_dir``) taught the shape of verl's GSM8K
    multi-turn conversation on ``rows`` (``rlhf_hpc.data.prepare.gsm8k_multiturn_rows``): call
    ``calc_gsm8k_reward`` with a number, read the tool's verdict, end with ``#### <number>`` (a random
    number per row: it is the format that is taught, not arithmetic), with ``tools`` (the tool config's
    schemas) in its prompts."""

    def turns(row: dict, rng) -> list[dict]:
        answer = str(rng.randrange(100))
        call = (
            "<tool_call>\n"
            + json.dumps({"name": "calc_gsm8k_reward", "arguments": {"answer": answer}})
            + "\n</tool_call>"
        )
        return [
            {"role": "assistant", "content": call},
            {"role": "tool", "content": f"Current parsed answer='{answer}' reward=0.0"},
            {"role": "assistant", "content": f"#### {answer}"},
        ]

    return teach_tool_caller(out_dir, tokenizer_dir, rows, tools, turns, steps, seed, lr, check_rows=check_rows)


def teach_tool_caller(
    out_dir: Path,
    tokenizer_dir: Path,
    rows: list[dict],
    tools: list[dict],
    turns,
    steps: int = 120,
    seed: int = 0,
    lr: float = 3e-3,
    positions: int = 2048,
    min_call_rate: Optional[float] = MIN_CALL_RATE,
    max_steps: Optional[int] = None,
    check_rows: Optional[list[dict]] = None,
) -> Path:
    """The tiny Qwen2 on the real Qwen2 tokenizer (``tokenizer_dir``) taught, by next-token training on
    the assistant turns only, the conversations ``turns(row, rng)`` continues each of ``rows``' prompts
    with (assistant, tool, assistant), ``tools`` (the tool config's schemas) in its prompts. Written
    with the tokenizer and the hermes template: a model directory as a user gives one.

    The teaching checks its own result (where there are ``tools`` and ``min_call_rate``): after
    ``steps``, and after each further ``steps // 2`` up to ``max_steps`` (default ``4 * steps``), it
    samples ``CALL_CHECK_SAMPLES`` first turns at temperature 1 from
    ``rows``' prompts (``check_rows``' where given: rows it was not taught on, as a run's), and stops
    once at least ``min_call_rate`` of them are well-formed calls of the first tool; else
    AssertionError with the rates it reached. How often a taught model calls depends on the machine's
    floating-point path (kernels, threads): the check lets the tests that run it assert the tool path,
    not that rate (issue #58)."""
    import random

    import torch
    from transformers import AutoTokenizer

    seed += seed_base()
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = HERMES_TEMPLATE

    def ids_of(messages: list[dict], generation_prompt: bool = False) -> list[int]:
        text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
        return tok.encode(text, add_special_tokens=False)

    def taught(row: dict) -> tuple[list[int], list[int]]:
        """(the conversation's ids, the positions of the model's tokens)"""
        conversation = [*row["prompt"], *turns(row, rng)]
        model_tokens = []
        for end in [i + 1 for i, m in enumerate(conversation) if m["role"] == "assistant"]:
            # each assistant turn: from its generation prompt to its end
            start, stop = len(ids_of(conversation[: end - 1], generation_prompt=True)), len(ids_of(conversation[:end]))
            model_tokens += range(start, stop - 1)  # (the template's newline after <|im_end|> is not the model's)
        return ids_of(conversation), model_tokens

    examples = [taught(row) for row in rows]  # (encoded once: the shared tokenizer has no fast version)
    prompts = [ids_of(row["prompt"], generation_prompt=True) for row in (check_rows or rows)]
    vocab = RestrictedVocabulary(tok, [ids for ids, _ in examples] + prompts)
    model = vocab.model(positions, seed)
    # fused: one kernel over the embedding's moments
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    examples = [(vocab.local(ids), pos) for ids, pos in examples]

    def train(n: int) -> None:
        for _ in range(n):
            batch = rng.sample(examples, 4)
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])
            hidden = model.model(input_ids=input_ids).last_hidden_state
            # the head only where a model token is predicted
            rows_at = torch.tensor([i for i, (_, pos) in enumerate(batch) for _ in pos])
            at = torch.tensor([p for _, pos in batch for p in pos])
            loss = torch.nn.functional.cross_entropy(
                vocab.logits(model, hidden[rows_at, at - 1]), input_ids[rows_at, at]
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    if not (tools and steps and min_call_rate):  # (untaught, or no tool to call: nothing to check)
        train(steps)
        return vocab.save(model, tok, out_dir)
    name = tools[0]["function"]["name"]
    max_steps = max_steps or 4 * steps
    done, rates = 0, []
    while True:
        chunk = steps if done == 0 else max(1, steps // 2)
        train(chunk)
        done += chunk
        rates.append(
            sampled_call_rate(
                model, tok, [vocab.local(ids) for ids in prompts], name, seed=seed + 1000 * len(rates), vocab=vocab
            )
        )
        if rates[-1] >= min_call_rate:
            break
        if done >= max_steps:
            raise AssertionError(
                f"the taught model calls {name} in {rates[-1]:.2f} of its sampled first turns after {done} teaching "
                f"steps (rates after each check: {', '.join(f'{r:.2f}' for r in rates)}); the tests that run it need "
                f"{min_call_rate}: teach longer (steps/max_steps) or with another lr"
            )
    return vocab.save(model, tok, out_dir)


QWEN2_VOCAB = 151936


class RestrictedVocabulary:
    """Teaching on the tokens the conversations use, exactly. The model written (``save``) is the tiny
    Qwen2 on the whole 152k vocabulary, tied, whose embedding rows outside the used tokens are zero:
    their logits are all 0, so the full softmax is the used tokens' logits beside one term of
    log(#unused) (``logits``), and the teaching is next-token training of that model, not an
    approximation of it, at the cost of the used tokens' rows (a few thousand: the whole head was
    0.24 s of a 0.30 s step). Inside, the model has one row per used token and a last, zero row that
    stands for every unused token (``other``)."""

    def __init__(self, tok, sequences: list[list[int]]):
        import math

        special = {tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id, tok.pad_token_id} - {None}
        self.used = sorted({t for ids in sequences for t in ids} | special)
        self.index = {t: i for i, t in enumerate(self.used)}
        self.other = len(self.used)  # the local id of every unused token
        self.log_unused = math.log(QWEN2_VOCAB - len(self.used))

    def local(self, ids: list[int]) -> list[int]:
        return [self.index.get(t, self.other) for t in ids]

    def model(self, positions: int, seed: int):
        import torch

        from rlhf_hpc.models.hf import build_causal_lm

        model = build_causal_lm(
            f"tiny://qwen2?vocab_size={len(self.used) + 1}&tie_word_embeddings=true"
            f"&max_position_embeddings={positions}",
            torch.float32,
            "cpu",
            seed=seed,
        )
        with torch.no_grad():
            model.model.embed_tokens.weight[self.other] = 0  # (never trained: ``logits`` leaves it out)
        return model

    def logits(self, model, hidden):
        """The full model's logits, restricted: the used tokens', then log(#unused) for all the others
        (each at logit 0) together."""
        import torch

        used = hidden @ model.model.embed_tokens.weight[: self.other].T
        return torch.cat([used, torch.full_like(used[..., :1], self.log_unused)], -1)

    def save(self, model, tok, out_dir: Path) -> Path:
        import torch

        from rlhf_hpc.models.hf import build_causal_lm

        full = build_causal_lm(
            f"tiny://qwen2?vocab_size={QWEN2_VOCAB}&tie_word_embeddings=true"
            f"&max_position_embeddings={model.config.max_position_embeddings}",
            torch.float32,
            "cpu",
        )
        state = model.state_dict()
        embedding = torch.zeros_like(full.model.embed_tokens.weight)
        embedding[self.used] = state.pop("model.embed_tokens.weight")[: self.other]
        state.pop("lm_head.weight", None)
        missing, unexpected = full.load_state_dict({**state, "model.embed_tokens.weight": embedding}, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        assert full.lm_head.weight is full.model.embed_tokens.weight
        full.save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        return Path(out_dir)


def sampled_call_rate(
    model,
    tok,
    prompts: list[list[int]],
    name: str,
    samples: int = CALL_CHECK_SAMPLES,
    seed: int = 0,
    max_new_tokens: int = 96,
    vocab: Optional[RestrictedVocabulary] = None,
) -> float:
    """The share of ``samples`` first turns, sampled at temperature 1 (top-p 1, no top-k: the engine's
    defaults in the runs) from ``prompts`` in turn, that hold a well-formed call of ``name`` and end
    on the template's end of turn, as the agent loop runs them: a turn stops on any of the run's stop
    tokens (EOS, padding, the generation config's), and one that stops on another than
    ``<|im_end|>`` ends its conversation, its call unrun. ``vocab``: ``model`` is a restricted
    vocabulary's (``prompts`` in its ids); a turn that draws an unused token is counted as no call (an
    unused token could sit in a call's argument: the rate is the full model's at most)."""
    import torch

    from rlhf_hpc.tools.tool_calls import hermes_calls

    end = tok.convert_tokens_to_ids("<|im_end|>")
    generation_eos = model.generation_config.eos_token_id
    stops = {
        end,
        tok.eos_token_id,
        tok.pad_token_id,
        *(generation_eos if isinstance(generation_eos, list) else [generation_eos]),
    } - {None}
    other = None
    if vocab is not None:  # (an unused stop token is drawn as the unused token, which ends the turn)
        stops, end, other = {vocab.index[t] for t in stops if t in vocab.index}, vocab.index[end], vocab.other
    gen = torch.Generator().manual_seed(seed)
    per_prompt = -(-samples // len(prompts))
    # the samples in one batch, left-padded (each prompt per_prompt times, in turn, up to samples):
    # one forward a token for all of them
    starts = [ids for ids in prompts for _ in range(per_prompt)][:samples]
    width = max(len(ids) for ids in starts)
    pad = end if tok.pad_token_id is None or vocab is not None else tok.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in starts])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in starts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    new, alive = [[] for _ in starts], [True] * len(starts)
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        for _ in range(max_new_tokens):
            # inverse-CDF sampling: torch.multinomial over 152k tokens was 0.47 s a step for 128 rows, this 0.07
            logits = out.logits[:, -1].float()
            if vocab is not None:  # every unused token at logit 0, together
                logits[:, other] += vocab.log_unused
            cdf = torch.softmax(logits, -1).cumsum(-1)
            nxt = torch.searchsorted(cdf, torch.rand(len(starts), 1, generator=gen) * cdf[:, -1:]).clamp(
                max=cdf.shape[1] - 1
            )
            for i, t in enumerate(nxt[:, 0].tolist()):
                if alive[i]:
                    new[i].append(t)
                    alive[i] = t not in stops and t != other
            if not any(alive):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=nxt,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
    calls = sum(
        bool(ids)
        and ids[-1] == end
        and other not in ids
        and any(
            c.name == name
            for c in hermes_calls(
                tok.decode([vocab.used[t] for t in ids] if vocab else ids, skip_special_tokens=False)
            ).calls
        )
        for ids in new
    )
    return calls / len(starts)

"""Tokenizers: a Hugging Face tokenizer by path/name, or ``tiny://chars`` built in code.

``tiny://chars`` is a character-level tokenizer (digits, lowercase letters, a little punctuation)
with Qwen2's chat-format special tokens, its tool-call tags and a ChatML chat template that renders
tools and tool answers as Qwen2.5's does: small enough for the tiny demo model (its vocabulary fits
``vocab_size=64``) and needing no files.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

from rlhf_hpc.models.hf import local_path

__all__ = [
    "build_tiny_tokenizer",
    "load_tokenizer",
    "no_tokenizer_files",
    "stop_token_ids",
    "tokenizer_path",
    "tokenizer_problems",
    "tool_template_problems",
    "tool_turn_ids",
    "tool_turn_text",
    "turn_end_id",
]

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz :,.?!#+-*=\n")
# appended after the rest (earlier ids unchanged): what a hermes tool call and its JSON need; the tags
# are single tokens, as in Qwen2's vocabulary (added tokens that are not special)
TINY_TOOL_CHARS = list("{}\"_[]'()")  # (64 tokens in all: the demo's vocab_size)
TINY_TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# ChatML; with tools, a system block naming them, and tool results as one user turn of
# <tool_response> blocks (Qwen2.5's layout, its long tool prose left out)
TINY_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\ntools:' }}{% for tool in tools %}{{ ' ' + tool['function']['name'] }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tiny_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS + TINY_CHARS + TINY_TOOL_CHARS + TINY_TOOL_TAGS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tok.add_tokens([AddedToken(t, normalized=False) for t in TINY_TOOL_TAGS])  # matched before the split
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def load_tokenizer(path: str, trust_remote_code: bool = False, chat_template: Optional[str] = None):
    """``tiny://chars`` or anything ``AutoTokenizer.from_pretrained`` takes (offline: from HF_HOME).
    ``chat_template`` (``actor_rollout_ref.model.custom_chat_template``, a Jinja template) replaces
    the tokenizer's own, for prompts and for every later use of the template."""
    if path.startswith("tiny://"):
        if path != "tiny://chars":
            raise ValueError(f"unknown built-in tokenizer '{path}'; the built-in one is tiny://chars")
        tok = build_tiny_tokenizer()
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(local_path(path), trust_remote_code=trust_remote_code)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


# what the dry run asks of a tokenizer (tokenizer_problems): a prompt as the data holds them (chat messages)
SAMPLE_PROMPT = [{"role": "user", "content": "what is 12 + 30? answer with the number."}]
MIN_VOCAB = 16  # fewer tokens is no real tokenizer (transformers builds one of 1 from a model directory without files)
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model", "tekken.json")


def no_tokenizer_files(path: str) -> bool:
    """``path`` is a directory here holding none of a tokenizer's files (a model's config.json alone)."""
    local = Path(local_path(path))
    return local.is_dir() and not any((local / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_problems(
    path: str,
    trust_remote_code: bool = False,
    chat_template: Optional[str] = None,
    template_kwargs: Optional[dict] = None,
    vocab_size: Optional[int] = None,
    tools: Optional[list[dict]] = None,
) -> list[str]:
    """What keeps the tokenizer at ``path`` (as ``load_tokenizer`` loads it, ``chat_template``
    replacing its own) from encoding the run's prompts: it does not load; it has under
    ``MIN_VOCAB`` tokens or encodes a sample prompt to none; it has no chat template (every prompt
    is chat messages), or its template fails or renders the sample to no tokens (with
    ``template_kwargs``, ``data.apply_chat_template_kwargs``); it has more tokens than the model's
    ``vocab_size`` embedding rows; with ``tools`` (a multi-turn run's), ``tool_template_problems``."""
    no_files = (
        f"; {local_path(path)} has none of a tokenizer's files ({', '.join(TOKENIZER_FILES[:3])}, ...)"
        if no_tokenizer_files(path)
        else ""
    )
    try:
        tok = load_tokenizer(path, trust_remote_code, chat_template)
    except Exception as e:  # noqa: BLE001 - whatever transformers raises for files it cannot use
        return [f"the tokenizer does not load ({type(e).__name__}: {' '.join(str(e).split())[:300]}){no_files}"]
    text = SAMPLE_PROMPT[0]["content"]
    n_text = len(tok.encode(text, add_special_tokens=False))
    if len(tok) < MIN_VOCAB or n_text == 0:
        return [
            f"the tokenizer is empty: {len(tok)} token(s), '{text}' encodes to {n_text}{no_files}"
            + (": transformers builds an empty tokenizer from a model directory without them" if no_files else "")
        ]
    problems = []
    if tok.chat_template is None:
        problems.append(
            "the tokenizer has no chat template, and every prompt is chat messages: set "
            "actor_rollout_ref.model.custom_chat_template, or use a tokenizer that has one"
        )
    else:
        try:
            ids = tok.apply_chat_template(
                SAMPLE_PROMPT, add_generation_prompt=True, tokenize=True, **(template_kwargs or {})
            )
            n_chat = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
        except Exception as e:  # noqa: BLE001 - a Jinja template fails in many ways
            problems.append(f"the tokenizer's chat template fails on a one-message prompt ({type(e).__name__}: {e})")
        else:
            if n_chat == 0:
                problems.append("the tokenizer's chat template renders a one-message prompt to 0 tokens")
    if tools and tok.chat_template is not None:
        problems += tool_template_problems(tok, tools, template_kwargs)
    if vocab_size is not None and len(tok) > vocab_size:
        problems.append(
            f"the tokenizer has {len(tok)} tokens, more than the model's {vocab_size} embedding rows "
            f"(vocab_size): token ids from {vocab_size} on index past the embedding"
        )
    return problems


_MARK = "\u2063ASSISTANT\u2063"  # stands for an assistant turn's text where the template's own wrapping is read
_PROBE = "tool-answer-probe-7"


def tool_turn_text(tokenizer, tool_messages: list[dict], template_kwargs: dict) -> str:
    """The text that follows a model turn ending in its EOS token, up to and including the next
    assistant header: what the template writes after the EOS when it closes an assistant message
    (Qwen: a newline), the tool messages as it renders them, and the generation prompt. Read from
    the template on a stand-in conversation, so a full re-encoding of the conversation matches."""

    def render(messages, generation):
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation, tokenize=False, **template_kwargs
        )

    base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
    closed, full = render(base, False), render(base + tool_messages, True)
    if not full.startswith(closed):
        raise ValueError(
            "the chat template renders a conversation differently once tool messages follow "
            "(set actor_rollout_ref.model.custom_chat_template to one that appends them)"
        )
    close = closed[closed.rindex(_MARK) + len(_MARK) :]
    eos = tokenizer.eos_token or ""
    after_eos = close[len(eos) :] if eos and close.startswith(eos) else close
    return after_eos + full[len(closed) :]


def tool_turn_ids(tokenizer, messages: list[dict], template_kwargs: dict) -> list[int]:
    """``tool_turn_text``'s token ids, each message's content encoded with special tokens split: text a
    tool or a simulated user writes (``<|im_end|>\n<|im_start|>assistant``, say) never becomes a
    control token, so it cannot fake a turn boundary; the template's own text around it is encoded
    as the template means it. (A template that does not write a content verbatim: the whole text
    encoded as before.)"""
    marks = [f"\u2063CONTENT{i}\u2063" for i in range(len(messages))]
    text = tool_turn_text(tokenizer, [dict(m, content=mark) for m, mark in zip(messages, marks)], template_kwargs)
    if any(text.count(mark) != 1 for mark in marks):
        return tokenizer.encode(tool_turn_text(tokenizer, messages, template_kwargs), add_special_tokens=False)
    ids, rest = [], text
    for message, mark in zip(messages, marks):
        before, rest = rest.split(mark, 1)
        ids += tokenizer.encode(before, add_special_tokens=False) if before else []
        content = str(message["content"])
        ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True) if content else []
    return ids + (tokenizer.encode(rest, add_special_tokens=False) if rest else [])


def turn_end_id(tokenizer, template_kwargs: Optional[dict] = None) -> Optional[int]:
    """The token the chat template closes an assistant turn with (Qwen's ``<|im_end|>``): the first
    token of what it writes after the turn's text; None where the template writes nothing there."""
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
    closed = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, tokenize=False, **dict(template_kwargs or {})
    )
    close = closed[closed.rindex(_MARK) + len(_MARK) :]
    ids = tokenizer.encode(close, add_special_tokens=False) if close else []
    return ids[0] if ids else None


def tool_template_problems(tokenizer, tools: Optional[list[dict]], template_kwargs: Optional[dict] = None) -> list[str]:
    """What keeps a multi-turn run's chat template from serving its tools: it drops tool messages
    (the model would never read a tool's answer), or shows the model none of the tools' names."""
    fix = "set actor_rollout_ref.model.custom_chat_template to a template with tool support (Qwen2.5's, hermes)"
    kwargs = dict(template_kwargs or {})
    try:
        turn = tool_turn_text(tokenizer, [{"role": "tool", "content": _PROBE}], kwargs)
    except Exception as e:  # noqa: BLE001 - a Jinja template fails in many ways
        return [f"the chat template fails on a tool message ({type(e).__name__}: {e}): {fix}"]
    problems = (
        []
        if _PROBE in turn
        else [f"the chat template drops tool messages: the model would never read a tool's answer; {fix}"]
    )
    if tools:
        shown = tokenizer.apply_chat_template(
            SAMPLE_PROMPT, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )
        missing = [t["function"]["name"] for t in tools if t["function"]["name"] not in shown]
        if missing:
            problems.append(
                f"the chat template does not show the model its tools ({', '.join(missing)} not in the "
                f"prompt it renders with tools=); {fix}"
            )
    return problems


def tokenizer_path(cfg) -> str:
    """Which tokenizer a config uses: data.tokenizer, else the model's tokenizer_path, else the model
    path (a tiny:// model uses tiny://chars)."""
    m = cfg.actor_rollout_ref.model
    path = cfg.data.tokenizer or m.tokenizer_path or m.path
    return "tiny://chars" if path.startswith("tiny://") else path


@functools.lru_cache(maxsize=None)
def generation_eos_ids(model_path: str) -> tuple[int, ...]:
    """The ``eos_token_id`` of the model's ``generation_config.json`` (one id, or a list: Qwen2.5's
    instruct models end a turn with <|im_end|> or <|endoftext|>, Llama-3's with three ids); ()
    where there is none (tiny models, a checkpoint without one)."""
    if model_path.startswith("tiny://"):
        return ()
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(local_path(model_path)).eos_token_id
    except (OSError, ValueError):
        return ()
    return tuple(sorted({eos} if isinstance(eos, int) else set(eos or ())))


def stop_token_ids(tokenizer, model_path: str) -> list[int]:
    """What ends a response, as verl: the tokenizer's EOS and padding token and every EOS id of
    the model's generation config. The stop token is kept as the response's last token."""
    ids = {tokenizer.eos_token_id, getattr(tokenizer, "pad_token_id", None), *generation_eos_ids(model_path)}
    return sorted(t for t in ids if t is not None)

"""Multi-turn generation with tools over any rollout engine (``actor_rollout_ref.rollout.multi_turn``).

Every conversation of this rank moves turn by turn: the engine continues every open one (one
``generate`` call per turn, each conversation its own request), the model's turn is parsed for tool
calls (``multi_turn.format``), the calls of all conversations run at once in threads (each under
``multi_turn.tool_timeout_s``), and their answers go back through the model's chat template as a
tool turn. With an interaction (``multi_turn.interaction_config_path``: verl's simulated user), a
turn that makes no call is answered by the row's interaction as a user turn, and the conversation
goes on until the interaction ends it. A conversation ends when a turn makes no call (and no
interaction answers it), at ``max_assistant_turns`` /
``max_user_turns``, or when the response budget (``data.max_response_length``, the whole
conversation after the prompt, as verl) runs out: a turn cut there ends it, and so does a tool or
user turn that does not fit (it is not appended, as verl does for a tool turn).

A model turn that stops on a stop token other than the one the template closes turns with (Qwen2.5's
``<|endoftext|>`` beside ``<|im_end|>``) ends its conversation: the template would never have
written another turn after it (counted in ``tools/off_template_stops``). Tool and user text is
encoded with special tokens split, so it cannot fake a turn boundary.

The response is every token after the prompt; its ``mask`` is 1 on the model's tokens and 0 on the
tool and user turns, which carry log-prob 0 and are neither trained on nor counted in KL or
entropy. The ranks of a tensor-parallel vLLM group generate together (the engine gathers their requests), so
they go through the same number of turns with the same sampling: the open count and the budget are
agreed over the group each turn.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from rlhf_hpc.config.multi_turn_schema import MultiTurnConfig
from rlhf_hpc.models.tokenizer import tool_template_problems, tool_turn_ids, turn_end_id
from rlhf_hpc.rollout.base import Response, RolloutEngine, Sampling
from rlhf_hpc.tools.call_runner import CallRunner
from rlhf_hpc.tools.interaction import Interaction, UserTurn
from rlhf_hpc.tools.tool import Tool, ToolOutput
from rlhf_hpc.tools.tool_calls import TOOL_CALL_FORMATS, ToolCall

__all__ = ["AgentLoop", "Conversation", "truncate_tool_text"]

MAX_TOOL_THREADS = 16  # tool calls running at once on a rank (a code tool also has sandbox.max_parallel)


@dataclass
class Conversation:
    prompt_ids: list[int]
    messages: list[dict]  # the prompt's messages, then each turn's (the tokenization check)
    tools_kwargs: dict = field(default_factory=dict)  # the row's extra_info.tools_kwargs
    interaction_kwargs: dict = field(default_factory=dict)  # the row's extra_info.interaction_kwargs
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0  # tool and interaction turns (verl counts both as user turns)
    user_tokens: int = 0  # of the interaction's turns
    finish_reason: str = "stop"
    done: bool = False
    off_template_stop: bool = False  # its last turn stopped on a stop token the template does not close turns with
    # the engine's routing (a mixture of experts, enable_rollout_routing_replay): (prompt + tokens so
    # far, layers, k), an all-zero row where no call has routed the token yet
    routed: Optional[torch.Tensor] = None

    def add(self, ids: list[int], logprobs: Optional[list[float]]) -> None:
        self.token_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)

    def add_routing(self, recorded: torch.Tensor, start: int, new: int) -> None:
        """Merge one generate call's routing (its context's rows, then its ``new`` tokens' from
        ``start``): each model token keeps the routing it was sampled under; a context token (a
        tool's or user's turn, a turn's last token, which its call never fed back) takes the first
        call that routed it, as its keys and values were computed then. Rows the call did not
        route (vLLM's cached prefix) are zero and change nothing."""
        end = start + new
        if self.routed is None:
            self.routed = torch.zeros((end, *recorded.shape[1:]), dtype=recorded.dtype)
        elif len(self.routed) < end:
            grown = torch.zeros((end, *recorded.shape[1:]), dtype=recorded.dtype)
            grown[: len(self.routed)] = self.routed
            self.routed = grown
        rows = min(len(recorded), end)
        context = self.routed[: min(rows, start)]
        unrouted = ~context.flatten(1).any(dim=1)
        context[unrouted] = recorded[: len(context)][unrouted]
        self.routed[start:rows] = recorded[start:rows]

    def routing(self) -> Optional[torch.Tensor]:
        """(prompt + tokens, layers, k): the merged routing, zero where no call routed a token."""
        if self.routed is None:
            return None
        out = torch.zeros((len(self.prompt_ids) + len(self.token_ids), *self.routed.shape[1:]), dtype=self.routed.dtype)
        out[: len(self.routed)] = self.routed[: len(out)]
        return out


def truncate_tool_text(text: str, limit: int, side: str) -> str:
    """verl's cut of a tool answer longer than ``limit`` characters (its marker texts)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


class AgentLoop:
    """``generate(examples, sampling)`` as an engine's, the prompts' rows given (their messages and
    ``extra_info.tools_kwargs``); ``take_metrics()`` the counts since the last call."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        tools: dict[str, Tool],
        tool_schemas: list[dict],
        cfg: MultiTurnConfig,
        max_response_length: int,
        template_kwargs: Optional[dict] = None,
        interactions: Optional[dict[str, Interaction]] = None,
    ):
        self.engine, self.tokenizer, self.tools, self.cfg = engine, tokenizer, tools, cfg
        self.interactions = dict(interactions or {})
        self.schemas = tool_schemas
        self.R = max_response_length
        self.template_kwargs = dict(template_kwargs or {})
        self.parse = TOOL_CALL_FORMATS[cfg.format]
        problems = tool_template_problems(tokenizer, tool_schemas, self.template_kwargs)
        if problems:  # (the dry run says so too)
            raise ValueError("; ".join(problems))
        self.turn_end = turn_end_id(tokenizer, self.template_kwargs)
        self.other_stops: set[int] = set()
        self.group = getattr(engine, "tp_group", None)
        self.runner = CallRunner(MAX_TOOL_THREADS)
        self.counts: dict[str, float] = {}
        self.turns: list[int] = []
        self.tool_seconds = 0.0

    # ----------------------------------------------------------------------------- one batch
    def generate(self, prompt_ids: list[list[int]], examples: list, sampling: Sampling) -> list[list[Response]]:
        """For each prompt (its row in ``examples``), ``sampling.n`` conversations."""
        # the template's end of turn among the stop tokens: a turn that stops on another one is off template
        self.other_stops = (
            set(sampling.stop_token_ids) - {self.turn_end} if self.turn_end in sampling.stop_token_ids else set()
        )
        convs = [
            Conversation(
                list(p), list(ex.messages), dict(ex.extra_info.get("tools_kwargs") or {}), self._interaction_kwargs(ex)
            )
            for p, ex in zip(prompt_ids, examples)
            for _ in range(sampling.n)
        ]
        turn = 0
        while True:
            open_ = [c for c in convs if not c.done]
            budget = max((self.R - len(c.token_ids) for c in open_), default=0)
            active, budget = self._agree(len(open_), budget)
            if not active:
                break
            turn_sampling = dataclasses.replace(
                sampling,
                n=1,
                max_tokens=max(budget, 1),
                seed=None if sampling.seed is None else (sampling.seed + 7919 * turn) & 0x7FFFFFFF,
            )
            outs = self.engine.generate([c.prompt_ids + c.token_ids for c in open_], turn_sampling)
            pending: list[tuple[Conversation, list[ToolCall]]] = []
            asking: list[Conversation] = []  # answered by their interaction
            for c, group in zip(open_, outs):
                calls = self._model_turn(c, group[0])
                if calls:
                    pending.append((c, calls))
                elif not c.done:
                    asking.append(c)
            t0 = time.perf_counter()
            answers, replies = self._run_calls(pending, asking)
            self.tool_seconds += time.perf_counter() - t0
            for (c, _), outputs in zip(pending, answers):
                self._tool_turn(c, outputs)
            for c, reply in zip(asking, replies):
                self._user_turn(c, reply)
            turn += 1
        for c in convs:
            self.turns.append(c.assistant_turns + c.user_turns + 1)  # verl's num_turns
            self._count("tokens_model", sum(c.mask))
            self._count("tokens_user", c.user_tokens)
            self._count("tokens_tool", len(c.mask) - sum(c.mask) - c.user_tokens)
            if self.cfg.tokenization_sanity_check_mode != "disable" and not self._tokens_match(c):
                self._count("tokenization_mismatches")
        n = sampling.n
        return [
            [
                Response(
                    c.token_ids,
                    c.logprobs,
                    c.finish_reason,
                    mask=c.mask,
                    num_turns=c.assistant_turns + c.user_turns + 1,
                    routed_experts=c.routing(),
                )
                for c in convs[i * n : (i + 1) * n]
            ]
            for i in range(len(prompt_ids))
        ]

    def _interaction_kwargs(self, ex) -> dict:
        """The row's ``extra_info.interaction_kwargs``; with interactions, its ``name`` must be one of them (verl)."""
        kwargs = dict(ex.extra_info.get("interaction_kwargs") or {})
        if self.interactions and kwargs.get("name") not in self.interactions:
            raise ValueError(
                f"row {ex.index}: extra_info.interaction_kwargs.name={kwargs.get('name')!r} is not an "
                f"interaction of multi_turn.interaction_config_path ({', '.join(self.interactions)})"
            )
        return kwargs

    def _agree(self, active: int, budget: int) -> tuple[int, int]:
        """(open conversations, budget) agreed over the tensor-parallel group (its ranks generate together)."""
        if self.group is None:
            return active, budget
        t = torch.tensor([active, budget], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t[0]), int(t[1])

    def _model_turn(self, c: Conversation, r: Response) -> list[ToolCall]:
        """Append the model's turn; the calls to run, [] where the conversation ends here."""
        room = self.R - len(c.token_ids)
        ids, lps = list(r.token_ids[:room]), list(r.logprobs[:room])
        if r.routed_experts is not None:
            c.add_routing(r.routed_experts, len(c.prompt_ids) + len(c.token_ids), len(ids))
        c.add(ids, lps)
        c.assistant_turns += 1
        text = self.tokenizer.decode(
            ids[:-1] if r.finish_reason == "stop" and len(ids) == len(r.token_ids) else ids, skip_special_tokens=False
        )
        c.messages.append({"role": "assistant", "content": text})
        if r.finish_reason != "stop" or len(r.token_ids) > room or len(c.token_ids) >= self.R:
            c.done, c.finish_reason = True, "length"
            return []
        if ids and ids[-1] in self.other_stops:
            # stopped on another stop token (Qwen2.5's <|endoftext|>): the template would have closed the
            # turn with its own, so no turn may follow this one; the conversation ends, its calls unrun
            c.done = c.off_template_stop = True
            self._count("off_template_stops")
            return []
        if (self.cfg.max_assistant_turns and c.assistant_turns >= self.cfg.max_assistant_turns) or (
            self.cfg.max_user_turns and c.user_turns >= self.cfg.max_user_turns
        ):
            c.done = True
            return []
        parsed = self.parse(text)
        self._count("malformed_calls", parsed.malformed)
        if not parsed.calls:
            c.done = not self.interactions  # (else the interaction answers, and says whether it ends here)
            return []
        self._count("dropped_calls", max(0, len(parsed.calls) - self.cfg.max_parallel_calls))
        return parsed.calls[: self.cfg.max_parallel_calls]

    def _tool_turn(self, c: Conversation, outputs: list[ToolOutput]) -> None:
        messages = [
            {
                "role": "tool",
                "content": truncate_tool_text(
                    o.text, self.cfg.max_tool_response_length, self.cfg.tool_response_truncate_side
                ),
            }
            for o in outputs
        ]
        ids = tool_turn_ids(self.tokenizer, messages, self.template_kwargs)
        if len(c.token_ids) + len(ids) >= self.R:  # no room left for the model's next turn (verl: terminated)
            c.done, c.finish_reason = True, "length"
            return
        c.add(ids, None)
        c.messages += messages
        c.user_turns += 1

    def _user_turn(self, c: Conversation, reply: Optional[UserTurn]) -> None:
        """The interaction's answer as a user turn (appended also where it ends the conversation, as
        verl); no answer (it failed or ran late) ends the conversation with no turn."""
        if reply is None:
            c.done = True
            return
        message = {"role": "user", "content": reply.text}
        ids = tool_turn_ids(self.tokenizer, [message], self.template_kwargs)
        if len(c.token_ids) + len(ids) >= self.R:
            c.done, c.finish_reason = True, "length"
            return
        c.add(ids, None)
        c.messages.append(message)
        c.user_turns += 1
        c.user_tokens += len(ids)
        c.done = reply.done

    # ------------------------------------------------------------------------------- tools
    def _run_calls(
        self, pending: list[tuple[Conversation, list[ToolCall]]], asking: list[Conversation]
    ) -> tuple[list[list[ToolOutput]], list[Optional[UserTurn]]]:
        """Every tool call and interaction of this turn at once, each within ``tool_timeout_s``: the
        tools' answers (an error text where one failed), the interactions' (None where one failed)."""
        flat = [(c, call) for c, calls in pending for call in calls]
        jobs = [lambda c=c, call=call: self._call(call, c.tools_kwargs) for c, call in flat]
        jobs += [lambda c=c: self._ask(c) for c in asking]
        results = self.runner.run(jobs, self.cfg.tool_timeout_s)
        answers = iter(results[: len(flat)])
        replies = [self._counted_reply(r) for r in results[len(flat) :]]
        return [[self._counted(next(answers)) for _ in calls] for _, calls in pending], replies

    def _ask(self, c: Conversation):
        """The conversation's interaction's answer, or the exception it raised."""
        try:
            reply = self.interactions[c.interaction_kwargs["name"]].respond(
                list(c.messages), dict(c.interaction_kwargs)
            )
        except Exception as e:  # noqa: BLE001 - whatever an interaction raises ends its conversation, counted
            return e
        return (
            reply
            if isinstance(reply, UserTurn)
            else TypeError(f"respond returned {type(reply).__name__}, not a UserTurn")
        )

    def _counted_reply(self, reply) -> Optional[UserTurn]:
        self._count("interaction_turns")
        if not isinstance(reply, UserTurn):  # raised, returned something else, or no answer in time
            self._count("interaction_errors")
            return None
        self._count("interaction_score", reply.score)
        return reply

    def _counted(self, answer: Optional[ToolOutput]) -> ToolOutput:
        """The call's answer (None: none in time), counted in the metrics."""
        if answer is None:
            answer = ToolOutput(
                f"Error when executing tool: no answer within {self.cfg.tool_timeout_s:g} s", status="timeout"
            )
        self._count("tool_calls")
        self._count({"ok": "tool_ok", "error": "tool_errors", "timeout": "tool_timeouts"}[answer.status])
        self._count("tool_reward", answer.reward)
        return answer

    def _call(self, call: ToolCall, tools_kwargs: dict) -> ToolOutput:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutput(
                f"Error when executing tool: no tool named {call.name!r} (tools: {', '.join(self.tools) or 'none'})",
                status="error",
            )
        try:
            out = tool.execute(call.arguments, dict((tools_kwargs.get(call.name) or {}).get("create_kwargs") or {}))
        except Exception as e:  # noqa: BLE001 - whatever a tool raises is the model's error message
            return ToolOutput(f"Error when executing tool: {type(e).__name__}: {e}", status="error")
        return out if isinstance(out, ToolOutput) else ToolOutput(str(out))

    # ------------------------------------------------------------------- the tokenization check
    def _tokens_match(self, c: Conversation) -> bool:
        """verl's sanity check: the tokens as built turn by turn against the whole conversation
        rendered by the template and encoded at once (the model's last turn may stop short of the
        template's closing text; one that stopped on another stop token is counted apart, in
        ``off_template_stops``, and compared without it)."""
        ours = c.prompt_ids + (c.token_ids[:-1] if c.off_template_stop else c.token_ids)
        rendered = self.tokenizer.apply_chat_template(
            c.messages,
            tools=self.schemas or None,
            tokenize=False,
            add_generation_prompt=c.messages[-1]["role"] != "assistant",
            **self.template_kwargs,
        )
        whole = self.tokenizer.encode(rendered, add_special_tokens=False)
        if self.cfg.tokenization_sanity_check_mode == "strict":
            return whole[: len(ours)] == ours
        text = "".join(self.tokenizer.decode(ours, skip_special_tokens=False).split())
        return "".join(rendered.split()).startswith(text)

    # ----------------------------------------------------------------------------- metrics
    def _count(self, key: str, value: float = 1.0) -> None:
        self.counts[key] = self.counts.get(key, 0.0) + value

    def take_metrics(self, all_reduce_sum=None, all_reduce_max=None) -> dict[str, float]:
        """The step's figures, summed over ranks with the reducers (collective then): verl's
        ``num_turns/*``, ``tools/*`` counts, tokens by source, ``interaction/*`` (turns, errors, mean
        turn score; with an interaction config), ``timing_s/tools`` (the slowest rank)."""
        keys = (
            "tool_calls",
            "tool_ok",
            "tool_errors",
            "tool_timeouts",
            "tool_reward",
            "malformed_calls",
            "dropped_calls",
            "tokens_model",
            "tokens_tool",
            "tokens_user",
            "tokenization_mismatches",
            "off_template_stops",
            "stuck_calls",
            "interaction_turns",
            "interaction_errors",
            "interaction_score",
        )
        self.counts["stuck_calls"] = float(self.runner.stuck())  # (a count now, not a sum over the step)
        sums = torch.tensor(
            [self.counts.get(k, 0.0) for k in keys] + [float(sum(self.turns)), float(len(self.turns))],
            dtype=torch.float64,
        )
        peak = torch.tensor(
            [float(max(self.turns, default=0)), -float(min(self.turns, default=0)), self.tool_seconds],
            dtype=torch.float64,
        )
        if all_reduce_sum is not None:
            sums, peak = all_reduce_sum(sums), all_reduce_max(peak)
        self.counts, self.turns, self.tool_seconds = {}, [], 0.0
        rows = max(sums[-1].item(), 1.0)
        out = {f"tools/{k}": sums[i].item() for i, k in enumerate(keys) if not k.startswith("interaction_")}
        out["tools/tool_reward"] = sums[keys.index("tool_reward")].item() / max(sums[0].item(), 1.0)
        if self.interactions:
            turns = sums[keys.index("interaction_turns")].item()
            out.update(
                {
                    "interaction/turns": turns,
                    "interaction/errors": sums[keys.index("interaction_errors")].item(),
                    "interaction/score": sums[keys.index("interaction_score")].item()
                    / max(turns - sums[keys.index("interaction_errors")].item(), 1.0),
                }
            )
        out.update(
            {
                "num_turns/mean": sums[-2].item() / rows,
                "num_turns/max": peak[0].item(),
                "num_turns/min": -peak[1].item(),
                "timing_s/tools": peak[2].item(),
            }
        )
        return out

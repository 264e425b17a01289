"""verl's ``actor_rollout_ref.rollout.multi_turn`` keys (its names and defaults): the agent loop
(rlhf_hpc/rollout/agent_loop.py) generates turn by turn, runs the tools the model calls between
turns and trains on the model's tokens only. A section of ``rlhf_hpc.config.schema.RolloutConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

__all__ = ["MultiTurnConfig"]


@dataclass
class MultiTurnConfig:
    enable: bool = False
    # turns of the model / of the tools (a tool turn answers every call of one model turn);
    # null: bounded by data.max_response_length only
    max_assistant_turns: Optional[int] = None
    max_user_turns: Optional[int] = None
    max_parallel_calls: int = 1  # calls of one model turn that run (the rest are dropped, as verl)
    max_tool_response_length: int = 256  # characters of one tool's answer; longer is cut as below
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    # verl's tool-config YAML: tools: [{class_name, config, tool_schema}] (rlhf_hpc/tools/tool_config.py)
    tool_config_path: Optional[str] = None
    # verl's interaction-config YAML: interaction: [{name, class_name, config}] (a simulated user answering
    # a turn without tool calls; rlhf_hpc/tools/interaction.py); each row names its own in
    # extra_info.interaction_kwargs.name
    interaction_config_path: Optional[str] = None
    # False (verl's default): the tokens the model produced are what it is trained on; True would
    # re-render its turns through the chat template (refused: the tokens here are always the model's)
    use_inference_chat_template: bool = False
    # the conversation's tokens (turn by turn) against the whole conversation encoded at once:
    # strict compares token ids, ignore_strippable the texts without white space, disable skips it
    tokenization_sanity_check_mode: Literal["strict", "ignore_strippable", "disable"] = "strict"
    format: str = "hermes"  # a name in rlhf_hpc.rollout.tool_calls.TOOL_CALL_FORMATS
    num_repeat_rollouts: Optional[int] = None  # verl's repeated interaction rollouts: refused when set
    # not verl's: the wall-clock limit of one tool call (a code tool's program has sandbox.timeout_s
    # too); a call over it answers the model with an error and the run goes on
    tool_timeout_s: float = 30.0

"""The dry run's checks of ``actor_rollout_ref.rollout.multi_turn``: its values, its tool- and
interaction-config files (each class resolved to one here), and the combinations the agent loop
does not serve."""

from __future__ import annotations

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.tools.interaction_config import read_interaction_config
from rlhf_hpc.tools.tool_calls import TOOL_CALL_FORMATS
from rlhf_hpc.tools.tool_config import read_tool_config

__all__ = ["multi_turn_problems"]

KEY = "actor_rollout_ref.rollout.multi_turn"


def multi_turn_problems(cfg: Config, check_files: bool = True) -> list[str]:
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable:
        set_anyway = [
            k
            for k, v in (
                ("tool_config_path", mt.tool_config_path),
                ("interaction_config_path", mt.interaction_config_path),
            )
            if v
        ]
        return [
            f"{KEY}.{k} is set but {KEY}.enable=false: set enable=true for the agent loop, or remove the key"
            for k in set_anyway
        ]
    errors = []
    for key, value, least in (
        ("max_parallel_calls", mt.max_parallel_calls, 1),
        ("max_tool_response_length", mt.max_tool_response_length, 1),
        ("max_assistant_turns", mt.max_assistant_turns, 1),
        ("max_user_turns", mt.max_user_turns, 0),
        ("tool_timeout_s", mt.tool_timeout_s, 0.001),
    ):
        if value is not None and value < least:
            errors.append(f"{KEY}.{key}={value}: must be at least {least:g}")
    try:
        TOOL_CALL_FORMATS[mt.format]
    except ConfigError as e:
        errors += e.errors
    for key, value, feature in (
        (
            "num_repeat_rollouts",
            mt.num_repeat_rollouts,
            "repeated interaction rollouts are not available in rlhf-hpc (use actor_rollout_ref.rollout.n)",
        ),
        (
            "use_inference_chat_template",
            mt.use_inference_chat_template or None,
            "the agent loop trains on the "
            "tokens the model produced; re-rendering its turns through the chat template is not available "
            "(set it to false)",
        ),
    ):
        if value is not None:
            errors.append(f"{KEY}.{key}={value!r}: {feature}")
    if cfg.reward_model.enable:
        errors.append(
            f"{KEY}.enable=true with reward_model.enable=true: a reward model scoring multi-turn "
            f"conversations is not available in rlhf-hpc (score with a rule or custom_reward_function)"
        )
    for path, read in ((mt.tool_config_path, read_tool_config), (mt.interaction_config_path, read_interaction_config)):
        if path and check_files:
            try:
                read(path)
            except ConfigError as e:
                errors += e.errors
    return errors

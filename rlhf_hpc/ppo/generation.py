"""Phase 2's generation for a list of rows: the engine alone (one turn), or the agent loop around
it where ``actor_rollout_ref.rollout.multi_turn.enable`` (rlhf_hpc/rollout/agent_loop.py: tools
and interactions between turns, the model's tokens masked in)."""

from __future__ import annotations

from typing import Optional

from rlhf_hpc.config.schema import Config
from rlhf_hpc.data.dataset import Example
from rlhf_hpc.distributed.process_group import all_reduce_max, all_reduce_sum
from rlhf_hpc.rollout.agent_loop import AgentLoop
from rlhf_hpc.rollout.base import Response, RolloutEngine, Sampling
from rlhf_hpc.tools.interaction_config import build_interactions, run_interactions
from rlhf_hpc.tools.tool_config import ToolEntry, build_tools, tool_schemas

__all__ = ["Generator"]


class Generator:
    """``generator(rows, sampling)``: ``sampling.n`` responses per row, as ``RolloutEngine.generate``."""

    def __init__(self, cfg: Config, engine: RolloutEngine, tokenizer, tools: list[ToolEntry]):
        self.engine = engine
        mt = cfg.actor_rollout_ref.rollout.multi_turn
        self.agent: Optional[AgentLoop] = None
        if mt.enable:
            self.agent = AgentLoop(
                engine,
                tokenizer,
                build_tools(tools, cfg.sandbox, cfg.reward_model.sandbox_fusion),
                tool_schemas(tools),
                mt,
                cfg.data.max_response_length,
                cfg.data.apply_chat_template_kwargs,
                build_interactions(run_interactions(cfg)),
            )

    def __call__(self, rows: list[Example], sampling: Sampling) -> list[list[Response]]:
        prompts = [r.prompt_ids for r in rows]
        return (
            self.engine.generate(prompts, sampling)
            if self.agent is None
            else self.agent.generate(prompts, rows, sampling)
        )

    def metrics(self) -> dict[str, float]:
        """The agent loop's figures since the last call, over all ranks (collective); {} for one turn."""
        return {} if self.agent is None else self.agent.take_metrics(all_reduce_sum, all_reduce_max)

    def discard_metrics(self) -> None:
        """Forget the figures since the last call (validation's turns are not the step's)."""
        if self.agent is not None:
            self.agent.take_metrics()

"""verl's GSM8K interaction (``verl.interactions.gsm8k_interaction.Gsm8kInteraction``): the user
checks the model's last answer with the GSM8K rule (strict: the last ``#### N``) against the row's
``interaction_kwargs.ground_truth``; right ends the conversation, wrong asks the model to try again.
Its texts and scores are verl's."""

from __future__ import annotations

from typing import Any

from rlhf_hpc.rewards.gsm8k import gsm8k_score
from rlhf_hpc.tools.interaction import Interaction, UserTurn, last_assistant_text

__all__ = ["Gsm8kInteraction"]

RIGHT = "Your response is correct!"
WRONG = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(Interaction):
    def respond(self, messages: list[dict], interaction_kwargs: dict[str, Any]) -> UserTurn:
        truth = interaction_kwargs.get("ground_truth")
        if truth is None:
            raise ValueError("the row has no extra_info.interaction_kwargs.ground_truth")
        score = gsm8k_score(last_assistant_text(messages), str(truth), method="strict", format_score=0.0, score=1.0)
        return UserTurn(RIGHT, done=True, score=score) if score == 1.0 else UserTurn(WRONG, score=score)

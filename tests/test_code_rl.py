"""Code RL with the sandbox reward on the built-in programming set (``synthetic://code``): a tiny
Qwen2 on the real Qwen2 tokenizer taught the answer's form (a ```python program reading n and
printing an expression of it), trained by GRPO on 2 CPU ranks; every response's program runs
against each of its row's cases in the sandbox, and the score is verl's share of the cases passed.
The form is all it learns in this teaching: it rarely copies the task's constant (greedy 0.10 of
the cases after 400 teaching steps, measured), so this shows the path, not learning."""

from __future__ import annotations

import re

import pytest

from rlhf_hpc.config.sandbox_schema import SandboxConfig
from rlhf_hpc.data.synthetic_tasks import CODE_TASKS, synthetic_rows
from rlhf_hpc.observability.tracking import read_metrics
from rlhf_hpc.tools.sandbox import SandboxUnavailable, sandbox_backend
from tests import tool_model
from tests.conftest import engine_available, require, run_launch

# each of CODE_TASKS as Python, in its order
EXPRESSIONS = ["n + {k}", "n * {k}", "n - {k}", "n % {k}", "n * n + {k}", "max(n, {k})"]


def task_of(row: dict) -> tuple[int, int]:
    """(the row's kind in CODE_TASKS, its constant)."""
    text = row["prompt"][0]["content"]
    for i, (words, _) in enumerate(CODE_TASKS):
        found = re.search(re.escape(words).replace(re.escape("{k}"), r"(\d)"), text)
        if found:
            return i, int(found.group(1))
    raise ValueError(text)


def program(expression: str) -> str:
    return f"```python\nn = int(input())\nprint({expression})\n```"


def code_turns(right_share: float):
    """The taught answer: the task's program for ``right_share`` of the rows, another kind's else."""

    def turns(row: dict, rng) -> list[dict]:
        kind, k = task_of(row)
        if rng.random() >= right_share:
            kind = rng.choice([j for j in range(len(EXPRESSIONS)) if j != kind])
        return [{"role": "assistant", "content": program(EXPRESSIONS[kind].format(k=k))}]

    return turns


@pytest.mark.slow
def test_the_taught_programs_are_what_the_cases_check():
    from rlhf_hpc.rewards import rule_score

    rows = synthetic_rows("synthetic://code?size=24", 3)
    assert {task_of(r)[0] for r in rows} == set(range(len(CODE_TASKS)))
    right, wrong = code_turns(1.0), code_turns(0.0)
    try:
        sandbox_backend(SandboxConfig())
    except SandboxUnavailable as e:
        require("a sandbox (bwrap with namespaces)", False, str(e))
    import random

    rng = random.Random(0)
    for row in rows[:6]:
        truth = row["reward_model"]["ground_truth"]
        assert rule_score(row["data_source"], right(row, rng)[0]["content"], truth, {}) == 1.0
        assert rule_score(row["data_source"], wrong(row, rng)[0]["content"], truth, {}) < 1.0


@pytest.mark.slow
def test_grpo_on_the_programming_set_runs_every_program_in_the_sandbox(shared_dir, tmp_path):
    engine_available("vllm")
    try:
        sandbox_backend(SandboxConfig())
    except SandboxUnavailable as e:
        require("a sandbox (bwrap with namespaces)", False, str(e))
    model = tool_model.teach_tool_caller(
        tmp_path / "model",
        shared_dir / "assets" / "qwen2-tokenizer",
        synthetic_rows("synthetic://code?size=256", 0),
        [],
        code_turns(0.5),
        steps=80,
    )
    run = run_launch(
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "data.train_files=synthetic://code?size=256",
        "data.val_files=null",
        "data.max_prompt_length=64",
        "data.max_response_length=48",
        "data.train_batch_size=8",
        f"actor_rollout_ref.model.path={model}",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
        "trainer.total_training_steps=2",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert [m["training/global_step"] for m in metrics] == [1, 2]
    for m in metrics:
        rows = 8 * 4
        # three cases a response, each its own program in the sandbox; none hangs or escapes
        assert m["sandbox/runs"] == 3 * rows and m["sandbox/timeouts"] == m["sandbox/sandbox_errors"] == 0, m
        assert m["sandbox/ok"] > 0 and 0.0 <= m["critic/score/mean"] <= 1.0
    # some program passes some case (at most 0.33-0.67 a step when written), and a group whose scores differ
    # moves the policy: the scores reach the update
    for m in metrics:
        if m["critic/score/max"] > m["critic/score/min"]:
            assert m["actor/grad_norm"] > 0
    assert max(m["critic/score/max"] for m in metrics) > 0

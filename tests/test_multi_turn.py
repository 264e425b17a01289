"""Multi-turn training with tools (``actor_rollout_ref.rollout.multi_turn``): verl's multi-turn
command lines dry-run with their tool configs and the dry run's time plan has the turns, what the
agent loop does not serve is refused by name, verl's GSM8K command line runs on CPU with a small
model taught its format (its tool answering, a checkpoint and a resume), and a run of the trainer
with a model that calls a tool (tests/tool_model.py) through vLLM, tensor-parallel over 2 ranks:
tools answered, their tokens out of the loss, the engine and the actor agreeing on the model's
tokens, validation through the loop, and a resume that replays it; the tool demo (recipe
tiny_lookup_grpo), where GRPO teaches a model to call the tool whose answer it needs."""

from __future__ import annotations

import shlex
import textwrap
from pathlib import Path

import pytest
import yaml

from rlhf_hpc.cli import main as cli_main
from rlhf_hpc.data.tool_warm_start import DEMO_TEACHING
from rlhf_hpc.data.tool_warm_start import teach as teach_tool_use
from rlhf_hpc.observability.tracking import read_metrics
from rlhf_hpc.tools.tool_config import read_tool_config, tool_schemas
from tests import tool_model
from tests.conftest import REPO, engine_available, run_launch, seed_base

VAL = "val-core/synthetic/lookup/reward/mean@1"

# verl b178a3c's examples/sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn_vllm_fsdp.sh, with its
# config file's keys (gsm8k_multiturn_grpo.yaml: return_raw_chat, multi_turn.enable,
# max_assistant_turns) on the command line and `python3 -m verl.trainer.main_ppo` -> launch.py
# (its duplicate `use_kl_loss=${use_kl_loss}`, an unset shell variable, left out)
VERL_GSM8K_MULTITURN = """
    data.return_raw_chat=True actor_rollout_ref.rollout.multi_turn.enable=True
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=5
    actor_rollout_ref.rollout.name=vllm algorithm.adv_estimator=grpo data.train_batch_size=32
    data.max_prompt_length=1024 data.max_response_length=1024 data.filter_overlong_prompts=True
    data.truncation='error' data.return_raw_chat=True actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct
    actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 actor_rollout_ref.actor.use_kl_loss=True
    actor_rollout_ref.actor.kl_loss_coef=0.001 actor_rollout_ref.actor.kl_loss_type=low_var_kl
    actor_rollout_ref.actor.entropy_coeff=0 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.gpu_memory_utilization=0.9 actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
    algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.project_name='gsm8k_async_rl'
    trainer.experiment_name='qwen2.5-3b_function_rm-gsm8k-sgl-multi-w-tool-verify-n16' trainer.n_gpus_per_node=16
    trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=20 trainer.logger='["console"]'
    data.train_files=$HOME/data/gsm8k/train.parquet data.val_files=$HOME/data/gsm8k/test.parquet
    trainer.total_epochs=15 actor_rollout_ref.rollout.trace.token2text=False actor_rollout_ref.rollout.mode=async
    actor_rollout_ref.rollout.multi_turn.enable=true actor_rollout_ref.rollout.enforce_eager=True
    actor_rollout_ref.actor.use_torch_compile=False
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$HOME/gsm8k_tool_config.yaml"
    actor_rollout_ref.rollout.free_cache_engine=True
"""
# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, as data
GSM8K_TOOL_CONFIG = {
    "tools": [
        {
            "class_name": "verl.tools.gsm8k_tool.Gsm8kTool",
            "config": {"type": "native"},
            "tool_schema": {
                "type": "function",
                "function": {
                    "name": "calc_gsm8k_reward",
                    "description": "A tool for calculating the reward of gsm8k.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "answer": {"type": "string", "description": "The model's answer, must be a digits"}
                        },
                        "required": ["answer"],
                    },
                },
            },
        }
    ]
}
# its sandbox_fusion_tool_config.yaml (ReTool's code interpreter), the service's URL left out: the
# sandbox on the node runs the code
CODE_TOOL_CONFIG = {
    "tools": [
        {
            "class_name": "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
            "config": {
                "num_workers": 10,
                "enable_global_rate_limit": True,
                "rate_limit": 10,
                "default_timeout": 30,
                "default_language": "python",
                "memory_limit_mb": 1024,
                "type": "native",
            },
            "tool_schema": {
                "type": "function",
                "function": {
                    "name": "code_interpreter",
                    "description": "executes code",
                    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                },
            },
        }
    ]
}


# verl b178a3c's examples/sglang_multiturn/run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh, with its
# config file's keys (gsm8k_multiturn_grpo_w_interaction.yaml: return_raw_chat, multi_turn.enable,
# max_user_turns) on the command line, its variables' defaults filled in, and `$@` left out
VERL_GSM8K_INTERACTION = """
    data.return_raw_chat=True actor_rollout_ref.rollout.multi_turn.enable=True
    actor_rollout_ref.rollout.multi_turn.max_user_turns=5
    algorithm.adv_estimator=grpo data.train_batch_size=512 data.max_prompt_length=1024
    data.max_response_length=3072 data.filter_overlong_prompts=True data.truncation='error'
    data.return_raw_chat=True actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct
    actor_rollout_ref.model.use_remove_padding=True actor_rollout_ref.model.enable_gradient_checkpointing=True
    actor_rollout_ref.model.enable_activation_offload=True actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=512 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
    actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=sglang
    actor_rollout_ref.rollout.gpu_memory_utilization=0.7 actor_rollout_ref.rollout.n=8
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.ref.fsdp_config.param_offload=False
    algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger='["console","wandb"]'
    trainer.project_name='gsm8k_async_rl'
    trainer.experiment_name='qwen2.5-0.5b_function_rm-gsm8k-sgl-multi-w-interaction-n8'
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=-1 trainer.test_freq=20
    data.train_files=$HOME/data/gsm8k_verl_sgl_multi_turn_w_interaction/train.parquet
    data.val_files=$HOME/data/gsm8k_verl_sgl_multi_turn_w_interaction/test.parquet
    actor_rollout_ref.rollout.multi_turn.interaction_config_path="$HOME/gsm8k_interaction_config.yaml"
    trainer.total_epochs=15
"""


def verl_args(home: Path) -> list[str]:
    (home / "gsm8k_tool_config.yaml").write_text(yaml.safe_dump(GSM8K_TOOL_CONFIG, sort_keys=False))
    return shlex.split(textwrap.dedent(VERL_GSM8K_MULTITURN).replace("$HOME", str(home)))


def dry_run(args: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main([*args, "cluster=local", "--dry-run"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_verls_gsm8k_multi_turn_command_line_dry_runs_with_its_tool_config(tmp_path, capsys):
    rc, out, err = dry_run(verl_args(tmp_path), capsys)
    assert rc == 0, err
    mt = yaml.safe_load(out.partition("# command (cluster=local)\n")[0])["actor_rollout_ref"]["rollout"]["multi_turn"]
    assert (mt["enable"], mt["max_assistant_turns"], mt["format"]) == (True, 5, "hermes")
    assert mt["tool_config_path"] == str(tmp_path / "gsm8k_tool_config.yaml")
    assert "with multi_turn.enable it is the agent loop there" in err


@pytest.mark.slow
def test_the_code_interpreter_config_dry_runs_and_checks_the_sandbox(tmp_path, capsys):
    (tmp_path / "code.yaml").write_text(yaml.safe_dump(CODE_TOOL_CONFIG))
    args = verl_args(tmp_path) + [f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'code.yaml'}"]
    rc, _, err = dry_run(args, capsys)
    assert rc == 0, err
    rc, _, err = dry_run(args + ["sandbox.backend=nonexistent"], capsys)  # the sandbox is checked for a code tool
    assert rc == 2 and "sandbox.backend: unknown sandbox backend 'nonexistent'" in err, err


def test_the_dry_runs_time_plan_has_the_turns_and_the_tools(tmp_path, capsys):
    import re

    args = verl_args(tmp_path)  # (max_assistant_turns=5, max_tool_response_length 256 characters)
    rc, out, err = dry_run(args + ["plan.assistant_turns=2.5", "plan.tool_seconds=1.5"], capsys)
    assert rc == 0, err
    assert (
        "2.5 assistant turns (plan.assistant_turns), tool turns of 64 tokens (max_tool_response_length / 4), "
        "1.5 s a tool turn (plan.tool_seconds)"
    ) in out
    gen = next(line for line in out.splitlines() if line.startswith("#   gen "))
    # the two tool turns of the longest conversation wait 1.5 s each; 96 tool tokens prefilled
    assert "tools 3;" in gen and "96 tool tokens of the response prefilled" in gen, gen

    def decode_steps(*extra):
        rc, out, err = dry_run(args + list(extra), capsys)
        assert rc == 0, err
        return int(re.search(r"(\d+) decode steps", out).group(1))

    # tool tokens are prefilled, not decoded: more of the same budget in tool turns, fewer decode steps
    assert decode_steps("plan.tool_response_length=200") < decode_steps("plan.tool_response_length=10")
    rc, _, err = dry_run(args + ["plan.assistant_turns=6"], capsys)
    assert (
        rc == 2
        and "plan.assistant_turns=6.0: the mean assistant turns of a conversation is at least 1 and at "
        "most multi_turn.max_assistant_turns=5"
        in err
    ), err
    rc, _, err = dry_run(["recipe=tiny_klppo", "plan.tool_seconds=1"], capsys)
    assert rc == 2 and "plan.tool_seconds=1.0: planned for multi-turn runs only" in err, err


@pytest.mark.slow
def test_verls_gsm8k_interaction_command_line_dry_runs_with_its_interaction_config(shared_dir, tmp_path, capsys):
    import subprocess
    import sys

    data = tmp_path / "data" / "gsm8k_verl_sgl_multi_turn_w_interaction"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_hpc.data.prepare",
            "gsm8k_multiturn_w_interaction",
            "--src",
            str(shared_dir / "data" / "gsm8k"),
            "--out",
            str(data),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    (tmp_path / "gsm8k_interaction_config.yaml").write_text(
        (REPO / "recipes" / "interactions" / "gsm8k_interaction_config.yaml").read_text()
    )
    args = shlex.split(textwrap.dedent(VERL_GSM8K_INTERACTION).replace("$HOME", str(tmp_path)))
    # as written: only what is not here is refused, by name (SGLang: vLLM is this project's engine)
    rc, _, err = dry_run(args, capsys)
    assert rc == 2 and "enable_activation_offload=True: activation offloading is not available" in err, err
    rc, _, err = dry_run([a for a in args if "activation_offload" not in a], capsys)
    assert rc == 2 and "unknown rollout engine 'sglang'; registered: vllm, hf" in err, err
    args = [a.replace("rollout.name=sglang", "rollout.name=vllm") for a in args if "activation_offload" not in a]
    rc, out, err = dry_run(args, capsys)
    assert rc == 0, err
    mt = yaml.safe_load(out.partition("# command (cluster=local)\n")[0])["actor_rollout_ref"]["rollout"]["multi_turn"]
    assert (mt["max_user_turns"], mt["interaction_config_path"]) == (5, str(tmp_path / "gsm8k_interaction_config.yaml"))
    # rows that name no interaction of the config (verl's tool example's rows) are refused before the queue
    subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_hpc.data.prepare",
            "gsm8k_multiturn",
            "--src",
            str(shared_dir / "data" / "gsm8k"),
            "--out",
            str(data),
        ],
        check=True,
        capture_output=True,
    )
    rc, _, err = dry_run(args, capsys)
    assert (
        rc == 2
        and (
            "train.parquet, row 0, column 'extra_info': interaction_kwargs.name=None is not an "
            "interaction of actor_rollout_ref.rollout.multi_turn.interaction_config_path (gsm8k)"
        )
        in err
    ), err


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=True"],
            "re-rendering its turns through the chat template is not available",
        ),
        (["actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=2"], "use actor_rollout_ref.rollout.n"),
        (
            ["actor_rollout_ref.rollout.multi_turn.format=llama3_json"],
            "unknown tool-call format 'llama3_json'; registered: hermes",
        ),
        (
            ["actor_rollout_ref.rollout.multi_turn.max_parallel_calls=0"],
            "multi_turn.max_parallel_calls=0: must be at least 1",
        ),
        (
            ["reward_model.enable=True", "reward_model.model.path=Qwen/Qwen2.5-3B-Instruct"],
            "a reward model scoring multi-turn conversations is not available",
        ),
        (
            ["actor_rollout_ref.rollout.multi_turn.enable=False"],
            "multi_turn.tool_config_path is set but actor_rollout_ref.rollout.multi_turn.enable=false",
        ),
        (
            ["actor_rollout_ref.rollout.multi_turn.tool_config_path=/no/such.yaml"],
            "multi_turn.tool_config_path=/no/such.yaml: no such file",
        ),
    ],
)
def test_what_the_agent_loop_does_not_serve_is_refused_by_name(extra, message, tmp_path, capsys):
    rc, _, err = dry_run(verl_args(tmp_path) + extra, capsys)
    assert rc == 2 and message in err, err


# ------------------------------------------------------------------------ the trainer, end to end
def launch(run: Path, data: Path, steps: int, *extra: str):
    return run_launch(
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={run}",
        f"data.train_files={data / 'train.parquet'}",
        f"data.val_files={data / 'val.parquet'}",
        "data.max_prompt_length=64",
        "data.max_response_length=128",
        "data.train_batch_size=8",
        f"actor_rollout_ref.model.path={data / 'model'}",
        "actor_rollout_ref.model.tokenizer_path=tiny://chars",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={data / 'tools.yaml'}",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        "critic.optim.lr=1e-4",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        "trainer.logger=[console]",
        *extra,
        timeout=600,
    )


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory):
    """(a 3-step run, the same resumed from its step-2 checkpoint in a new directory, the data folder)."""
    engine_available("vllm")
    data = tmp_path_factory.mktemp("tool-task")
    tool_model.teach(data / "model", steps=200)
    tool_model.write_rows(data / "train.parquet", tool_model.KEYS * 2)
    tool_model.write_rows(data / "val.parquet", tool_model.KEYS[:4])
    tool_model.write_tool_config(data / "tools.yaml")
    full = launch(data / "full", data, 3)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    resumed = launch(data / "resumed", data, 3, f"trainer.resume_mode={data / 'full' / 'global_step_2'}")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return read_metrics(data / "full"), read_metrics(data / "resumed"), data


@pytest.mark.slow
def test_tools_answer_and_only_the_models_tokens_are_trained(tool_runs):
    full, _, _ = tool_runs
    assert [m["training/global_step"] for m in full] == [1, 2, 3]
    for m in full:
        rows = 8 * 2  # prompts x rollout.n
        assert m["tools/tool_calls"] >= rows * 3 // 4 and m["tools/tool_ok"] == m["tools/tool_calls"]
        assert m["tools/tool_errors"] == m["tools/tool_timeouts"] == 0
        # a sampled turn may end in the tokenizer's other stop token (<|endoftext|>), which the
        # template would not write: a true mismatch, counted; rare for this model
        assert m["tools/tokenization_mismatches"] <= rows // 8
        assert m["num_turns/max"] == 4 and 2 <= m["num_turns/min"] and m["tools/tokens_tool"] > 0
        # the lengths the trainer logs are the model's tokens (verl: the response mask's), not the tool's
        assert m["response_length/mean"] * rows == pytest.approx(m["tools/tokens_model"])
        # the engine's log-probs of the model's tokens == the actor's (float32), the tool's tokens between them
        assert m["rollout/logprob_diff_max"] < 1e-3
        assert m["timing_s/tools"] >= 0 and m["critic/score/mean"] > 0.5  # the taught model mostly answers right
    assert "val-core/synthetic/lookup/reward/mean@1" in full[1]


@pytest.mark.slow
def test_a_resume_replays_the_agent_loop_exactly(tool_runs):
    full, resumed, _ = tool_runs
    last = resumed[-1]
    assert last["training/global_step"] == 3
    for key in (
        "tools/tool_calls",
        "tools/tokens_model",
        "tools/tokens_tool",
        "num_turns/mean",
        "critic/score/mean",
        "rollout/logprob_diff_mean",
        "actor/pg_loss",
    ):
        assert last[key] == full[2][key], key


@pytest.mark.slow
def test_an_interaction_answers_as_the_user_through_the_trainer(tool_runs, tmp_path):
    """The taught model with its tool and a user who checks its answer (a user's own interaction,
    tests/tool_model.CodeCheckInteraction): right ends the conversation, wrong asks again."""
    _, _, data = tool_runs
    (tmp_path / "model").symlink_to(data / "model")
    (tmp_path / "tools.yaml").write_text((data / "tools.yaml").read_text())
    tool_model.write_rows(tmp_path / "train.parquet", tool_model.KEYS * 2, interaction="check")
    tool_model.write_rows(tmp_path / "val.parquet", tool_model.KEYS[:4], interaction="check")
    tool_model.write_interaction_config(tmp_path / "check.yaml")
    run = launch(
        tmp_path / "run",
        tmp_path,
        1,
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=3",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=null",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp_path / 'check.yaml'}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [m] = read_metrics(tmp_path / "run")
    rows = 8 * 2
    # every conversation's answer is checked: at least one user turn each, most of them right
    assert m["interaction/turns"] >= rows and m["interaction/errors"] == 0 and m["interaction/score"] > 0.5, m
    assert m["tools/tokens_user"] > 0 and m["num_turns/max"] >= 5  # prompt, call, tool, answer, the user
    # the user's turns, as the tool's, are out of the lengths, the loss and the rollout/actor check
    assert m["response_length/mean"] * rows == pytest.approx(m["tools/tokens_model"])
    assert m["rollout/logprob_diff_max"] < 1e-3 and m["tools/tokenization_mismatches"] <= rows // 8


@pytest.mark.slow
def test_prepare_writes_verls_multi_turn_gsm8k_rows_and_the_prompts_show_the_tool(shared_dir, tmp_path):
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from rlhf_hpc.config.schema import DataConfig
    from rlhf_hpc.data.dataset import load_examples
    from rlhf_hpc.tools.tool_config import read_tool_config, tool_schemas

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_hpc.data.prepare",
            "gsm8k_multiturn",
            "--src",
            str(shared_dir / "data" / "gsm8k"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    tok = AutoTokenizer.from_pretrained(shared_dir / "assets" / "qwen2-tokenizer")
    tok.chat_template = tool_model.HERMES_TEMPLATE  # (its own has no tool support: tests/test_agent_loop.py)
    tools = tool_schemas(read_tool_config(str(REPO / "recipes" / "tools" / "gsm8k_tool_config.yaml")))
    [first, *_] = load_examples(str(tmp_path / "test.parquet"), tok, DataConfig(max_prompt_length=1024), tools=tools)
    assert first.extra_info["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "18"}}}
    assert [m["role"] for m in first.messages] == ["system", "user"] and "calc_gsm8k_reward" in first.messages[0][
        "content"
    ]
    prompt = tok.decode(first.prompt_ids)
    # Qwen2.5's template puts the tool's schema in the system turn, then the row's messages
    assert prompt.startswith("<|im_start|>system\nYou are a math expert.") and "<tools>" in prompt
    assert '"name": "calc_gsm8k_reward"' in prompt and prompt.endswith("<|im_start|>assistant\n")


def test_a_chat_template_without_tool_support_is_refused_at_the_dry_run(shared_dir, tmp_path, capsys):
    tokenizer = shared_dir / "assets" / "qwen2-tokenizer"
    tool_model.write_tool_config(tmp_path / "tools.yaml")
    args = [
        "recipe=tiny_klppo",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"data.tokenizer={tokenizer}",
        "actor_rollout_ref.model.path=tiny://qwen2?vocab_size=151936",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
    ]
    rc, _, err = dry_run(args, capsys)
    assert rc == 2 and f"data.tokenizer={tokenizer}: the chat template drops tool messages" in err, err
    recipe = tmp_path / "with_template.yaml"  # (a template is easier to give in a recipe than on a command line)
    recipe.write_text(
        yaml.safe_dump(
            {"base": "tiny_klppo", "actor_rollout_ref": {"model": {"custom_chat_template": tool_model.HERMES_TEMPLATE}}}
        )
    )
    rc, _, err = dry_run([f"recipe={recipe}", *args[1:]], capsys)
    assert rc == 0, err


# ------------------------------------------------------------------------ verl's command line, run
@pytest.fixture
def verl_gsm8k_runs(shared_dir, tmp_path_factory):
    """verl's GSM8K multi-turn command line as written, sized for a CPU: the tiny Qwen2 on the real
    Qwen2 tokenizer taught the conversation's format (tests/tool_model.teach_gsm8k_caller) in place of
    Qwen2.5-3B, verl's rows from rlhf_hpc.data.prepare, vLLM tensor-parallel over 2 CPU ranks; 2 steps
    with a checkpoint each. (That a resume replays the agent loop exactly is
    ``test_a_resume_replays_the_agent_loop_exactly``'s, with the same engine, tensor-parallel size and
    loop: the tokenizer and the tool do not enter what it checks.)"""
    import json
    import subprocess
    import sys

    from rlhf_hpc.data.prepare import gsm8k_multiturn_rows

    engine_available("vllm")
    home = tmp_path_factory.mktemp("verl-home")
    gsm8k = shared_dir / "data" / "gsm8k"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_hpc.data.prepare",
            "gsm8k_multiturn",
            "--src",
            str(gsm8k),
            "--out",
            str(home / "data" / "gsm8k"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in (gsm8k / "train.jsonl").read_text().splitlines()[:48]]
    # taught on 16 rows, its call rate checked on 32 others (the run samples prompts from the whole set)
    verl_args(home)  # (writes the tool config: the model is taught on the tools as the run reads them)
    schemas = tool_schemas(read_tool_config(str(home / "gsm8k_tool_config.yaml")))
    model = tool_model.teach_gsm8k_caller(
        home / "model",
        shared_dir / "assets" / "qwen2-tokenizer",
        gsm8k_multiturn_rows(records[:16], "train"),
        schemas,
        check_rows=gsm8k_multiturn_rows(records[16:], "train"),
    )
    small = [
        f"actor_rollout_ref.model.path={model}",
        "trainer.n_gpus_per_node=2",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_response_length=128",
        "trainer.total_training_steps=2",
        "trainer.save_freq=1",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "cluster=local",
        # float32, where the engine's and the actor's log-probs agree to 1e-3 (verl's bf16 default:
        # 0.1 at most on this run, the precision's own difference, as single-turn)
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=float32",
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=float32",
    ]
    full = run_launch(*verl_args(home), *small, f"trainer.default_local_dir={home / 'full'}", timeout=600)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    assert (home / "full" / "global_step_1").is_dir() and (home / "full" / "global_step_2").is_dir()
    return read_metrics(home / "full")


@pytest.mark.slow
def test_verls_gsm8k_multi_turn_command_line_runs_on_cpu_with_a_small_model(verl_gsm8k_runs):
    full = verl_gsm8k_runs
    assert [m["training/global_step"] for m in full] == [1, 2]
    rows = 4 * 2
    for m in full:
        # the model calls verl's calc_gsm8k_reward (the GSM8K tool here), which answers every call. How
        # often it calls is the taught model's, not this test's subject: the teaching checked that at
        # least tool_model.MIN_CALL_RATE of its sampled first turns call, on the prompts the run builds
        # (15 of the 16 conversations called here; before, the model was taught on the tool schema in
        # another key order than the run's config file showed it, and called in 10 here, 6 elsewhere:
        # issue #58). Fewer than 8 of 16 at a rate of 0.8: a chance below 1e-3
        assert m["tools/tool_calls"] >= 1 and m["tools/tool_ok"] == m["tools/tool_calls"], m
        assert m["tools/tool_errors"] == m["tools/tool_timeouts"] == 0 and m["tools/tokens_tool"] > 0
        assert m["num_turns/max"] >= 4  # the prompt, the call, the tool's verdict, the answer
        # the model's tokens only in the lengths, the loss and the rollout/actor check
        assert m["response_length/mean"] * rows == pytest.approx(m["tools/tokens_model"])
        assert m["rollout/logprob_diff_max"] < 1e-3
        assert m["tools/tokenization_mismatches"] <= rows // 4
    assert sum(m["tools/tool_calls"] for m in full) >= rows


# ------------------------------------------------------------------------ RL learns the tool's use
@pytest.mark.slow
def test_rl_teaches_the_model_to_call_the_tool_whose_answer_it_needs(tmp_path):
    """The tool demo (recipe tiny_lookup_grpo) with its starting model, in 20 steps: a model that
    can call the tool and copy any code it answers (the codes it was taught on were random), but
    calls in about a fifth of its conversations and guesses a digit in the rest. GRPO raises the calls
    and the score, and greedy validation goes from guessing to calling."""
    engine_available("vllm")
    teach_tool_use(tmp_path / "model", **DEMO_TEACHING, seed=seed_base())
    steps = 20
    out = run_launch(
        "recipe=tiny_lookup_grpo",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"actor_rollout_ref.model.path={tmp_path / 'model'}",
        "actor_rollout_ref.rollout.name=vllm",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={steps}",
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    val = [m[VAL] for m in metrics if VAL in m]
    train = [m for m in metrics if "critic/score/mean" in m]
    assert len(train) == steps and len(val) == 2

    def mean(key, rows):
        return sum(m[key] for m in rows) / len(rows)

    rows = 16 * 8  # prompts x rollout.n
    first, last = train[:3], train[-3:]
    assert mean("tools/tool_calls", first) < 0.45 * rows < 0.65 * rows < mean("tools/tool_calls", last)
    assert mean("critic/score/mean", last) > mean("critic/score/mean", first) + 0.3
    assert val[0] < 0.5 and val[1] >= 0.9  # greedy: a guess, then the tool's code (64 keys)
    for m in train:  # (a call sampled at temperature 1 may lack its key: the tool's error, told to the model)
        assert m["tools/tool_errors"] <= rows // 16 and m["rollout/logprob_diff_max"] < 1e-3

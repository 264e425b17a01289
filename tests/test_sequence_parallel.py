"""Ulysses sequence parallelism (rlhf_hpc.distributed.sequence_parallel): sp=2 and sp=4 against sp=1 on a
4-rank HSDP mesh (one torchrun, tests/dist_sp_checks.py), and the validation of the three
``ulysses_sequence_parallel_size`` keys.

Tolerances (fp32). Forward outputs (log-probs, entropies, values): 1e-5 absolute (they are
O(1-10); only the order of the attention sums over heads/sequences and the packing differ).
Losses and metrics: 1e-5 relative. Parameters after one update of two Adam steps at lr 1e-3
(each parameter moves up to ~2e-3): 2e-5 absolute, 1% of the largest move.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import Config
from rlhf_hpc.distributed.sequence_parallel import heads_problem
from rlhf_hpc.recipe.load import load_config
from tests.conftest import REPO, run_launch

SCRIPT = REPO / "tests" / "dist_sp_checks.py"
OUTPUT_TOL, METRIC_RTOL, PARAM_TOL = 1e-5, 1e-5, 2e-5


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(SCRIPT), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "sp.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
def test_sequence_parallel_forward_outputs_equal_sp1(checks, sp):
    got = checks[f"sp{sp}"]
    for key in ("log_probs", "entropy", "values", "log_probs_after"):
        assert got[key] <= OUTPUT_TOL, (key, got[key])
    # not a comparison of zeros
    assert min(checks["scale"][k] for k in ("log_probs", "entropy", "values")) > 0.5
    # sum pi^2 is ~1/256 here (the tiny model's vocabulary): relative to its size
    assert checks["scale"]["sum_pi_squared"] > 0
    assert got["sum_pi_squared"] <= 1e-4 * checks["scale"]["sum_pi_squared"], got["sum_pi_squared"]


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
def test_sequence_parallel_losses_and_metrics_equal_sp1(checks, sp):
    scale = {**checks["scale"]["actor_metrics"], **checks["scale"]["critic_metrics"]}
    diffs = checks[f"sp{sp}"]["metric_diffs"]
    assert set(diffs) >= {"actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss"}
    for key, d in diffs.items():
        assert d <= METRIC_RTOL * max(1.0, abs(scale[key])), (key, d, scale[key])
    assert scale["actor/pg_loss"] != 0 and scale["critic/vf_loss"] > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("sp", [2, 4])
def test_sequence_parallel_update_gives_the_parameters_of_sp1(checks, sp):
    got = checks[f"sp{sp}"]
    assert got["actor_params"] <= PARAM_TOL and got["critic_params"] <= PARAM_TOL, got
    # the update moved the parameters far more than the tolerance: a dropped or doubled gradient
    # (a row counted sp times, or once per slice) would show
    assert checks["scale"]["actor_update"] > 50 * PARAM_TOL and checks["scale"]["critic_update"] > 50 * PARAM_TOL


@pytest.mark.slow
def test_routing_replay_under_sequence_parallelism_equals_sp1(checks):
    """The tiny Qwen3-MoE: the old-log-prob pass recording the actor's own routing (router_replay
    R2) records the same experts for every token with sp=2 as with sp=1, and a pass replaying a
    random routing (R3, R2's update) computes the same log-probs and counts the same agreement, each
    token once over the ranks."""
    moe = checks["moe"]
    assert moe["sp2_routing"] == 0 and moe["sp2_agreement"] == 0 and moe["sp2_counted"] == 0
    assert moe["sp2_log_probs"] <= OUTPUT_TOL and moe["sp2_replayed_log_probs"] <= OUTPUT_TOL
    # not a comparison of nothing: every valid token routed in both layers, and the random experts used
    assert moe["counted"] == 2 * moe["routed_tokens"] == 2 * sum(checks["row_tokens"])
    assert moe["agreement"] < 0.5 and moe["replay_moved"] > 1e-2 and moe["log_probs_scale"] > 0.5


@pytest.mark.slow
def test_sequence_parallel_ranks_see_a_slice_of_each_row(checks):
    # one row per update micro-batch: sp=1 runs whole rows, sp=k a 1/k slice of one (padded to k)
    tokens = checks["update_forward_tokens_max"]
    longest = max(checks["row_tokens"])
    assert tokens["1"] == longest
    assert tokens["2"] == -(-longest // 2) and tokens["4"] == -(-longest // 4)


@pytest.mark.slow
def test_training_steps_with_sp2_for_actor_reference_and_critic_match_sp1(tmp_path):
    """The engine wiring end to end: tiny_klppo (KL loss and KL in the reward: the reference runs),
    2 steps on 2 ranks, all three models with sp=2 vs sp=1 (both varlen attention). The same
    rollouts, so every logged number matches: step 1 (old/ref log-probs, values, losses, gradient
    norms of the first update) within 1e-5 relative (measured: 3e-6); step 2 within 1e-3, since
    Adam's first step moves every parameter by ~lr whatever the size of its gradient, so fp32
    rounding in near-zero gradients shows after one update (measured: 1e-4 on critic/vf_loss).
    A row counted twice, or a lost slice gradient, would be off by far more."""
    runs = {}
    for sp in (1, 2):
        run = tmp_path / f"sp{sp}"
        out = run_launch(
            "recipe=tiny_klppo",
            f"trainer.default_local_dir={run}",
            "trainer.total_training_steps=2",
            "trainer.save_freq=-1",
            "trainer.test_freq=-1",
            "actor_rollout_ref.rollout.name=hf",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.model.override_config.attn_implementation=varlen",
            "critic.model.override_config.attn_implementation=varlen",
            f"actor_rollout_ref.actor.ulysses_sequence_parallel_size={sp}",
            f"critic.ulysses_sequence_parallel_size={sp}",
            env={"OMP_NUM_THREADS": "1"},
            timeout=600,
        )
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        runs[sp] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(runs[1]) == len(runs[2]) == 2
    compared = 0
    for rel, a, b in zip((1e-5, 1e-3), runs[1], runs[2]):
        for key, v in a.items():
            # (plan/: the time plan of each layout, which differs with sp by design)
            if key.startswith(("timing_s/", "perf/", "memory_gb/", "plan/", "training/log_step")) or not isinstance(
                v, (int, float)
            ):
                continue
            assert b[key] == pytest.approx(v, rel=rel, abs=1e-6), (a["training/global_step"], key)
            compared += 1
    assert compared > 60 and runs[1][1]["actor/kl_loss"] > 0 and runs[1][1]["critic/grad_norm"] > 0


# ----------------------------------------------------------------------------------- validation
def tiny(*overrides: str) -> Config:
    return load_config("tiny_klppo", list(overrides), check_files=False)[0]


def errors_of(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        tiny(*overrides)
    return ei.value.errors


def test_sp_key_is_accepted_and_the_reference_follows_the_actor():
    cfg = tiny(
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "critic.ulysses_sequence_parallel_size=4",
    )
    assert cfg.actor_rollout_ref.actor.ulysses_sequence_parallel_size == 2
    assert cfg.actor_rollout_ref.ref.ulysses_sequence_parallel_size == 2  # null -> the actor's, as verl
    assert cfg.critic.ulysses_sequence_parallel_size == 4


def test_sp_that_does_not_divide_the_ranks_is_refused_by_name():
    errs = errors_of("trainer.n_gpus_per_node=4", "critic.enable=true", "critic.ulysses_sequence_parallel_size=3")
    assert any(e.startswith("critic.ulysses_sequence_parallel_size=3 must divide the ranks") for e in errs), errs


def test_sp_needs_packed_rows_and_varlen_attention():
    errs = errors_of(
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    )
    assert any("set actor_rollout_ref.model.use_remove_padding=true" in e for e in errs), errs
    assert any("attn_implementation=varlen" in e and "attn_implementation=sdpa" in e for e in errs), errs


def test_sp_that_cannot_split_the_heads_is_refused_with_the_limit():
    # the tiny Qwen2 has 4 query heads and 2 KV heads
    errs = errors_of("trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8")
    assert any(
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8" in e and "4 attention heads" in e for e in errs
    ), errs


@pytest.mark.parametrize(
    "heads,kv,sp,ok",
    [
        (28, 4, 2, True),
        (28, 4, 4, True),
        (28, 4, 8, False),
        (32, 8, 8, True),
        (32, 8, 16, True),
        (12, 3, 2, False),
        (12, 3, 3, True),
        (4, 2, 4, True),
        (4, 2, 3, False),
    ],
)
def test_heads_rule(heads, kv, sp, ok):
    # Qwen2.5-7B: 28 heads, 4 KV heads -> sp 2 and 4; 12 query / 3 KV heads with sp=2: KV heads cannot split
    assert (heads_problem(heads, kv, sp, "k") is None) == ok


def test_memory_plan_counts_one_slice_of_the_micro_batch_per_rank():
    from rlhf_hpc.planning.memory_plan import build_plan

    def update_activations(*extra: str) -> float:
        plan = build_plan(
            tiny("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", *extra)
        )
        return next(p for p in plan.phases if p.name == "update_actor").parts["activations"]

    # 4 rows of 40 tokens per micro-batch: 160 tokens on a rank, or 80 (half of each row) with sp=2
    assert update_activations("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2") == pytest.approx(
        update_activations() / 2
    )


def test_heads_of_a_local_model_directory_are_checked_before_launch(tmp_path):
    # Qwen2.5-7B's attention: 28 query heads, 4 KV heads (sp 2 and 4 split them, 8 cannot)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=224,
            intermediate_size=448,
            num_hidden_layers=1,
            num_attention_heads=28,
            num_key_value_heads=4,
            vocab_size=64,
        )
    ).save_pretrained(tmp_path)  # (weights: checked)
    tiny(
        "trainer.n_gpus_per_node=4",
        f"actor_rollout_ref.model.path={tmp_path}",
        "data.tokenizer=tiny://chars",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
        "actor_rollout_ref.rollout.name=hf",  # (head_dim 8: not a head size vLLM's CPU attention runs)
    )
    errs = errors_of(
        "trainer.n_gpus_per_node=8",
        f"actor_rollout_ref.model.path={tmp_path}",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8",
    )
    assert any(
        e.startswith(
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8: the model's 28 attention "
            "heads do not divide by 8"
        )
        for e in errs
    ), errs


def test_engine_refuses_heads_it_cannot_split_before_building_groups():
    from transformers import Qwen2Config

    from rlhf_hpc.distributed.sequence_parallel import for_model

    with pytest.raises(ValueError, match="critic.ulysses_sequence_parallel_size=4: the model's 6 key/value heads"):
        for_model(
            4, Qwen2Config(num_attention_heads=12, num_key_value_heads=6), "critic.ulysses_sequence_parallel_size"
        )
    assert for_model(1, Qwen2Config(num_attention_heads=12, num_key_value_heads=6), "k") is None

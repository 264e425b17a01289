"""DAPO through launch.py: the dapo reward manager's overlong shaping equal to verl's, dynamic
sampling's group filter (global over ranks, verl's rule), the sampler, the keys, the time plan, and
a short run."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.data.dataset import StatefulSampler
from rlhf_hpc.distributed.rows import RolloutRow, prompt_share
from rlhf_hpc.planning.time_plan import generation_batches
from rlhf_hpc.ppo.dynamic_sampling import collect_groups, gen_seed, keep_groups
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rewards.overlong import overlong_metrics, overlong_reward
from tests.test_algos import run_ranks

DAPO_KEYS = [
    "algorithm.adv_estimator=grpo",
    "critic.enable=false",
    "actor_rollout_ref.rollout.n=4",
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=acc",
]


# ------------------------------------------------------------------ verl's code, transcribed (b178a3c)
def verl_dapo_reward(
    score: float, valid_response_length: torch.Tensor, max_resp_len: int, buffer_len: int, penalty_factor: float
):
    """verl/workers/reward_manager/dapo.py, DAPORewardManager.__call__, one item."""
    reward = score
    overlong_buffer_len = buffer_len
    expected_len = max_resp_len - overlong_buffer_len
    exceed_len = valid_response_length - expected_len
    overlong_penalty_factor = penalty_factor
    overlong_reward = min(-exceed_len / overlong_buffer_len * overlong_penalty_factor, 0)
    reward += overlong_reward
    reward_tensor = torch.zeros(1, dtype=torch.float32)
    reward_tensor[0] = reward
    return reward_tensor[0], overlong_reward


def verl_kept_uids(uids, metric_vals):
    """verl-recipe dapo_ray_trainer.py: the groups kept by filter_groups."""
    prompt_uid2metric_vals = defaultdict(list)
    for uid, metric_val in zip(uids, metric_vals, strict=True):
        prompt_uid2metric_vals[uid].append(metric_val)
    prompt_uid2metric_std = {}
    for prompt_uid, metric_vals in prompt_uid2metric_vals.items():
        prompt_uid2metric_std[prompt_uid] = np.std(metric_vals)
    return [uid for uid, std in prompt_uid2metric_std.items() if std > 0 or len(prompt_uid2metric_vals[uid]) == 1]


# ------------------------------------------------------------------------------ overlong shaping
@pytest.mark.parametrize("max_len,buffer,factor", [(8, 4, 1.0), (20480, 4096, 1.0), (512, 100, 0.5), (16, 16, 2.0)])
def test_overlong_penalty_equals_verls(max_len, buffer, factor):
    g = torch.Generator().manual_seed(max_len + buffer)
    lengths = torch.randint(1, max_len + 1, (64,), generator=g)
    lengths[:3] = torch.tensor([max_len, max_len - buffer, max_len - buffer + 1])
    scores = torch.rand(64, generator=g)
    ours = scores + overlong_reward(lengths, max_len, buffer, factor)
    for i in range(64):
        want, penalty = verl_dapo_reward(float(scores[i]), lengths[i], max_len, buffer, factor)
        assert ours[i].item() == want.item(), (i, int(lengths[i]))
        assert overlong_reward(lengths[i : i + 1], max_len, buffer, factor).item() == float(penalty)
    assert ours.dtype == torch.float32
    assert overlong_reward(torch.tensor([max_len]), max_len, buffer, factor).item() == pytest.approx(-factor)


def test_overlong_metrics_are_global_over_ranks():
    penalties = [torch.tensor([0.0, -0.5]), torch.tensor([-1.0, 0.0, 0.0, 0.0])]
    out = run_ranks(2, lambda r, ar: overlong_metrics(penalties[r], ar))
    for m in out:
        assert m["reward/overlong_reward/mean"] == pytest.approx(-1.5 / 6)
        assert m["reward/overlong/mean"] == pytest.approx(2 / 6)


# ------------------------------------------------------------------------------ the group filter
def test_keep_groups_is_verls_rule():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 4, 5):
        table = (torch.rand(40, n, generator=g) > 0.5).double()  # acc: 0/1, many groups all equal
        table[::7] = 0.1  # constant non-integers too
        table[3] = torch.tensor([0.1 * 3 / 3] * n, dtype=torch.float64)
        uids = [u for u in range(40) for _ in range(n)]
        kept = verl_kept_uids(uids, table.reshape(-1).tolist())
        assert [u for u, k in enumerate(keep_groups(table)) if k] == kept
    assert keep_groups(torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)) == [False, True, False]


def rows_of(prompts: list[int], mine: range, n: int) -> list[RolloutRow]:
    return [
        RolloutRow(
            prompt_pos=p,
            example=prompts[p],
            prompt_ids=[1],
            token_ids=[2, 3],
            logprobs=[0.0, 0.0],
            finish_reason="stop",
        )
        for p in mine
        for _ in range(n)
    ]


def test_collect_groups_keeps_exactly_the_groups_with_variance_over_two_ranks():
    """2 ranks, generation batches of 6 prompts x n=3: the metric of a response is a function of its
    prompt (dataset index) and its position in the group; every rank sees the same decisions, the
    kept prompts in generation order, cut at train_batch_size, and its rows of them renumbered."""
    n, gen, train, world = 3, 6, 8, 2
    order = list(range(100))
    signal = {e: e % 3 != 0 for e in order}  # a third of the prompts have no variance

    def run(rank, all_reduce):
        state = {"pos": 0}

        def generate_batch(k):
            prompts = order[state["pos"] : state["pos"] + gen]
            state["pos"] += gen
            return prompts, rows_of(prompts, prompt_share(gen, world, rank), n)

        def metric_values(rows):
            seen = defaultdict(int)
            out = []
            for r in rows:
                out.append(float(seen[r.example] if signal[r.example] else 1.0))
                seen[r.example] += 1
            return torch.tensor(out)

        return collect_groups(generate_batch, metric_values, train, n, 0, all_reduce), state["pos"]

    out = run_ranks(world, run)
    kept = [e for e in order if signal[e]][:train]
    (a, used_a), (b, used_b) = out
    assert a.prompts == b.prompts == kept
    assert used_a == used_b == 12  # two generation batches: 4 + 4 prompts with signal
    assert (
        a.metrics
        == b.metrics
        == {
            "train/num_gen_batches": 2.0,
            "dynamic_sampling/prompts_generated": 12.0,
            "dynamic_sampling/prompts_kept": 8.0,
        }
    )
    rows = a.rows + b.rows
    assert sorted(r.prompt_pos for r in rows) == [p for p in range(train) for _ in range(n)]
    assert all(kept[r.prompt_pos] == r.example for r in rows)


def test_collect_groups_raises_as_verl_at_max_num_gen_batches():
    def generate_batch(k):
        return [k], rows_of([k], range(1), 2)

    with pytest.raises(ValueError, match="num_gen_batches=3 >= max_num_gen_batches=3"):
        collect_groups(generate_batch, lambda rows: torch.zeros(len(rows)), 2, 2, 3, lambda t: t)


def test_generation_seeds_differ_per_batch_and_keep_the_steps_first():
    assert gen_seed(1, 5, 0, 0, first=123) == 123
    assert len({gen_seed(1, 5, k, 0, first=123) for k in range(4)}) == 4


def test_sampler_advances_by_what_was_generated_and_resumes_exactly():
    a = StatefulSampler(50, 16, seed=3)
    taken = [a.next_prompts(12) for _ in range(3)]
    b = StatefulSampler(50, 16, seed=3)
    b.load_state_dict(a.state_dict())
    assert b.next_prompts(12) == a.next_prompts(12)
    assert len({i for t in taken for i in t}) == 36
    assert a.next_prompts(12) and a.epoch == 1  # the epoch's tail of 2 dropped, as next_batch does


# ------------------------------------------------------------------------------ keys and plans
def test_verl_dapo_keys_dry_run():
    cfg, _ = load_config(
        "tiny_klppo",
        [
            *DAPO_KEYS,
            "data.gen_batch_size=24",
            "algorithm.filter_groups.max_num_gen_batches=10",
            "reward_model.reward_manager=dapo",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
            "+reward_model.reward_kwargs.max_resp_len=8",
        ],
        check_files=False,
    )
    assert cfg.algorithm.filter_groups.enable and cfg.data.gen_batch_size == 24
    ob = cfg.reward_model.overlong_buffer
    assert (cfg.reward_model.reward_manager, ob.enable, ob.len, ob.penalty_factor, ob.log) == (
        "dapo",
        True,
        4,
        1.0,
        False,
    )
    cfg, _ = load_config(
        "tiny_klppo",
        [
            *DAPO_KEYS,
            "reward_model.reward_manager=dapo",
            "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=2",
        ],
        check_files=False,
    )
    assert cfg.reward_model.overlong_buffer.len == 2


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4"],
            "set reward_model.reward_manager=dapo",
        ),
        (
            [
                "reward_model.reward_manager=dapo",
                "reward_model.overlong_buffer.enable=true",
                "reward_model.overlong_buffer.len=9",
            ],
            "reward_model.overlong_buffer.len (9) must be in",
        ),
        (["+reward_model.reward_kwargs.max_resp_len=9"], "reward_model.reward_kwargs.max_resp_len=9"),
        (["data.gen_batch_size=24"], "data.gen_batch_size=24 without algorithm.filter_groups.enable=true"),
        (["algorithm.filter_groups.enable=true"], "needs algorithm.filter_groups.metric"),
        (
            [
                *DAPO_KEYS[:3],
                "algorithm.filter_groups.enable=true",
                "algorithm.filter_groups.metric=seq_final_reward",
                "algorithm.use_kl_in_reward=true",
            ],
            "seq_final_reward with algorithm.use_kl_in_reward=true",
        ),
    ],
)
def test_dapo_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        load_config("tiny_klppo", overrides, check_files=False)


def test_time_plan_scales_generation_by_the_expected_batches():
    cfg, _ = load_config("tiny_klppo", [*DAPO_KEYS, "data.gen_batch_size=8"], check_files=False)
    scale, why = generation_batches(cfg)
    assert scale == pytest.approx(math.ceil(2 * 16 / 8) * 8 / 16) and "assumed: half the groups" in why
    assert generation_batches(cfg, measured=3.0)[0] == pytest.approx(3 * 8 / 16)
    cfg, _ = load_config(
        "tiny_klppo",
        [*DAPO_KEYS, "data.gen_batch_size=8", "algorithm.filter_groups.max_num_gen_batches=2"],
        check_files=False,
    )
    assert generation_batches(cfg)[0] == pytest.approx(1.0)
    off, _ = load_config("tiny_klppo", check_files=False)
    assert generation_batches(off) == (1.0, "")


# ------------------------------------------------------------------------------ the trainer's phase
class ScriptedEngine:
    """A rollout engine stub: the response to a prompt is its last 4 tokens, or, for prompts whose
    token sum is even, alternately that and another (so those groups may have score variance)."""

    dp_rank = 0

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling):
        from rlhf_hpc.rollout.base import Response

        self.calls.append((len(prompts), sampling.seed))
        out = []
        for p in prompts:
            same = sum(p) % 2 == 1
            out.append(
                [
                    Response(list(p[-4:]) if same or i % 2 else [5, 5], [0.0] * (4 if same or i % 2 else 2), "stop")
                    for i in range(sampling.n)
                ]
            )
        return out

    def release(self):
        pass


def test_generate_filtered_builds_the_step_batch_of_the_kept_groups():
    """``PPOTrainer.generate_filtered`` on one rank with a scripted engine: the sampler advances by
    every generation batch, the batch holds train_batch_size prompts x n rows, its uids are the kept
    prompts' positions, every kept group has score variance, and the counts are logged."""
    from rlhf_hpc.data.dataset import load_examples
    from rlhf_hpc.distributed.process_group import DistContext
    from rlhf_hpc.models.tokenizer import load_tokenizer
    from rlhf_hpc.observability.perf import Timer
    from rlhf_hpc.ppo.faults import FaultInjector
    from rlhf_hpc.ppo.generation import Generator
    from rlhf_hpc.ppo.step_batch import score_responses
    from rlhf_hpc.ppo.trainer import PPOTrainer
    from rlhf_hpc.rewards import RewardFunction

    cfg, _ = load_config(
        "tiny_klppo",
        [
            *DAPO_KEYS,
            "data.gen_batch_size=6",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "algorithm.filter_groups.max_num_gen_batches=30",
        ],
        check_files=False,
    )
    t = object.__new__(PPOTrainer)
    t.cfg, t.ctx = cfg, DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    t.tokenizer = load_tokenizer("tiny://chars", False, None)
    t.train_set = load_examples(cfg.data.train_files, t.tokenizer, cfg.data, split_seed=cfg.data.seed)
    t.sampler = StatefulSampler(len(t.train_set), 8, cfg.data.seed, True)
    t.rollout, t.reward_fn, t.faults, t.overlong = (
        ScriptedEngine(),
        RewardFunction(cfg.custom_reward_function),
        FaultInjector(cfg.trainer.inject_fault, 0),
        False,
    )
    t.generator = Generator(cfg, t.rollout, t.tokenizer, [])  # single-turn: the engine itself
    metrics: dict = {}
    batch, rows, prompts = t.generate_filtered(3, Timer(), metrics)
    assert len(prompts) == 8 and batch["uid"].tolist() == [r.prompt_pos for r in rows]
    assert sorted(batch["uid"].tolist()) == [p for p in range(8) for _ in range(4)]
    gens = int(metrics["train/num_gen_batches"])
    assert t.sampler.pos == 6 * gens and metrics["dynamic_sampling/prompts_generated"] == 6 * gens
    assert len({seed for _, seed in t.rollout.calls}) == gens  # a seed per generation batch
    scores = score_responses(t.reward_fn, t.tokenizer, t.train_set, rows, batch)
    for p in range(8):
        assert scores[batch["uid"] == p].std() > 0
    assert all(t.train_set[prompts[r.prompt_pos]].prompt_ids == r.prompt_ids for r in rows)


# ------------------------------------------------------------------------------ a short run
@pytest.mark.slow
def test_dapo_run_filters_groups_and_logs_the_counts(tmp_path):
    """tiny_klppo as GRPO with n=4, dynamic sampling (generation batches of 8 prompts for 16: at
    least 2 per step) and overlong shaping, 3 steps on 2 ranks: it finishes and logs the counts.
    One epoch of one mini-batch, as DAPO recipes run: on-policy, pi_old is the update's own forward
    (no old-log-prob pass; tests/test_on_policy.py), and every figure of it is still logged."""
    from rlhf_hpc.observability.tracking import read_metrics
    from tests.conftest import run_launch

    run = tmp_path / "run"
    out = run_launch(
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={run}",
        "trainer.total_training_steps=3",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "actor_rollout_ref.rollout.name=hf",
        *DAPO_KEYS,
        "data.gen_batch_size=8",
        "algorithm.use_kl_in_reward=false",
        "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=4",
        "reward_model.overlong_buffer.log=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_kl_loss=true",
        timeout=600,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    records = read_metrics(run)
    assert [r["training/global_step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["train/num_gen_batches"] >= 2
        assert r["dynamic_sampling/prompts_generated"] == 8 * r["train/num_gen_batches"]
        assert r["dynamic_sampling/prompts_kept"] >= 16
        assert r["training/prompts_trained"] == 16 and r["training/responses_trained"] == 64
        assert -1.0 <= r["reward/overlong_reward/mean"] <= 0.0 and 0.0 <= r["reward/overlong/mean"] <= 1.0
        # on-policy: no pass, a ratio of exactly 1, the check and the figures from the update's forward
        assert "timing_s/old_log_prob" not in r and r["actor/ppo_kl"] == 0.0 and r["actor/pg_clipfrac"] == 0.0
        assert 0 < r["rollout/logprob_diff_max"] < 1e-4 and abs(r["rollout_corr/kl"]) < 1e-5  # fp32 engine
        assert r["actor/ref_kl_mean"] >= 0 and 0 < r["actor/entropy"] < 5

"""Routing replay for mixtures of experts (verl's router_replay R2 and R3; rlhf_hpc.models.moe_routing).

In one process, on the tiny Qwen3-MoE and Mixtral (8 experts, 2 per token): a model replaying its
own routing computes bit for bit what it computes alone; replayed experts get the gate weights the
model's own math gives them (checked against the experts module called directly), and the router
still gets a gradient; tokens without a record route themselves; the hf engine records, per row,
what a full forward of the same weights routes; the step batch lays the routing out as
``input_ids``, and a packed and a padded forward replay it alike. Under torchrun (slow): a bf16
engine and an fp32 trainer, with and without replay.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.distributed.rows import RolloutRow
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.models.moe_routing import RoutingReplay, routers
from rlhf_hpc.ops.batching import make_padded_batch
from rlhf_hpc.ppo.actor import per_token_logprobs
from rlhf_hpc.ppo.step_batch import routed_experts_batch
from rlhf_hpc.recipe.load import load_config
from tests.conftest import run_launch

MOE = ["tiny://qwen3_moe", "tiny://mixtral"]
R3 = [
    "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
    "actor_rollout_ref.actor.router_replay.mode=R3",
]


def recorded_routing(model, ids: torch.Tensor) -> torch.Tensor:
    """(tokens, layers, k) experts ``model`` routes ``ids`` (1, T) to."""
    replay = RoutingReplay(model)
    with torch.no_grad(), replay.record() as calls:
        model(ids)
    replay.remove()
    return torch.stack([layer[0] for layer in calls], 1).long()


def random_routing(tokens: int, layers: int, experts: int = 8, k: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens * layers)]).view(
        tokens, layers, k
    )


@pytest.mark.parametrize("path", MOE)
def test_replaying_a_models_own_routing_changes_nothing_and_other_experts_change_the_output(path):
    model = build_causal_lm(path, torch.float32, seed=0, attn="eager").eval()
    ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    own = recorded_routing(model, ids)
    replay = RoutingReplay(model)
    with torch.no_grad():
        alone = model(ids).logits
        with replay.replay(own):
            same = model(ids).logits
        assert torch.equal(same, alone)
        assert replay.take_agreement() == (30 * 2, 30 * 2)
        other = random_routing(30, 2)
        with replay.replay(other):
            moved = model(ids).logits
        agreed, counted = replay.take_agreement()
        assert (moved - alone).abs().max() > 1e-2 and agreed < counted == 60
        with replay.replay(torch.zeros_like(other)):  # no record anywhere: every token routes itself
            assert torch.equal(model(ids).logits, alone)


@pytest.mark.parametrize("path", MOE)
def test_replayed_experts_get_the_models_own_gate_weights_and_the_router_learns(path):
    """One MoE block: its output under replay equals its experts called on the targets, weighted by
    softmax(router logits) at the targets, renormalised (both families renormalise here)."""
    model = build_causal_lm(path, torch.float32, seed=0, attn="eager")
    block = model.model.layers[0].mlp
    hidden = torch.randn(1, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    targets = random_routing(12, 2)
    replay = RoutingReplay(model)
    with replay.replay(targets):
        out = block(hidden)
    flat = hidden.view(-1, hidden.shape[-1])
    t = targets[:, 0]
    weights = torch.softmax(flat @ block.gate.weight.T, -1).gather(-1, t)
    weights = weights / weights.sum(-1, keepdim=True)
    expected = block.experts(flat, t, weights.to(hidden.dtype)).view_as(out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    with replay.replay(targets):
        block(hidden).square().sum().backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


def test_the_hf_engine_records_what_a_full_forward_of_its_weights_routes():
    from rlhf_hpc.rollout.base import Sampling
    from rlhf_hpc.rollout.hf_engine import HFEngine

    path = "tiny://qwen3_moe?vocab_size=64"
    cfg, _ = load_config(
        "tiny_klppo", [f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.rollout.dtype=float32", *R3]
    )
    engine = HFEngine(cfg, path, torch.device("cpu"))
    actor = build_causal_lm(path, torch.float32, seed=5, attn="eager").eval()
    engine.update_weights((n, p.detach()) for n, p in actor.named_parameters())
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 9, 3)]
    for prompt, group in zip(prompts, engine.generate(prompts, Sampling(n=2, temperature=1.0, max_tokens=12))):
        for r in group:
            tokens = prompt + r.token_ids
            assert r.routed_experts.shape == (len(tokens), 2, 2) and r.routed_experts.dtype == torch.int16
            assert (r.routed_experts[-1] == 0).all()  # never fed back: no routing
            full = recorded_routing(actor, torch.tensor([tokens]))
            assert torch.equal(full[:-1].sort(-1).values, r.routed_experts[:-1].long().sort(-1).values)


def test_vllms_routed_experts_become_a_responses_routing_with_the_last_token_zero():
    """vLLM's CompletionOutput.routed_experts (GPU builds; its CPU build cannot return them): the
    prompt's and the response's tokens but the last, (tokens - 1, layers, k)."""
    import numpy as np

    from rlhf_hpc.rollout.vllm_engine import engine_routing

    found = np.arange(9 * 2 * 2, dtype=np.int64).reshape(9, 2, 2) % 8
    routed = engine_routing(found, 10)
    assert routed.shape == (10, 2, 2) and routed.dtype == torch.int16
    assert torch.equal(routed[:9].long(), torch.as_tensor(found)) and (routed[9] == 0).all()
    with pytest.raises(RuntimeError, match="returned no routed experts"):
        engine_routing(None, 10)
    with pytest.raises(RuntimeError, match=r"shape \(12, 2, 2\), for 10 tokens"):
        engine_routing(np.zeros((12, 2, 2)), 10)


def test_replay_with_vllm_is_accepted_for_a_gpu_run():
    load_config(
        "tiny_klppo",
        [
            "actor_rollout_ref.model.path=tiny://qwen3_moe",
            "actor_rollout_ref.rollout.name=vllm",
            *R3[1:],
            "trainer.device=cuda",
        ],
        check_files=False,
    )


def test_the_step_batch_lays_the_routing_out_as_input_ids_and_packed_and_padded_forwards_replay_it_alike():
    model = build_causal_lm("tiny://qwen3_moe", torch.float32, seed=0, attn="eager").eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9, 3)]
    responses = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 7, 1)]
    rows = [
        RolloutRow(i, i, p, r, [0.0] * len(r), "length", routed_experts=random_routing(len(p) + len(r), 2, seed=i))
        for i, (p, r) in enumerate(zip(prompts, responses))
    ]
    P, R = 10, 8
    routed = routed_experts_batch(rows, P, R)
    batch = make_padded_batch(prompts, responses, 0, P, R)
    assert routed.shape == (3, P + R, 2, 2)
    mask = batch["attention_mask"].bool()
    assert (routed[~mask] == 0).all()  # padding: no record
    for i, row in enumerate(rows):  # each token's routing where input_ids holds the token
        assert torch.equal(routed[i][mask[i]].long(), row.routed_experts.long())
    batch["routed_experts"] = routed
    replay = RoutingReplay(model)
    with torch.no_grad():
        packed, _ = per_token_logprobs(model, batch, remove_padding=True, routing=replay)
        padded, _ = per_token_logprobs(model, batch, remove_padding=False, routing=replay)
        alone, _ = per_token_logprobs(model, batch, remove_padding=True)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert (packed - alone).abs().max() > 1e-3  # (the random experts were used)


def test_r2_records_the_actors_own_routing_laid_out_as_input_ids_and_the_update_replays_it():
    """router_replay R2: the old-log-prob pass routes on its own and returns what it chose, (B, P + R,
    layers, k) where input_ids has the tokens (a packed and a padded forward alike, zero on padding);
    after the router has moved (an update), a forward replaying it routes as the pass did, not as the
    moved router would."""
    model = build_causal_lm("tiny://qwen3_moe", torch.float32, seed=0, attn="eager").eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 6, 2)]
    responses = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 3, 6)]
    batch = make_padded_batch(prompts, responses, 0, 6, 6)
    mask = batch["attention_mask"].bool()
    replay = RoutingReplay(model)
    with torch.no_grad():
        plain, _ = per_token_logprobs(model, batch)
        chosen, padded = [], []
        lp, _ = per_token_logprobs(model, batch, routing=replay, routing_out=chosen)
        per_token_logprobs(model, batch, remove_padding=False, routing=replay, routing_out=padded)
    assert torch.equal(lp, plain)  # recording routes nothing elsewhere
    (laid,) = chosen
    assert laid.shape == (3, 12, 2, 2) and (laid[~mask] == 0).all()
    assert torch.equal(padded[0][mask], laid[mask])
    for i in range(3):  # each row's tokens routed as a forward of that row alone routes them
        alone = recorded_routing(model, batch["input_ids"][i][mask[i]].unsqueeze(0))
        assert torch.equal(laid[i][mask[i]].long().sort(-1).values, alone.sort(-1).values)
    batch["actor_routed_experts"] = laid
    with torch.no_grad():  # the update moved the routers
        for router in routers(model):
            router.weight.add_(torch.randn(router.weight.shape, generator=g) * router.weight.std() * 2)
        moved = []
        own, _ = per_token_logprobs(model, batch, routing=replay, routing_out=moved)
        assert not torch.equal(moved[0][mask], laid[mask])  # the moved routers choose otherwise
        replay.take_agreement()
        after = RoutingReplay(model)  # (registered second: records what the replay hook chose)
        with after.record():
            kept, _ = per_token_logprobs(model, batch, routing=replay, routing_key="actor_routed_experts")
        agreed, counted = replay.take_agreement()
        assert agreed < counted == int(mask.sum()) * 2
        replayed = torch.stack([torch.cat(calls) for calls in after.recorded], 1)
        assert torch.equal(replayed.sort(-1).values, laid[mask].sort(-1).values)
        assert (kept - own).abs().max() > 1e-4


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["actor_rollout_ref.actor.router_replay.mode=R2", "algorithm.rollout_correction.bypass_mode=true"],
            "R2 replays the old-log-prob pass's routing in the update, and in bypass mode",
        ),
        (R3[:1] + R3[2:], "set actor_rollout_ref.rollout.enable_rollout_routing_replay=True"),
        (["actor_rollout_ref.rollout.name=vllm", *R3[1:]], "with vLLM on a GPU .* its CPU build cannot run"),
        (
            [*R3, "actor_rollout_ref.model.path=tiny://qwen3"],
            "is a Qwen3ForCausalLM; routing is recorded and replayed in",
        ),
    ],
)
def test_routing_replay_that_cannot_run_here_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_klppo", ["actor_rollout_ref.model.path=tiny://qwen3_moe", *overrides])


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.actor.router_replay.mode=R2"],
        # the routers see each rank's slice: replayed slice by slice (tests/test_sequence_parallel.py)
        ["actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
        [*R3, "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
    ],
)
def test_r2_needs_no_recording_engine_and_either_mode_runs_with_ulysses(overrides):
    cfg, _ = load_config("tiny_klppo", ["actor_rollout_ref.model.path=tiny://qwen3_moe", *overrides])
    assert cfg.actor_rollout_ref.actor.router_replay.mode in ("R2", "R3")


@pytest.mark.slow
def test_replay_narrows_a_bf16_engine_and_an_fp32_trainer_and_both_log_the_routers_agreement(tmp_path):
    """5 KL-PPO steps of the tiny Qwen3-MoE, the hf engine in bf16 recording its routing, the actor
    in fp32: measured (5 steps, two runs) the trainer routes 98.4-99.9% of (token, layer) pairs as
    the engine did; without replay rollout/logprob_diff_max is 0.013-0.024, with R3 0.0045-0.0065
    (what is left is bf16 outside the routers)."""
    runs = {}
    for mode in ("disabled", "R3"):
        out = run_launch(
            "recipe=tiny_klppo",
            "actor_rollout_ref.model.path=tiny://qwen3_moe?vocab_size=64",
            *R3[:2],
            f"actor_rollout_ref.actor.router_replay.mode={mode}",
            "actor_rollout_ref.rollout.dtype=bfloat16",
            "trainer.total_training_steps=5",
            "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=5",
            "trainer.save_freq=-1",
            "trainer.test_freq=-1",
            f"trainer.default_local_dir={tmp_path / mode}",
            timeout=600,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        runs[mode] = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    for rows in runs.values():
        assert all(0.9 < r["rollout/router_topk_agreement"] <= 1.0 for r in rows)
        # verl's load-balance metrics on the interval's last step: every response token but each
        # row's last, 2 layers x 2 experts each (16 prompts x 2 responses of up to 8 tokens, 5 steps)
        assert [("rollout/moe/max_vio/max" in r) for r in rows] == [False] * 4 + [True]
        assert 0 < rows[-1]["rollout/moe/routed_expert_assignments"] <= 5 * 32 * 7 * 2 * 2
    assert all(r["rollout/logprob_diff_max"] < 0.012 for r in runs["R3"])
    worst = {mode: max(r["rollout/logprob_diff_max"] for r in rows) for mode, rows in runs.items()}
    assert worst["R3"] < worst["disabled"], worst


@pytest.mark.slow
def test_r2_trains_one_step_off_in_the_split_layout_through_vllm_with_rows_regrouped_by_their_tokens(tmp_path):
    """router_replay R2 through the whole loop with vLLM's CPU build (which cannot record its
    routing: R3 cannot run there), in the split layout (a trainer rank, a rollout rank, generation
    one step ahead: R2 is the trainer's own record, whoever generated the rows), micro-batches by
    token budget (rows regrouped, their routing put back in row order): every step trains, the
    old-log-prob pass agrees with the engine where the rows are fresh (R2 replays nothing there),
    and no engine agreement is logged (the engine recorded none). (The colocated trainer runs the
    same phases: test_r2_records_the_actors_own_routing..., in process.)"""
    out = run_launch(
        "recipe=tiny_klppo",
        "actor_rollout_ref.model.path=tiny://qwen3_moe?vocab_size=64",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.actor.router_replay.mode=R2",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.hybrid_engine=false",
        "rollout.n_gpus_per_node=1",
        "trainer.n_gpus_per_node=1",
        "async_training.staleness_threshold=1",
        "trainer.total_training_steps=2",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        f"trainer.default_local_dir={tmp_path}",
        env={"OMP_NUM_THREADS": "1"},  # (as the split layout's tests: one thread a rank)
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["training/global_step"] for r in rows] == [1, 2]
    assert [r["rollout/staleness/max"] for r in rows] == [0.0, 1.0]  # the second step's rows: one update old
    assert rows[0]["rollout/logprob_diff_max"] < 1e-4
    for r in rows:
        assert "rollout/router_topk_agreement" not in r
        assert r["actor/grad_norm"] > 0 and torch.isfinite(torch.tensor(r["actor/pg_loss"]))


def test_the_router_load_balancing_loss_is_transformers_own_over_the_tokens_the_forward_sees():
    """``override_config.output_router_logits``: the packed forward (no padding) and the padded one
    (padding masked) report the same loss, near top-k for a router that spreads tokens evenly, and
    it reaches the routers' weights."""
    model = build_causal_lm(
        "tiny://qwen3_moe", torch.float32, seed=0, attn="eager", override={"output_router_logits": True}
    )
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9, 3)]
    responses = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (4, 7, 1)]
    batch = make_padded_batch(prompts, responses, 0, 10, 8)
    packed, padded = [], []
    per_token_logprobs(model, batch, remove_padding=True, aux_loss=packed)
    with torch.no_grad():
        per_token_logprobs(model, batch, remove_padding=False, aux_loss=padded)
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-6)
    assert 1.5 < float(packed[0]) < 3.0  # (8 experts, 2 per token: 2 when perfectly even)
    packed[0].backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor_rollout_ref.model.path=tiny://qwen3"], "is not a mixture of experts"),
        (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], "with Ulysses"),
    ],
)
def test_a_load_balancing_loss_that_cannot_apply_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=f"output_router_logits=True.*{message}"):
        load_config(
            "tiny_klppo",
            [
                "actor_rollout_ref.model.path=tiny://qwen3_moe",
                "actor_rollout_ref.model.override_config.output_router_logits=true",
                *overrides,
            ],
        )


def test_verls_load_balance_metrics_count_the_response_tokens_but_each_ones_last():
    """verl 0.9.1's rollout/moe/* (metric_utils): 4 experts, top-2, one layer; the counts by hand."""
    from rlhf_hpc.ops.moe_load_metrics import MoELoadCounts, load_balance_metrics, response_load_counts

    routed = torch.zeros(2, 2 + 3, 1, 2, dtype=torch.int16)  # prompt 2, response 3
    routed[0, 2:, 0] = torch.tensor([[0, 2], [0, 2], [1, 3]])  # (the last: not counted)
    routed[1, 2:, 0] = torch.tensor([[1, 3], [0, 1], [0, 0]])  # (the last valid one: not counted)
    routed[:, :2, 0] = torch.tensor([3, 3])  # (prompts: not counted)
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    counts = response_load_counts(routed, response_mask, experts=4)
    assert counts.tolist() == [[2, 1, 2, 1]]
    metrics = load_balance_metrics(torch.tensor([[2, 0, 2, 0], [1, 1, 1, 1]]))
    # shares x 4 - 1: layer 0 [1, -1, 1, -1], layer 1 all 0
    expected = {"max_vio": [1.0, 0.0], "min_vio": [-1.0, 0.0], "avg_vio": [1.0, 0.0]}
    for name, per_layer in expected.items():
        assert [metrics[f"rollout/moe/{name}/layer_{i}"] for i in (0, 1)] == per_layer
        assert metrics[f"rollout/moe/{name}/max"] == max(per_layer)
        assert metrics[f"rollout/moe/{name}/avg"] == sum(per_layer) / 2
    interval = MoELoadCounts(experts=4)
    interval.add(counts)
    interval.add(counts)
    popped = interval.pop_metrics()
    assert popped["rollout/moe/routed_expert_assignments"] == 12 and popped["rollout/moe/routed_experts_found"] == 1.0
    assert interval.pop_metrics()["rollout/moe/routed_experts_found"] == 0.0  # (counts start over)


def test_load_balance_metrics_need_the_engines_routing():
    with pytest.raises(ConfigError, match="moe_load_balance_metrics_interval=5: .*enable_rollout_routing_replay=True"):
        load_config(
            "tiny_klppo",
            [
                "actor_rollout_ref.model.path=tiny://qwen3_moe",
                "actor_rollout_ref.rollout.moe_load_balance_metrics_interval=5",
            ],
        )


@pytest.mark.slow
def test_r3_replays_a_multi_turn_conversations_routing_merged_over_its_turns(tmp_path):
    """R3 with the multi-turn agent loop: each turn's generate call records the routing of what it
    computed, merged over the turns (rlhf_hpc.rollout.agent_loop.Conversation.add_routing) and laid
    out as the conversation's tokens. A tiny Qwen3-MoE whose output head is zero (every token equally
    likely: its turns end on the end of turn at random) talks with a user who asks again until it
    answers right (tests/tool_model.CodeCheckInteraction), so conversations run several turns. With
    an fp32 engine the recorded routing is the trainer's own, token for token: a row out of place
    (a turn's routing on another turn's tokens) routes elsewhere. (Which call a context row comes
    from: test_agent_loop.py::test_a_conversations_routing_is_each_tokens_first_record...)"""
    from rlhf_hpc.observability.tracking import read_metrics
    from tests import tool_model

    model = build_causal_lm("tiny://qwen3_moe?vocab_size=64", torch.float32, seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.save_pretrained(tmp_path / "model")
    tool_model.write_rows(tmp_path / "train.parquet", tool_model.KEYS * 2, interaction="check")
    tool_model.write_rows(tmp_path / "val.parquet", tool_model.KEYS[:4], interaction="check")
    tool_model.write_interaction_config(tmp_path / "check.yaml")
    tool_model.write_tool_config(tmp_path / "tools.yaml")
    out = run_launch(
        "recipe=tiny_moe_klppo",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"data.train_files={tmp_path / 'train.parquet'}",
        f"data.val_files={tmp_path / 'val.parquet'}",
        "data.max_prompt_length=64",
        "data.max_response_length=160",
        "data.train_batch_size=8",
        f"actor_rollout_ref.model.path={tmp_path / 'model'}",
        "actor_rollout_ref.model.tokenizer_path=tiny://chars",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_user_turns=3",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=null",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tmp_path / 'tools.yaml'}",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={tmp_path / 'check.yaml'}",
        "trainer.total_training_steps=1",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.logger=[console]",
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    [m] = read_metrics(tmp_path / "run")
    assert m["num_turns/max"] >= 5 and m["interaction/turns"] > 0, m  # prompt, model, user, model, user...
    # measured 1.0 (a near-tie that fp32 rounds otherwise in the two passes would cost one pair in
    # ~1,800); the model tokens' rows one place off: 0.65
    assert m["rollout/router_topk_agreement"] > 0.99, m
    assert m["actor/grad_norm"] > 0

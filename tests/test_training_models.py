"""Training models in one process: packing, token-budget micro-batches, LR schedule, models."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_hpc.config.schema import ActorConfig, OptimConfig
from rlhf_hpc.models.hf import build_causal_lm, build_critic, model_config
from rlhf_hpc.ops.batching import make_padded_batch, micro_batch_groups, pack, restore_order, token_budget_micro_batches
from rlhf_hpc.ppo.actor import Actor, ActorSpec, per_token_logprobs
from rlhf_hpc.ppo.critic import per_token_values
from rlhf_hpc.ppo.optim import build_optimizer, clip_grad_norm, lr_multiplier


def skewed_batch(n=6, P=9, R=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(1, 256, (int(k),), generator=g).tolist() for k in torch.randint(1, P + 1, (n,), generator=g)
    ]
    resps = [torch.randint(1, 256, (int(k),), generator=g).tolist() for k in torch.randint(1, R + 1, (n,), generator=g)]
    b = make_padded_batch(prompts, resps, 0, P, R)
    b["advantages"] = torch.randn(n, R, generator=g) * b["response_mask"]
    return b


def grads_of(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def test_padded_layout():
    b = make_padded_batch([[5, 6], [7]], [[8], [9, 10, 11]], 0, 3, 3)
    assert b["input_ids"].tolist() == [[0, 5, 6, 8, 0, 0], [0, 0, 7, 9, 10, 11]]
    assert b["position_ids"].tolist() == [[0, 0, 1, 2, 2, 2], [0, 0, 0, 1, 2, 3]]
    assert b["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    with pytest.raises(ValueError, match="row 0: prompt 4 / response 1 tokens exceed 3 / 3"):
        make_padded_batch([[1, 2, 3, 4]], [[1]], 0, 3, 3)


def test_pack_restarts_positions_and_points_at_the_predicting_logits():
    b = make_padded_batch([[5, 6], [7]], [[8], [9, 10]], 0, 3, 2)
    p = pack(b)
    assert p.input_ids.tolist() == [[5, 6, 8, 7, 9, 10]]
    assert p.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert p.gather_index.tolist() == [[1, 0], [3, 4]]  # token 8 is predicted at packed position 1


def test_packed_equals_padded_logprobs_entropy_values_and_gradients():
    b = skewed_batch()
    actor = build_causal_lm("tiny://qwen2", torch.float32, seed=0)
    lp_pack, ent_pack = per_token_logprobs(actor, b, 0.7, remove_padding=True, with_entropy=True)
    (lp_pack.sum() + ent_pack.sum()).backward()
    g_pack = grads_of(actor)
    actor.zero_grad()
    lp_pad, ent_pad = per_token_logprobs(actor, b, 0.7, remove_padding=False, with_entropy=True)
    (lp_pad.sum() + ent_pad.sum()).backward()
    torch.testing.assert_close(lp_pack, lp_pad, atol=2e-6, rtol=0)
    torch.testing.assert_close(ent_pack, ent_pad, atol=2e-6, rtol=0)
    torch.testing.assert_close(g_pack, grads_of(actor), atol=2e-5, rtol=1e-4)
    critic = build_critic("tiny://qwen2", torch.float32, seed=1, init_from=actor)
    torch.testing.assert_close(per_token_values(critic, b, True), per_token_values(critic, b, False), atol=2e-6, rtol=0)


def test_token_budget_groups_respect_the_budget_and_balance():
    lens = [30, 3, 17, 9, 9, 25, 2, 11, 40, 5]
    groups = token_budget_micro_batches(lens, 50)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    loads = [sum(lens[i] for i in g) for g in groups]
    assert max(loads) <= 50
    assert len(groups) == math.ceil(sum(lens) / 50)  # as few as the total allows here
    assert max(loads) - min(loads) <= max(lens)
    assert token_budget_micro_batches([70, 10], 50) == [[0], [1]]  # a row over budget stands alone
    out = restore_order([torch.tensor([float(i) for i in g]) for g in groups], groups)
    assert out.tolist() == [float(i) for i in range(len(lens))]


def test_groups_are_padded_to_the_count_other_ranks_need():
    b = skewed_batch(n=4)
    groups = micro_batch_groups(b, 2, True, 10_000, sync_max=lambda k: 6)
    assert len(groups) == 6 and sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    assert sum(1 for g in groups if not g) == 2  # run as zero-weight dummies


def test_dynamic_micro_batches_give_the_same_update_as_fixed_ones():
    b = skewed_batch(n=8)
    results = []
    for dyn in (False, True):
        model = build_causal_lm("tiny://qwen2", torch.float32, seed=0)
        cfg = ActorConfig(
            ppo_micro_batch_size_per_gpu=2,
            use_dynamic_bsz=dyn,
            ppo_max_token_len_per_gpu=24,
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
        )
        actor = Actor(model, cfg, ActorSpec(remove_padding=True, optimizer=build_optimizer(model, cfg.optim)))
        lp, _ = actor.compute_log_prob(b, 2, dyn, 24)
        batch = dict(b, old_log_probs=lp - 0.1 * b["response_mask"])
        metrics = actor.update_policy(batch, mini_batch_rows=8)
        results.append((lp, grads_of(model), metrics))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-6, rtol=1e-5)
    assert results[0][2]["actor/pg_loss"] == pytest.approx(results[1][2]["actor/pg_loss"], abs=1e-6)


def test_a_smaller_last_micro_batch_gives_the_update_of_one_micro_batch():
    """6 rows as micro-batches of 4 + 2 (verl's split when the size does not divide) train as one of 6."""
    b = skewed_batch(n=6)
    results = []
    for micro in (6, 4):
        model = build_causal_lm("tiny://qwen2", torch.float32, seed=0)
        cfg = ActorConfig(
            ppo_micro_batch_size_per_gpu=micro,
            shuffle=False,
            loss_agg_mode="seq-mean-token-mean",
            clip_ratio_low=0.2,
            clip_ratio_high=0.2,
        )
        actor = Actor(model, cfg, ActorSpec(remove_padding=True, optimizer=build_optimizer(model, cfg.optim)))
        lp, _ = actor.compute_log_prob(b, 6)
        metrics = actor.update_policy(dict(b, old_log_probs=lp - 0.1 * b["response_mask"]), mini_batch_rows=6)
        results.append((grads_of(model), metrics["actor/pg_loss"]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-5)
    assert results[0][1] == pytest.approx(results[1][1], abs=1e-6)


def test_lr_schedule():
    # verl: the first update runs at LR 0 (step / warmup), the ratio applies when the count is <= 0
    const = OptimConfig(lr_warmup_steps=4)
    assert [lr_multiplier(s, const, 10) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    for count in (0, -1):
        ratio = OptimConfig(lr_warmup_steps=count, lr_warmup_steps_ratio=0.3)
        assert [lr_multiplier(s, ratio, 10) for s in range(4)] == pytest.approx([0.0, 1 / 3, 2 / 3, 1.0])
    assert lr_multiplier(0, OptimConfig(), 10) == 1.0  # no warm-up
    cos = OptimConfig(lr_warmup_steps_ratio=0.2, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(0, cos, 10) == 0.0 and lr_multiplier(1, cos, 10) == 0.5  # warm-up of 2 steps
    assert lr_multiplier(2, cos, 10) == pytest.approx(1.0)
    assert lr_multiplier(6, cos, 10) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert lr_multiplier(10, cos, 10) == pytest.approx(0.1)
    # verl's num_cycles: a full cycle comes back up; the value never goes below min_lr_ratio
    full = OptimConfig(lr_scheduler_type="cosine", num_cycles=1.0, min_lr_ratio=0.2)
    assert lr_multiplier(5, full, 10) == pytest.approx(0.2) and lr_multiplier(10, full, 10) == pytest.approx(1.0)
    # against verl's formula written out independently (get_cosine_schedule_with_warmup)
    for s in range(12):
        w, m, c = 2, 0.1, 0.5
        ref = s / w if s < w else max(m, math.cos(math.pi * c * 2 * (s - w) / (10 - w)) * (1 - m) / 2 + (1 + m) / 2)
        assert lr_multiplier(s, cos, 10) == pytest.approx(ref)


def test_clip_grad_norm_scales_only_above_the_limit():
    """Returns the norm before clipping; below the limit the gradients stay bit for bit (no pass over
    them), above it they are scaled to the limit, a non-finite norm leaves them alone."""
    model = torch.nn.Linear(4, 3)
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    before = [p.grad.clone() for p in model.parameters()]
    norm = math.sqrt(sum(float((b**2).sum()) for b in before))
    assert clip_grad_norm(model, norm * 2) == pytest.approx(norm, rel=1e-6)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    assert clip_grad_norm(model, norm / 2) == pytest.approx(norm, rel=1e-6)
    after = math.sqrt(sum(float((p.grad**2).sum()) for p in model.parameters()))
    assert after == pytest.approx(norm / 2, rel=1e-5)
    model.weight.grad[0, 0] = float("nan")
    kept = [p.grad.clone() for p in model.parameters()]
    assert math.isnan(clip_grad_norm(model, 1e-3))
    assert all(torch.allclose(p.grad, k, rtol=0, atol=0, equal_nan=True) for p, k in zip(model.parameters(), kept))


def test_tiny_model_config_from_the_path():
    c = model_config("tiny://qwen2?hidden_size=32&num_hidden_layers=3", override={"rms_norm_eps": 1e-5})
    assert (c.hidden_size, c.num_hidden_layers, c.rms_norm_eps, c.vocab_size) == (32, 3, 1e-5, 256)
    with pytest.raises(
        ValueError,
        match=r"unknown tiny model 'tiny://bert'; the built-in ones are tiny://qwen2, "
        r"tiny://qwen3, tiny://llama, tiny://mistral, tiny://gemma2, tiny://gemma3",
    ):
        model_config("tiny://bert")


def test_same_seed_same_weights_on_every_rank():
    a = build_causal_lm("tiny://qwen2", torch.float32, seed=7).state_dict()
    b = build_causal_lm("tiny://qwen2", torch.float32, seed=7).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    critic = build_critic(
        "tiny://qwen2", torch.float32, seed=7, init_from=build_causal_lm("tiny://qwen2", torch.float32, seed=7)
    )
    assert torch.equal(critic.model.embed_tokens.weight, a["model.embed_tokens.weight"])


@pytest.fixture
def world_of_one():
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_build_training_models_from_a_recipe(world_of_one):
    from torch.distributed.tensor import DTensor

    from rlhf_hpc.distributed.process_group import DistContext
    from rlhf_hpc.ppo.training_models import build_training_models
    from rlhf_hpc.recipe.load import load_config

    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    cfg, _ = load_config(
        "tiny_klppo",
        [
            "trainer.n_gpus_per_node=1",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
        ],
    )
    eng = build_training_models(cfg, ctx, total_steps=10)
    assert isinstance(next(eng.actor.model.parameters()), DTensor)
    assert eng.ref is not None and not any(p.requires_grad for p in eng.ref.model.parameters())
    assert eng.critic is not None and set(eng.checkpoint_components()) == {"actor", "critic"}
    lr = cfg.actor_rollout_ref.actor.optim.lr
    assert eng.actor.optimizer.param_groups[0]["lr"] == 0.0  # warm-up step 0 of 2: verl's first update is at LR 0
    eng.actor.scheduler.step()
    assert eng.actor.optimizer.param_groups[0]["lr"] == pytest.approx(lr * 0.5)
    # the critic starts from the actor's backbone
    a = eng.actor.model.model.embed_tokens.weight.full_tensor()
    c = eng.critic.model.model.embed_tokens.weight.full_tensor()
    assert torch.equal(a, c)
    cfg2, _ = load_config(
        "tiny_klppo", ["trainer.n_gpus_per_node=1", "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false"]
    )
    eng2 = build_training_models(cfg2, ctx, total_steps=10)
    assert eng2.critic is None and eng2.ref is None


@pytest.mark.parametrize("tied,checkpointing", [(False, False), (False, True), (True, False)])
def test_host_replica_computes_as_fsdp2_mixed_precision(world_of_one, tied, checkpointing):
    """A model replicated on the host runs without FSDP2, its modules casting their parameters to
    bf16 when called (``compute_in_dtype``). It computes what FSDP2's bf16 mixed precision computes,
    bit for bit: the same log-probs and entropies, and the same fp32 gradients accumulated over two
    micro-batches (packed, then padded), with activation checkpointing too. Its parameters stay the
    fp32 ``nn.Parameter``s they were. A tied embedding/head is the one difference: FSDP2 sums the
    two uses' gradients in bf16 before its fp32 copy, here each is cast first and they are summed in
    fp32, so the two agree to bf16's rounding of that sum."""
    from torch.distributed.device_mesh import init_device_mesh

    from rlhf_hpc.config.schema import FSDPConfig
    from rlhf_hpc.distributed.fsdp import compute_in_dtype, parallelize

    path = "tiny://qwen2" + ("?tie_word_embeddings=true" if tied else "")
    fsdp2 = build_causal_lm(path, torch.float32, seed=0)
    plain = build_causal_lm(path, torch.float32, seed=0)
    params = dict(plain.named_parameters())
    parallelize(
        fsdp2, init_device_mesh("cpu", (1,)), FSDPConfig(), torch.device("cpu"), gradient_checkpointing=checkpointing
    )  # default mixed precision: bf16 compute, fp32 reduce
    if checkpointing:
        plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    compute_in_dtype(plain, torch.bfloat16)
    outputs = {}
    for name, model in (("fsdp2", fsdp2), ("plain", plain)):
        model.train()  # checkpointing recomputes only in training mode
        outputs[name] = []
        for seed, remove_padding in ((0, True), (1, False)):  # two micro-batches, accumulated
            b = skewed_batch(seed=seed)
            lp, ent = per_token_logprobs(model, b, 0.7, remove_padding=remove_padding, with_entropy=True)
            ((lp * b["advantages"]).sum() + 0.01 * ent.sum()).backward()
            outputs[name] += [lp.detach(), ent.detach()]
    for a, b in zip(outputs["fsdp2"], outputs["plain"]):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for n, p in fsdp2.named_parameters():
        expected = p.grad.full_tensor()
        assert grads[n].dtype == torch.float32
        atol = expected.abs().max().item() * 2**-8 if tied and n == "model.embed_tokens.weight" else 0
        torch.testing.assert_close(grads[n], expected, rtol=0, atol=atol, msg=n)
    assert dict(plain.named_parameters()) == params  # the same Parameter objects, not the bf16 casts
    assert all(p.dtype == torch.float32 and isinstance(p, torch.nn.Parameter) for p in params.values())


@pytest.mark.parametrize("fsdp_size", [1, -1], ids=["replicated", "sharded"])
def test_a_frozen_reference_kept_in_bf16_computes_what_its_fp32_copy_computes_in_bf16(world_of_one, fsdp_size):
    """The reference's default storage is its compute dtype (verl keeps frozen models in bf16): the
    same log-probs, bit for bit, as an fp32 copy computing in bf16 (FSDP2's param_dtype, or the
    replica's casts), from half the memory; an explicit model_dtype is kept."""
    from rlhf_hpc.distributed.process_group import DistContext
    from rlhf_hpc.ppo.training_models import build_training_models
    from rlhf_hpc.recipe.load import load_config

    ctx = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    ref = "actor_rollout_ref.ref.fsdp_config."
    base = [
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.use_kl_loss=true",
        f"{ref}fsdp_size={fsdp_size}",
        f"{ref}mixed_precision.param_dtype=bfloat16",
        "actor_rollout_ref.model.path=tiny://qwen2?tie_word_embeddings=true",
    ]
    refs, sizes = {}, {}
    for name, extra in (("default", []), ("fp32", [f"{ref}model_dtype=float32"])):
        cfg, _ = load_config("tiny_klppo", base + extra)
        assert cfg.actor_rollout_ref.ref.fsdp_config.model_dtype == ("bfloat16" if name == "default" else "float32")
        refs[name] = build_training_models(cfg, ctx, total_steps=10).ref.model
        sizes[name] = sum(p.numel() * p.element_size() for p in refs[name].parameters())
    b = skewed_batch(seed=3)
    with torch.no_grad():
        want, got = (per_token_logprobs(refs[n], b, 0.7, remove_padding=True)[0] for n in ("fp32", "default"))
    assert torch.equal(got, want)
    assert sizes["default"] * 2 == sizes["fp32"]


def test_a_section_keeps_the_default_its_parent_gives_when_one_key_is_set():
    """The critic's optimizer defaults to lr 1e-5 (verl's), the reference's FSDP config to its compute
    dtype: setting another key of the section keeps them (it used to fall back to the class's defaults,
    lr 1e-6 and float32)."""
    from rlhf_hpc.recipe.load import load_config

    base = [
        "data.train_files=synthetic://x",
        "data.val_files=null",
        "actor_rollout_ref.model.path=tiny://qwen2",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
    ]
    cfg, _ = load_config(
        None,
        base + ["critic.optim.lr_warmup_steps=3", "actor_rollout_ref.ref.fsdp_config.param_offload=true"],
        check_files=False,
    )
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.optim.lr_warmup_steps == 3
    assert cfg.actor_rollout_ref.ref.fsdp_config.model_dtype == "bfloat16"  # verl's param_dtype default
    assert cfg.actor_rollout_ref.actor.fsdp_config.model_dtype == "float32"  # a trained model's master copy
    lora, _ = load_config(
        None,
        base + ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.use_kl_loss=true"],
        check_files=False,
    )
    assert lora.actor_rollout_ref.ref.fsdp_config.model_dtype == "float32"  # the reference is the actor, adapter off

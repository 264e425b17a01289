"""Rollout pieces in one process: buckets, names, engine choice, the mismatch metric."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rollout.base import Sampling, logprob_mismatch
from rlhf_hpc.rollout.factory import make_engine
from rlhf_hpc.rollout.weight_sync import _buckets, hf_name, stream_full_params


def test_buckets_respect_the_size_and_give_a_big_tensor_its_own():
    params = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("big", torch.zeros(100)), ("c", torch.zeros(5))]
    groups = [[n for n, _ in b] for b in _buckets(params, torch.float32, bucket_bytes=80)]
    assert groups == [["a", "b"], ["big"], ["c"]]
    groups = [[n for n, _ in b] for b in _buckets(params, torch.bfloat16, bucket_bytes=10_000)]
    assert groups == [["a", "b", "big", "c"]]


def test_plain_module_streams_its_own_tensors_cast():
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    out = dict(stream_full_params(m, torch.bfloat16, bucket_mb=1e-5))
    assert list(out) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert torch.equal(out["0.weight"], m[0].weight.detach().to(torch.bfloat16))


def test_wrapper_prefixes_are_removed():
    assert (
        hf_name("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    )
    assert hf_name("_orig_mod.lm_head.weight") == "lm_head.weight"


def test_logprob_mismatch_only_counts_valid_tokens():
    e = torch.tensor([[-1.0, -2.0, 5.0]])
    a = torch.tensor([[-1.5, -2.0, 0.0]])
    m = torch.tensor([[1, 1, 0]])
    assert logprob_mismatch(e, a, m) == {
        "rollout/logprob_diff_max": 0.5,
        "rollout/logprob_diff_mean": 0.25,
        "rollout/engine_actor_kl": 0.25,
        "rollout/engine_actor_k3_kl": pytest.approx((math.exp(-0.5) - 0.5) / 2),
    }
    # rounding noise cancels in the signed mean (the KL estimate), not in the absolute one
    noisy = logprob_mismatch(
        torch.tensor([[-1.01, -2.0, -0.99]]), torch.tensor([[-1.0, -2.01, -1.0]]), torch.ones(1, 3)
    )
    assert noisy["rollout/logprob_diff_mean"] == pytest.approx(0.01) and noisy[
        "rollout/engine_actor_kl"
    ] == pytest.approx(0.01 / 3)


def test_a_broken_engine_trips_the_check_even_where_k1_comes_out_negative():
    from rlhf_hpc.rollout.base import LogprobCheck

    # few tokens, the engine far from the actor both ways: k1's signs cancel below zero, k3 cannot
    engine = torch.tensor([[-3.0, -0.5, -4.0, -0.2]])
    actor = torch.tensor([[-1.0, -2.0, -1.5, -1.0]])
    m = logprob_mismatch(engine, actor, torch.ones(1, 4))
    assert m["rollout/engine_actor_kl"] < 0 < 1.0 < m["rollout/engine_actor_k3_kl"], m
    check = LogprobCheck("bfloat16", "bfloat16")
    assert check(m, 1).startswith(f"step 1: rollout/engine_actor_k3_kl = {m['rollout/engine_actor_k3_kl']:.3g} ")
    # healthy bf16 noise (|diff| ~1e-2 both ways) stays far below the limit in k3 too
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(64, 32, generator=g) * 4
    noise = logprob_mismatch(lp + 1e-2 * torch.randn(64, 32, generator=g), lp, torch.ones(64, 32))
    assert noise["rollout/engine_actor_k3_kl"] < 1e-4 and check(noise, 2) is None


def test_greedy_sampling():
    assert Sampling(temperature=0.0).greedy and Sampling(do_sample=False).greedy and not Sampling().greedy


def test_asking_for_vllm_without_it_names_the_key_and_the_alternative(monkeypatch, capsys):
    cfg, _ = load_config("tiny_klppo", ["actor_rollout_ref.rollout.name=vllm"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(
        RuntimeError,
        match=r"actor_rollout_ref.rollout.name=vllm but its package \(vllm\) is not "
        r"installed here: bash env/setup.sh .*, or set "
        r"actor_rollout_ref.rollout.name to one of hf",
    ):
        make_engine(cfg, "tiny://qwen2", torch.device("cpu"))
    cfg.actor_rollout_ref.rollout.name = "auto"  # the demo recipe's choice: falls back to hf, and says so
    assert make_engine(cfg, "tiny://qwen2", torch.device("cpu")).name == "hf"
    assert "rollout.name=auto: using the hf engine" in capsys.readouterr().out


def test_hf_engine_refuses_to_generate_with_random_weights():
    cfg, _ = load_config("tiny_klppo", ["actor_rollout_ref.rollout.name=hf"])
    engine = make_engine(cfg, "tiny://qwen2", torch.device("cpu"))
    with pytest.raises(RuntimeError, match="before the first update_weights"):
        engine.generate([[1, 2]], Sampling(max_tokens=2))
    with pytest.raises(
        ValueError,
        match=r"weight sync: 26 engine parameter\(s\) received nothing: "
        r"'model.layers.0.self_attn.q_proj.weight', .*, \.\.\. "
        r"\(they would keep their previous values\)",
    ):
        engine.update_weights(iter([("model.embed_tokens.weight", torch.zeros(256, 128))]))
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' arrived twice"):
        engine.update_weights(iter([("model.embed_tokens.weight", torch.zeros(256, 128))] * 2))


def metrics(kl: float, max_: float = 1.0) -> dict:
    return {"rollout/engine_actor_kl": kl, "rollout/logprob_diff_mean": abs(kl) * 3, "rollout/logprob_diff_max": max_}


def test_logprob_check_limit_follows_the_coarser_precision():
    from rlhf_hpc.rollout.base import LogprobCheck

    assert LogprobCheck("float32", "float32").limit == 1e-3
    assert LogprobCheck("bfloat16", "float32").limit == LogprobCheck("float32", "bfloat16").limit == 0.05
    # bf16 noise (KL estimates ~1e-3 even where per-token |diff| is ~1e-2, single large maxima)
    # never trips it; fp32 health (~1e-7) neither
    bf16 = LogprobCheck("bfloat16", "bfloat16")
    assert all(bf16(metrics(0.005, max_=3.0), s) is None for s in range(100))
    assert LogprobCheck("float32", "float32")(metrics(2e-7, 1e-5), 1) is None


def test_logprob_check_warns_then_stops_after_consecutive_steps():
    from rlhf_hpc.rollout.base import LogprobCheck

    check = LogprobCheck("float32", "float32")
    # the broken TP=2 run measured mean 0.03-0.08 per step
    warning = check(metrics(0.05, 0.7), 3)
    assert warning.startswith(
        "step 3: rollout/engine_actor_kl = 0.05 (|diff| mean 0.15, max 0.7) exceeds 0.001, "
        "the limit for a float32 run (1/2 steps in a row)"
    )
    assert check(metrics(1e-6), 4) is None  # one bad step followed by a good one resets
    assert check(metrics(float("nan")), 4) is None  # a diverged actor is the stability guard's case
    check(metrics(0.05), 5)
    with pytest.raises(RuntimeError, match=r"^stopping: step 6: .* \(2/2 steps in a row\): the rollout engine"):
        check(metrics(0.04), 6)


def test_generation_rng_is_per_dp_rank_and_leaves_the_training_rng_alone():
    """torch, Python and numpy (vLLM's V2 model runner draws request seeds from numpy): the ranks of
    one tensor-parallel group draw alike, whatever their training states; training's are untouched."""
    import random

    import numpy as np

    from rlhf_hpc.rollout.rng import GenerationRNG

    cpu = torch.device("cpu")
    torch.manual_seed(5)
    np.random.seed(5)
    expected, expected_np = torch.rand(3), np.random.random(3)
    torch.manual_seed(5)
    np.random.seed(5)
    a, a2, b = GenerationRNG(1, 0, cpu), GenerationRNG(1, 0, cpu), GenerationRNG(1, 1, cpu)
    assert torch.equal(torch.rand(3), expected) and (np.random.random(3) == expected_np).all()  # made aside
    draws = {}
    for name, rng in (("a", a), ("a2", a2), ("b", b)):
        torch.manual_seed(100 + len(name))  # training states differ between "ranks"
        np.random.seed(100 + len(name))
        with rng.active():
            draws[name] = (torch.rand(3), random.random(), np.random.randint(0, 2**31, 4).tolist())
    assert torch.equal(draws["a"][0], draws["a2"][0]) and draws["a"][1:] == draws["a2"][1:]  # same dp rank
    assert not torch.equal(draws["a"][0], draws["b"][0]) and draws["a"][2] != draws["b"][2]
    with a.active():  # the stream continues where it stopped
        again, again_np = torch.rand(3), np.random.randint(0, 2**31, 4).tolist()
    assert not torch.equal(again, draws["a"][0]) and again_np != draws["a"][2]
    torch.manual_seed(5)
    np.random.seed(5)
    with a2.active():
        torch.rand(10)
        np.random.random(10)
    # generation did not move the training streams
    assert torch.equal(torch.rand(3), expected) and (np.random.random(3) == expected_np).all()


def test_a_seeded_generation_reseeds_every_stream_it_draws_from():
    """The engine's seeded call (a resumed step replays its rollouts) re-seeds numpy too: vLLM's GPU
    model runner draws each request's seed from it, so torch alone would not replay there."""
    import random

    import numpy as np

    from rlhf_hpc.rollout.rng import GenerationRNG, seed_all

    rng = GenerationRNG(1, 0, torch.device("cpu"))
    draws = []
    for burn in (0, 7):  # the streams at different places before the seeded call
        with rng.active():
            np.random.random(burn)
            torch.rand(burn)
            seed_all(1234)
            draws.append((np.random.randint(0, 2**31, 4).tolist(), torch.rand(2).tolist(), random.random()))
    assert draws[0] == draws[1]
    with rng.active():
        seed_all(1235)
        assert np.random.randint(0, 2**31, 4).tolist() != draws[0][0]


def test_step_seed_depends_on_the_dp_rank_only():
    from rlhf_hpc.ppo.step_batch import step_seed

    assert step_seed(1, 2, 0) == step_seed(1, 2, 0) != step_seed(1, 2, 1)
    assert step_seed(1, 2, 0) != step_seed(1, 3, 0)


def test_h100_variants_have_their_own_peaks():
    from rlhf_hpc.observability.perf import peak_flops_of

    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12  # SXM
    assert peak_flops_of("NVIDIA H100 NVL") == 835e12
    assert peak_flops_of("NVIDIA H200") == 989e12 and peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12


def test_host_shards_get_a_cpu_backend_beside_nccl():
    from rlhf_hpc.distributed.process_group import process_group_backend

    cfg, _ = load_config("qwen7b_klppo", check_files=False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert process_group_backend(cuda, cfg) == "cpu:gloo,cuda:nccl"  # the reference model is offloaded
    cfg.actor_rollout_ref.ref.fsdp_config.param_offload = False
    assert process_group_backend(cuda, cfg) == "nccl"
    cfg.actor_rollout_ref.actor.fsdp_config.param_offload = True  # CPU DTensor gradients: gloo for the norm
    assert process_group_backend(cuda, cfg) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(cpu, cfg) == "gloo"


@pytest.mark.slow
def test_vllm_version_check_accepts_the_installed_build():
    from tests.conftest import require

    require("vLLM", importlib.util.find_spec("vllm") is not None, "install the cpu profile (env/setup.sh cpu)")
    from rlhf_hpc.rollout.vllm_engine import VLLM_BELOW, VLLM_MIN, check_vllm_version

    check_vllm_version()  # 0.32 (CPU build) has reload_weights(weights_iterator=...)
    assert (VLLM_MIN, VLLM_BELOW) == ("0.26", "0.34")


def test_vllms_harmless_reload_warnings_are_dropped_for_every_rotary_class(monkeypatch, caplog):
    """vLLM names the rotary module's class in its per-reload warning (RotaryEmbedding,
    Llama3RotaryEmbedding for Llama 3.x, ...): each is dropped, any other warning kept."""
    import logging

    from rlhf_hpc.rollout.vllm_engine import quiet_vllm_logging

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    quiet_vllm_logging()
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for cls in ("RotaryEmbedding", "Llama3RotaryEmbedding", "YaRNScalingRotaryEmbedding"):
            logger.warning("%s: Failed to load weights", cls)
        logger.warning("Qwen2MLP: Failed to load weights")
    assert [r.getMessage() for r in caplog.records] == ["Qwen2MLP: Failed to load weights"]

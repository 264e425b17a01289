"""LoRA (verl's ``lora_rank``, ``lora_alpha``, ``target_modules``, ...; PEFT adapters) on the actor
and the critic.

- One process: an adapter at its start is the identity; with it switched off the model is the base
  model; the merged weights the engines receive compute what the adapted model computes (tied and
  untied heads); only the adapter trains; the critic's value head trains in full.
- Two gloo ranks (tests/dist_lora_checks.py): sharded and replicated actors with LoRA against one
  process, the reference (adapter off) against a separate base model, the merged stream.
- End to end on the demo: KL-PPO with LoRA actor and critic through vLLM and hf (the engine agrees
  with the actor through the merged sync), a stopped-and-resumed run equal to an uninterrupted one,
  GRPO with LoRA, and the HF export (merged model + adapter) loaded back by transformers and PEFT.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from rlhf_hpc.config.schema import CriticModelConfig, ModelConfig, OptimConfig
from rlhf_hpc.models.hf import build_causal_lm, build_critic
from rlhf_hpc.models.lora import AdapterDisabled, apply_lora, lora_enabled, merged_state_dict
from rlhf_hpc.observability.tracking import read_metrics
from rlhf_hpc.ops.batching import make_padded_batch
from rlhf_hpc.ppo.actor import per_token_logprobs
from rlhf_hpc.ppo.optim import build_optimizer
from rlhf_hpc.recipe.load import load_config, load_resolved
from tests.conftest import REPO, engine_available, run_launch

LORA = ModelConfig(path="tiny://qwen2", lora_rank=4, lora_alpha=8)
NONDETERMINISTIC = ("timing_s/", "perf/", "memory_gb/", "_runtime", "_timestamp")


def rows(seed: int = 0, n: int = 6, vocab: int = 200):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in torch.randint(2, 7, (n,), generator=g)]
    resps = [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in torch.randint(1, 6, (n,), generator=g)]
    return make_padded_batch(prompts, resps, 0, 6, 5)


def logprobs(model, batch):
    with torch.no_grad():
        return per_token_logprobs(model, batch)[0]


@pytest.mark.parametrize("path", ["tiny://qwen2", "tiny://qwen2?tie_word_embeddings=true", "tiny://llama"])
def test_adapter_starts_as_identity_and_off_is_the_base_model(path):
    batch = rows()
    base = build_causal_lm(path, torch.float32, seed=0)
    peft = apply_lora(build_causal_lm(path, torch.float32, seed=0), dataclasses.replace(LORA, path=path), seed=3)
    assert torch.equal(logprobs(peft, batch), logprobs(base, batch))  # B = 0 at the start
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    adapted = logprobs(peft, batch)
    assert (adapted - logprobs(base, batch)).abs().max() > 1e-3
    assert torch.equal(logprobs(AdapterDisabled(peft), batch), logprobs(base, batch))
    assert torch.equal(logprobs(peft, batch), adapted)  # the adapter is on again after the reference's pass
    # the merged weights, as the engines get them, compute the adapted model
    plain = build_causal_lm(path, torch.float32, seed=0)
    merged = merged_state_dict(peft)
    missing, unexpected = plain.load_state_dict(merged, strict=False)
    assert unexpected == [] and missing == [], (missing, unexpected)
    torch.testing.assert_close(logprobs(plain, batch), adapted, rtol=0, atol=2e-5)


def test_only_the_adapter_trains_and_the_value_head_in_full():
    peft = apply_lora(build_causal_lm("tiny://qwen2", torch.float32, seed=0), LORA, seed=3)
    trainable = [n for n, p in peft.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert targets == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # all-linear
    opt = build_optimizer(peft, OptimConfig())
    assert sum(len(g["params"]) for g in opt.param_groups) == len(trainable)
    # target_modules / exclude_modules as verl passes them
    only_q = apply_lora(
        build_causal_lm("tiny://qwen2", torch.float32, seed=0),
        dataclasses.replace(LORA, target_modules=["q_proj", "v_proj"], exclude_modules=r".*\.layers\.0\..*"),
        seed=3,
    )
    names = [n for n, p in only_q.named_parameters() if p.requires_grad]
    assert names and all(("q_proj" in n or "v_proj" in n) and ".layers.0." not in n for n in names)
    critic = build_critic("tiny://qwen2", torch.float32, seed=1)
    critic.model = apply_lora(critic.model, CriticModelConfig(lora_rank=4), seed=2, task_type=None)
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= trainable
    assert all(n.startswith("value_head.") or ".lora_" in n for n in trainable)


def test_keys_are_verls_and_rank_zero_is_no_lora():
    cfg, _ = load_config("tiny_klppo", [])
    assert not lora_enabled(cfg.actor_rollout_ref.model) and not lora_enabled(cfg.critic.model)
    m = cfg.actor_rollout_ref.model
    assert (m.lora_rank, m.lora_alpha, m.target_modules, m.exclude_modules, m.lora_adapter_path) == (
        0,
        16,
        "all-linear",
        None,
        None,
    )
    cfg, _ = load_config(
        "tiny_klppo",
        [
            "actor_rollout_ref.model.lora_rank=16",
            "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
            "critic.model.lora_rank=8",
        ],
    )
    assert lora_enabled(cfg.actor_rollout_ref.model) and cfg.actor_rollout_ref.model.target_modules == [
        "q_proj",
        "v_proj",
    ]
    assert lora_enabled(cfg.critic.model)


# ------------------------------------------------------------------------------------ 2 ranks
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(REPO / "tests" / "dist_lora_checks.py"),
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "lora.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sharded_untied", "replicated_tied", "sharded_tied_llama"])
def test_two_ranks_with_lora_match_one_process(two_ranks, name):
    r = two_ranks[name]
    assert r["trainable"] == ["lora_A", "lora_B"] and r["optimizer_tensors"] == r["adapter_tensors"] == 28
    assert r["logprob_max_diff"] < 1e-5
    assert r["metric_rel_diff"][0] < 1e-5  # the first update: the same weights, float32 reduction order only
    assert max(r["metric_rel_diff"]) < 2e-2
    assert r["adapter_moved"] > 0.1 and r["adapter_max_diff"] < 0.1 * r["lr"]
    assert r["base_moved"] == 0.0
    # the reference (adapter off, no second model) is the base model, not the trained actor
    assert r["reference_vs_base_model"] < 1e-5 and r["reference_vs_trained_actor"] > 0.1
    assert r["merged_names_are_base_names"] and r["merged_vs_single"] < 0.1 * r["lr"]


# --------------------------------------------------------------------------------- end to end
LORA_KEYS = (
    "actor_rollout_ref.model.lora_rank=8",
    "actor_rollout_ref.model.lora_alpha=16",
    "actor_rollout_ref.actor.optim.lr=1e-2",
    "critic.model.lora_rank=4",
)


@pytest.mark.slow
def test_the_vllm_engine_reads_the_adapter_once_per_sync(tmp_path):
    """vLLM re-applies a request's adapter at every decode step, and reads it from disk again when
    the request says load_inplace: the engine registers each synced adapter once (add_lora) and
    generates with a request that never reloads it. Two syncs x two generations of 24 decode steps:
    one load per sync, and the greedy tokens are the merged model's (the newest adapter serves)."""
    engine_available("vllm")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=1",
            str(REPO / "tests" / "dist_lora_engine_checks.py"),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads((tmp_path / "lora_engine.json").read_text())
    assert res["loads_per_sync"] == [1, 1], res
    assert all(all(m) for m in res["greedy_matches"]), res


def _run(run, steps, *extra, engine="vllm"):
    out = run_launch(
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={run}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=3",
        "trainer.test_freq=-1",
        f"actor_rollout_ref.rollout.name={engine}",
        *LORA_KEYS,
        *extra,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    engine_available("vllm")
    base = tmp_path_factory.mktemp("lora-runs")
    _run(base / "whole", 5)
    # the uninterrupted run's step-3 checkpoint, resumed into a run directory of its own
    resumed = _run(base / "parts", 5, f"trainer.resume_mode={base / 'whole' / 'global_step_3'}")
    grpo = (
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "algorithm.use_kl_in_reward=false",
        "critic.model.lora_rank=0",
    )
    _run(base / "grpo", 3, *grpo)
    _run(base / "grpo_hf", 3, *grpo, engine="hf")
    return base, resumed


@pytest.mark.slow
def test_lora_klppo_runs_and_the_engines_agree_with_the_actor(runs):
    base, _ = runs
    for name in ("whole", "grpo", "grpo_hf"):
        metrics = read_metrics(base / name)
        for r in metrics:
            # the engine holds W + s B A: its log-probs of its own samples are the actor's (fp32)
            assert r["rollout/logprob_diff_max"] < 1e-4 and abs(r["rollout/engine_actor_kl"]) < 1e-5, (name, r)
        assert metrics[-1]["actor/ppo_kl"] != 0 and metrics[-1]["actor/grad_norm"] > 0
    # vLLM serves the adapter: the base weights go in once, then the adapter alone; hf gets merged weights
    # (the actor's, whichever the algorithm: GRPO's run here)
    whole, hf = read_metrics(base / "whole"), read_metrics(base / "grpo_hf")
    full = hf[0]["rollout/weight_sync_mib"]
    assert [r["rollout/weight_sync_mib"] for r in hf] == [full] * len(hf)
    adapter = whole[1]["rollout/weight_sync_mib"]
    assert 0 < adapter < 0.2 * full and all(r["rollout/weight_sync_mib"] == adapter for r in whole[1:])
    assert whole[0]["rollout/weight_sync_mib"] == pytest.approx(full + adapter)  # step 1: the base, then the adapter
    # the reference is the base model: KL to it grows from 0 as the adapter learns
    assert whole[0]["actor/reward_kl_penalty"] == 0 and whole[-1]["actor/reward_kl_penalty"] > 0
    for name in ("grpo", "grpo_hf"):
        grpo = read_metrics(base / name)
        assert "timing_s/values" not in grpo[-1] and grpo[-1]["actor/kl_loss"] > 0


@pytest.mark.slow
def test_a_resumed_lora_run_matches_an_uninterrupted_one(runs):
    base, resumed = runs
    assert f"resumed from {base / 'whole'}/global_step_3 (step 3)" in resumed.stdout
    a = {r["training/global_step"]: r for r in read_metrics(base / "whole")}
    b = {r["training/global_step"]: r for r in read_metrics(base / "parts")}
    # (the resumed run's new engine takes the base weights again at its first sync: more bytes, same
    # weights; its own directory's log rows count from 1)
    assert b[4]["rollout/weight_sync_mib"] > a[4]["rollout/weight_sync_mib"] == b[5]["rollout/weight_sync_mib"]
    assert [b[4]["training/log_step"], b[5]["training/log_step"]] == [1, 2]
    skip = NONDETERMINISTIC + ("rollout/weight_sync_mib", "training/log_step")
    for step in (4, 5):
        det = {k: v for k, v in a[step].items() if not k.startswith(skip)}
        got = {k: v for k, v in b[step].items() if not k.startswith(skip)}
        assert got == det, {k: (det[k], got.get(k)) for k in det if det[k] != got.get(k)}


@pytest.mark.slow
def test_export_writes_the_merged_model_and_the_adapter(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, _ = runs
    out = tmp_path / "export"
    proc = run_launch(
        "export", str(base / "whole" / "global_step_3"), "--out", str(out), "--dtype", "float32", timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "lora_adapter" / "adapter_config.json").is_file()
    assert (out / "lora_adapter" / "adapter_model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    cfg = load_resolved(base / "whole" / "config.yaml", check_files=False)  # (the run's seed builds its base)
    plain = build_causal_lm(cfg.actor_rollout_ref.model.path, torch.float32, seed=cfg.trainer.seed)
    adapted = PeftModel.from_pretrained(plain, out / "lora_adapter")
    batch = rows(vocab=plain.config.vocab_size)
    torch.testing.assert_close(logprobs(merged, batch), logprobs(adapted, batch), rtol=0, atol=2e-5)
    assert (
        logprobs(merged, batch)
        - logprobs(build_causal_lm(cfg.actor_rollout_ref.model.path, torch.float32, seed=cfg.trainer.seed), batch)
    ).abs().max() > 1e-4


# --------------------------------------------------------------------------- plan and checks
def plan_of(recipe: str, *overrides: str):
    from rlhf_hpc.planning.memory_plan import build_plan

    cfg, _ = load_config(recipe, list(overrides), check_files=False)
    plan = build_plan(cfg)
    return {p.name: p for p in plan.phases}, plan


def test_the_memory_plan_counts_the_adapters_state_and_no_reference_copy():
    from rlhf_hpc.planning.sizing import GiB, adapter_params

    full, _ = plan_of("qwen7b_klppo")
    lora, _ = plan_of(
        "qwen7b_klppo",
        "actor_rollout_ref.model.lora_rank=64",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.ref.fsdp_config.param_offload=false",
    )
    n = adapter_params("Qwen/Qwen2.5-7B-Instruct", ModelConfig(lora_rank=64))
    assert 1.5e8 < n < 1.7e8  # r (in + out) over q, k, v, o, gate, up, down of 28 layers: 161.5M
    upd = lora["update_actor"].parts
    assert upd["grads"] == pytest.approx(n * 4 / 8) and upd["optimizer"] == pytest.approx(n * 8 / 8)
    assert upd["params"] == full["update_actor"].parts["params"]  # the frozen base is still held (sharded)
    assert "ref params" in full["old_log_prob"].parts and "ref params" not in lora["old_log_prob"].parts
    assert lora["update_actor"].total < full["update_actor"].total - 10 * GiB


def test_the_lora_recipe_fits_two_40gb_gpus_or_one_80gb_gpu_where_full_training_does_not():
    from rlhf_hpc.planning.memory_plan import check_plan

    one_gpu = ["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.3"]
    for recipe, overrides, fits in (
        ("qwen7b_lora_klppo", [], True),
        ("qwen7b_lora_klppo", one_gpu + ["hardware.hbm_gb=80"], True),
        ("qwen7b_lora_klppo", one_gpu + ["hardware.hbm_gb=40"], False),
        (
            "qwen7b_klppo",
            [
                "trainer.n_gpus_per_node=2",
                "hardware.hbm_gb=40",
                "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
            ],
            False,
        ),
    ):
        cfg, _ = load_config(recipe, overrides + ["launcher.cluster=slurm", "launcher.mem_gb=480"], check_files=False)
        _, errors, _ = check_plan(cfg)
        assert (not errors) == fits, (recipe, overrides, errors)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["actor_rollout_ref.model.lora_rank=-1"], "the rank must be >= 0"),
        (["actor_rollout_ref.model.lora_rank=1024"], "the vllm engine serves adapters up to rank 512"),
        (["actor_rollout_ref.model.lora_adapter_path=/no/such/adapter"], "no adapter_config.json there"),
        (["critic.model.lora_rank=8", "algorithm.adv_estimator=grpo"], "critic.model.lora_rank=8 has no effect"),
        (
            ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.ref.fsdp_config.model_dtype=bfloat16"],
            "ref.fsdp_config.model_dtype=bfloat16 has no effect with LoRA",
        ),
    ],
)
def test_lora_keys_that_cannot_work_are_refused(overrides, message):
    from rlhf_hpc.config.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config("tiny_klppo", overrides + ["actor_rollout_ref.rollout.name=vllm"])
    assert any(message in line for line in e.value.errors), e.value.errors


def test_the_memory_plan_names_the_key_peft_refuses():
    """PEFT's NoMatchingPeftModuleError from the plan's adapter count, for a config the checks did
    not see (the plan runs on any Config): a ConfigError naming the key, not a traceback."""
    import dataclasses as dc

    from rlhf_hpc.config.errors import ConfigError
    from rlhf_hpc.planning.memory_plan import check_plan

    cfg, _ = load_config("tiny_klppo", ["actor_rollout_ref.model.lora_rank=8"], check_files=False)
    arr = cfg.actor_rollout_ref
    bad = dc.replace(cfg, actor_rollout_ref=dc.replace(arr, model=dc.replace(arr.model, target_modules="no_such_.*")))
    with pytest.raises(ConfigError) as e:
        check_plan(bad)
    assert e.value.errors[0].startswith(
        "actor_rollout_ref.model.target_modules=no_such_.*: Target modules no_such_.* not found in the base model"
    )


def test_verls_lora_script_lines_run_with_one_warning_at_most():
    """verl's LoRA scripts set ref.fsdp_config.param_offload=True (ignored by verl too: a warning),
    rollout.load_format=safetensors and rollout.layered_summon=True (the weight sync here does what
    they ask for: accepted)."""
    _, warnings = load_config(
        "tiny_klppo",
        [
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.ref.fsdp_config.param_offload=true",
            "actor_rollout_ref.rollout.load_format=safetensors",
            "actor_rollout_ref.rollout.layered_summon=true",
        ],
    )
    assert [w for w in warnings if "LoRA" in w] == [
        "actor_rollout_ref.ref.fsdp_config.param_offload=True has no effect with LoRA (as in verl): the reference is "
        "the actor with its adapter off, on the actor's mesh and precision (actor_rollout_ref.actor.fsdp_config)"
    ]


def test_bf16_compute_on_host_replicas_reaches_the_adapter():
    """A model replicated on the host computes in bf16 by casting each module's parameters when it
    is called (distributed.fsdp.compute_in_dtype); PEFT casts x to lora_A's fp32 dtype before that
    call, so the module casts its inputs too (as FSDP2 does). Gradients reach the fp32 adapter."""
    from rlhf_hpc.distributed.fsdp import compute_in_dtype

    batch = rows()
    model = apply_lora(build_causal_lm("tiny://qwen2", torch.float32, seed=0), LORA, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    fp32 = logprobs(model, batch)
    compute_in_dtype(model, torch.bfloat16)
    lp, _ = per_token_logprobs(model, batch)
    mask = batch["response_mask"].bool()
    assert (lp - fp32)[mask].abs().max() < 0.1 and (lp - fp32)[mask].abs().max() > 0  # bf16, not fp32
    lp[mask].sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)


def test_a_checkpoint_from_before_the_lora_keys_still_resumes():
    """Its config.yaml has no lora_* keys: absent and at the default now is the same run; a LoRA run
    cannot continue it."""
    from rlhf_hpc.config.tree import dump_yaml, to_dict
    from rlhf_hpc.ppo.checkpoint import incompatible_keys

    cfg, _ = load_config("tiny_klppo", [], check_files=False)
    saved = to_dict(cfg)
    for section in (saved["actor_rollout_ref"]["model"], saved["critic"]["model"]):
        for k in [k for k in section if k.startswith("lora_") or k.endswith("_modules")]:
            del section[k]
    assert incompatible_keys(dump_yaml(saved), cfg) == []
    lora, _ = load_config("tiny_klppo", ["actor_rollout_ref.model.lora_rank=8"], check_files=False)
    assert incompatible_keys(dump_yaml(saved), lora) == ["actor_rollout_ref.model.lora_rank: (absent) -> 8"]
    # a checkpoint of a run without LoRA: its rank 0 is shown as 0 (was {}, as any falsy value)
    assert incompatible_keys(dump_yaml(to_dict(cfg)), lora) == ["actor_rollout_ref.model.lora_rank: 0 -> 8"]

"""One source for each figure the plans and the runtime share (issue #36): the step shape, the
hardware table (also the MFU metric's peak), the FLOP count, the keys that shrink a phase, the
engine's memory model, and the deprecated keys that point to the ones that stay."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from rlhf_hpc.config.engines import ENGINES, EngineSpec
from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.observability.perf import model_flops, peak_flops_of
from rlhf_hpc.ops.batching import fixed_micro_batches, per_rank_mini_batch
from rlhf_hpc.ops.step_shape import step_shape
from rlhf_hpc.planning.hardware import DEVICE_NAMES, PRESETS, Hardware, preset_for_device, register_hardware
from rlhf_hpc.planning.memory_plan import MEMORY_KEYS, build_plan, oom_message, update_keys
from rlhf_hpc.planning.sizing import forward_flops, matmul_shape
from rlhf_hpc.recipe.load import load_config

# observability.perf's PEAK_FLOPS before the hardware table took its place: dense bf16 FLOP/s by a
# substring of the device name
FORMER_PEAK_FLOPS = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "A40": 150e12,
    "A6000": 155e12,
    "V100": 125e12,
    "MI300X": 1307e12,
    "MI250": 362e12,
}


def test_the_hardware_table_covers_every_gpu_the_mfu_table_had():
    for key, flops in FORMER_PEAK_FLOPS.items():
        assert key in DEVICE_NAMES, key
        assert peak_flops_of(f"NVIDIA {key}") == flops, key
    for name, hw in PRESETS.items():
        assert hw.source and hw.bf16_tflops > hw.fp32_tflops > 0 and hw.hbm_gb > 0, name
        assert name in DEVICE_NAMES.values(), name  # every preset is found by its device name
    # the names torch.cuda.get_device_name reports: the longest match wins, whatever the order
    for device, preset in (
        ("NVIDIA H100 80GB HBM3", "h100_sxm"),
        ("NVIDIA H100 PCIe", "h100_pcie"),
        ("NVIDIA H100 NVL", "h100_nvl"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-80GB", "a100_80gb_sxm"),
        ("NVIDIA A100 80GB PCIe", "a100_80gb_pcie"),
        ("NVIDIA A100-SXM4-40GB", "a100_40gb_sxm"),
        ("NVIDIA A100-PCIE-40GB", "a100_40gb_pcie"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA A40", "a40"),
        ("NVIDIA RTX A6000", "rtx_a6000"),
        ("Tesla V100-SXM2-32GB", "v100"),
        ("AMD Instinct MI300X", "mi300x"),
        ("AMD Instinct MI250X", "mi250"),
    ):
        assert preset_for_device(device) == preset, device
    assert preset_for_device("NVIDIA GeForce GTX 1080") is None
    assert peak_flops_of("NVIDIA GeForce GTX 1080") == PRESETS["h100_sxm"].bf16_tflops * 1e12  # the default


def test_a_gpu_type_is_registered_once():
    saved = dict(PRESETS), dict(DEVICE_NAMES)
    try:
        register_b200()
    finally:  # the registry as it was
        PRESETS.clear()
        PRESETS.update(saved[0])
        DEVICE_NAMES.clear()
        DEVICE_NAMES.update(saved[1])


def register_b200():
    hw = Hardware("B200 180GB", 2250, 80, 8000, 180, 900, 400, 64, source="test")
    register_hardware("b200", hw, ("B200",))
    assert preset_for_device("NVIDIA B200") == "b200" and peak_flops_of("NVIDIA B200") == 2250e12
    with pytest.raises(ValueError, match="already registered"):
        register_hardware("b200", hw, ("B200 X",))
    with pytest.raises(ValueError, match="B200 already stand for another preset"):
        register_hardware("b200_2", hw, ("B200",))


def test_one_flop_count_for_the_mfu_metric_and_the_time_plan():
    config = Qwen2Config(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    h, q, kv, inter, layers, vocab = 64, 64, 32, 160, 3, 100
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * inter
    # by hand: the layers' matmuls per token, causal attention per sequence, the head on 10 tokens
    by_hand = 2 * layers * per_layer * 80 + 2 * layers * q * (30**2 + 50**2) + 2 * h * vocab * 10
    assert model_flops(config, [30, 50], 10) == by_hand
    s = matmul_shape(config)
    assert s.layer_params == per_layer
    # the time plan's form (sequences of one length) is the same count
    assert forward_flops(s, 4 * 40, 40, 10, vocab) == model_flops(config, [40] * 4, 10)


def test_deprecated_keys_are_copied_with_a_warning_and_refused_when_they_disagree():
    cfg, warnings = load_config(
        "tiny_klppo", ["trainer.gpu_memory_gb=40", "trainer.peak_tflops=300"], check_files=False
    )
    assert cfg.hardware.hbm_gb == 40 and cfg.hardware.bf16_tflops == 300
    assert "trainer.gpu_memory_gb is deprecated: set hardware.hbm_gb instead (its value was copied there)" in warnings
    assert any(w.startswith("trainer.peak_tflops is deprecated: set hardware.bf16_tflops") for w in warnings)
    cfg, warnings = load_config("tiny_klppo", ["trainer.gpu_memory_gb=40", "hardware.hbm_gb=40"], check_files=False)
    assert cfg.hardware.hbm_gb == 40 and any("trainer.gpu_memory_gb is deprecated" in w for w in warnings)
    cfg, warnings = load_config("tiny_klppo", ["hardware.hbm_gb=40"], check_files=False)
    assert not any("deprecated" in w for w in warnings)
    with pytest.raises(ConfigError, match="trainer.gpu_memory_gb=40.0 and hardware.hbm_gb=48.0 are one figure"):
        load_config("tiny_klppo", ["trainer.gpu_memory_gb=40", "hardware.hbm_gb=48"], check_files=False)
    cfg, _ = load_config("qwen7b_klppo", ["trainer.gpu_memory_gb=40"], check_files=False)
    plan = build_plan(cfg)
    assert plan.capacity == 40 * 2**30 and plan.capacity_source == "hardware.hbm_gb"


def test_a_gpu_rank_plans_with_its_own_gpus_memory_where_the_config_names_none():
    """On a 40 GB A100 the ranks' plan (preflight's sleep check, the trainer's measured-vs-plan line)
    is of 40 GiB, not the 80 GiB a plan made away from the GPUs assumes; a size the config gives wins."""
    from rlhf_hpc.planning.memory_plan import check_plan

    cfg, _ = load_config("qwen7b_klppo", [], check_files=False)
    away = build_plan(cfg)
    assert away.capacity == 80 * 2**30 and "GPU memory assumed 80 GiB" in away.render()
    on_a100_40 = check_plan(cfg, device_gb=39.4)[0]
    assert on_a100_40.capacity == 39.4 * 2**30 and on_a100_40.capacity_source == "this GPU's memory"
    assert "GPU memory assumed" not in on_a100_40.render()
    given, _ = load_config("qwen7b_klppo", ["hardware.hbm_gb=141"], check_files=False)
    assert build_plan(given, device_gb=39.4).capacity == 141 * 2**30
    from rlhf_hpc.distributed.process_group import device_memory_gb

    assert device_memory_gb(torch.device("cpu")) is None


@pytest.mark.parametrize(
    "recipe,overrides",
    [
        ("tiny_klppo", []),
        ("qwen7b_klppo", []),
        (
            "qwen7b_klppo",
            [
                "actor_rollout_ref.actor.ppo_mini_batch_size=96",
                "actor_rollout_ref.actor.use_dynamic_bsz=false",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            ],
        ),
    ],
)
def test_the_step_shape_is_what_the_runtime_computes(recipe, overrides):
    cfg, _ = load_config(recipe, overrides, check_files=False)
    shape, arr, world = step_shape(cfg), cfg.actor_rollout_ref, cfg.world_size
    assert shape.rows == cfg.data.train_batch_size * arr.rollout.n
    assert shape.rows_per_rank == shape.rows // world
    for phase, section in (("update_actor", arr.actor), ("update_critic", cfg.critic)):
        p = shape.phase(phase)
        # the trainer cuts each rank's rows into mini-batches of per_rank_mini_batch rows ...
        assert p.mini_rows == per_rank_mini_batch(section.ppo_mini_batch_size, arr.rollout.n, world)
        assert p.micro_rows == section.ppo_micro_batch_size_per_gpu and p.dynamic == section.use_dynamic_bsz
        if not p.dynamic:  # ... and those into fixed micro-batches (rlhf_hpc.ops.batching)
            assert p.micro_batches(p.mini_rows, p.mini_rows * shape.seq_len) == len(
                fixed_micro_batches(p.mini_rows, p.micro_rows)
            )
    # the memory plan's micro-batches are the step shape's
    plan = build_plan(cfg)
    for phase in plan.phases[1:]:
        tokens, _ = shape.phase(phase.name).micro_tokens(shape.rows_per_rank, shape.prompt_len, shape.response_len)
        assert phase.note.startswith(f"micro-batch {tokens} tokens"), phase.name


def test_the_keys_that_shrink_an_update_are_one_list():
    assert MEMORY_KEYS["update_actor"] == update_keys("actor")
    assert "actor_rollout_ref.model.enable_gradient_checkpointing" in oom_message("update_actor", 1.0, "cuda:0")
    cfg, _ = load_config("qwen7b_klppo", ["actor_rollout_ref.actor.fsdp_config.param_offload=true"], check_files=False)
    keys = {p.name: p.shrink for p in build_plan(cfg).phases}["update_actor"]
    assert keys[0] == "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"  # a token budget: its key
    assert "actor_rollout_ref.actor.fsdp_config.param_offload" not in keys  # already on
    assert set(keys) < set(update_keys("actor", fully_sharded=False)) | {keys[0]}


def test_the_engine_table_says_how_an_engine_is_planned(monkeypatch):
    monkeypatch.setitem(ENGINES, "plain", EngineSpec("plain", "x:Y", package=None, paged=False))
    gens = {}
    for name in ("vllm", "hf", "plain"):
        cfg, _ = load_config("qwen7b_klppo", [f"actor_rollout_ref.rollout.name={name}"], check_files=False)
        gens[name] = {p.name: p for p in build_plan(cfg).phases}["gen"].parts
    assert "vLLM (gpu_memory_utilization)" in gens["vllm"] and "hf engine weights" not in gens["vllm"]
    assert gens["plain"] == gens["hf"] and "hf engine weights" in gens["hf"]

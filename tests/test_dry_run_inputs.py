"""Issue #40 (4.): what the dry run can know of a run's inputs, it checks, each refusal with exit 2
and the key, no traceback: the CPU calibration file (schema-checked, written atomically), the
``plan.*`` lengths, the data files (exist, a file, parquet, rows, at least one batch). Real files in
tmp_path; the CLI runs in this process (``rlhf_hpc.cli.main``)."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_hpc.cli import main as launch
from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import DataConfig
from rlhf_hpc.data.dataset import DataError, StatefulSampler, load_examples
from rlhf_hpc.data.prepare import main as prepare
from rlhf_hpc.models.tokenizer import build_tiny_tokenizer
from rlhf_hpc.planning.hardware import UNCALIBRATED_CPU, read_calibration, write_calibration
from rlhf_hpc.planning.time_plan import workload_of
from rlhf_hpc.recipe.input_checks import parquet_rows
from rlhf_hpc.recipe.load import load_config

GOOD = {
    "fp32_tflops": 0.05,
    "bf16_tflops": 0.02,
    "hbm_gb_s": 12.5,
    "sync_tensor_overhead_s": 0.0,
    "backward_ratio": 0.0,
    "prefill_fp32_tflops": None,
    "overlap_comm": False,
    "measured": {"ranks": 2, "threads_per_rank": 1, "date": "2026-01-02"},
}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """The default calibration file lives in tmp_path/cache (none until a test writes it)."""
    monkeypatch.setenv("RLHF_HPC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tmp_path / "cache" / "calibration" / "cpu.json"


def dry_run(capsys, *overrides: str) -> tuple[int, str]:
    """(exit code, stderr) of ``launch.py recipe=tiny_klppo OVERRIDES --dry-run``."""
    rc = launch(["recipe=tiny_klppo", *overrides, "--dry-run"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def rows(n: int) -> list[dict]:
    return [
        {
            "data_source": "synthetic/copy",
            "prompt": [{"role": "user", "content": f"copy: {i}"}],
            "reward_model": {"style": "rule", "ground_truth": str(i)},
        }
        for i in range(n)
    ]


def parquet(path, n: int) -> str:
    table = pa.Table.from_pylist(rows(max(n, 1)))
    pq.write_table(table.slice(0, n), path)
    return str(path)


# ------------------------------------------------------------------------ the calibration file
@pytest.mark.parametrize(
    "text,says",
    [
        ('{"fp32_tflops": 0.05', "is not a JSON file (JSONDecodeError"),
        ("[0.05, 12.5]", "holds an array, not an object of named figures"),
        ('{"fp32_tflops": 0}', "'fp32_tflops' is 0 (a number); a rate the plan divides by must be a number > 0"),
        ('{"hbm_gb_s": "fast"}', "'hbm_gb_s' is \"fast\" (a string); a rate the plan divides by must be a number > 0"),
        ('{"layer_overhead_s": -1e-3}', "'layer_overhead_s' is -0.001 (a number); expected a number >= 0"),
        ('{"fp32_tflops": true}', "'fp32_tflops' is true (a boolean)"),
        ('{"fp32_tflops": NaN}', "'fp32_tflops' is NaN (a number)"),
        ('{"hbm_gbs": 12.5}', "unknown figure 'hbm_gbs' (did you mean 'hbm_gb_s'?)"),
        ('{"measured": "today"}', "'measured' is \"today\" (a string); expected an object"),
    ],
)
def test_a_bad_default_calibration_file_is_refused_at_the_dry_run(capsys, own_cache, text, says):
    own_cache.parent.mkdir(parents=True)
    own_cache.write_text(text)
    rc, err = dry_run(capsys)
    assert rc == 2
    (line,) = [ln for ln in err.splitlines() if "hardware.calibration" in ln]
    assert f"hardware.calibration (null: the default file): {own_cache}" in line and says in line
    assert f"write it again with python launch.py calibrate --out {own_cache}, or delete it" in line


def test_a_bad_named_calibration_file_is_refused_naming_the_key(capsys, tmp_path):
    named = tmp_path / "mine.json"
    named.write_text('{"fp32_tflops": 0.05, "cast_gb_s": 0}')
    rc, err = dry_run(capsys, f"hardware.calibration={named}")
    assert rc == 2
    assert (
        f"hardware.calibration: {named}: 'cast_gb_s' is 0 (a number); a rate the plan divides by must be a "
        f"number > 0; write it again with python launch.py calibrate --out {named}\n"
    ) in err
    rc, err = dry_run(capsys, f"hardware.calibration={tmp_path}")
    assert rc == 2 and f"hardware.calibration: no file {tmp_path} (a directory)" in err


def test_a_good_calibration_file_is_read_with_zero_overheads_and_null_rates(capsys, own_cache):
    write_calibration(own_cache, GOOD)
    hw = read_calibration()
    assert (hw.fp32_tflops, hw.hbm_gb_s, hw.backward_ratio, hw.sync_tensor_overhead_s) == (0.05, 12.5, 0.0, 0.0)
    assert hw.prefill_fp32_tflops is None and hw.overlap_comm is False
    assert hw.layer_overhead_s == UNCALIBRATED_CPU.layer_overhead_s  # not in the file: the nominal figure
    assert "2026-01-02 calibration" in hw.name and str(own_cache) in hw.source
    assert launch(["recipe=tiny_klppo", "--dry-run"]) == 0
    assert (
        f"# time plan per step on 2 x CPU rank (2026-01-02 calibration) (measured by launch.py calibrate: "
        f"{own_cache})" in capsys.readouterr().out
    )


def test_the_writer_refuses_what_the_reader_would_refuse_and_leaves_the_file(own_cache):
    write_calibration(own_cache, GOOD)
    before = own_cache.read_bytes()
    with pytest.raises(ConfigError, match=r"calibration figures for .*cpu.json: 'hbm_gb_s' is 0 \(a number\)"):
        write_calibration(own_cache, {**GOOD, "hbm_gb_s": 0})
    assert own_cache.read_bytes() == before


def test_the_calibration_write_is_atomic(own_cache):
    """A reader holding the file open through a rewrite reads the whole old file (the new one is a
    new file renamed over it, not the old one rewritten in place); a write that fails half-way
    (a value json cannot encode, met after the figures were written out) leaves the old file
    whole and no temporary file behind."""
    write_calibration(own_cache, GOOD)
    old_text = own_cache.read_text()
    with open(own_cache) as reader:
        write_calibration(own_cache, {**GOOD, "fp32_tflops": 0.09})
        assert reader.read() == old_text  # the old file, whole
    assert json.loads(own_cache.read_text())["fp32_tflops"] == 0.09
    new_text = own_cache.read_text()
    with pytest.raises(TypeError, match="not JSON serializable"):
        write_calibration(own_cache, {**GOOD, "measured": {"date": "2026-01-03", "cores": {1, 2}}})
    assert own_cache.read_text() == new_text and read_calibration().fp32_tflops == 0.09
    assert os.listdir(own_cache.parent) == ["cpu.json"]  # the half-written temporary file is gone


def test_a_local_cpu_run_without_the_file_calibrates_first_and_the_dry_run_says_so(capsys, own_cache, tmp_path):
    """Which launches measure the machine before their first run (rlhf_hpc.launch.first_calibration):
    a local CPU run planning with the default file when that file is missing; not with the key off,
    a GPU preset, a named file, a Slurm job (planned away from its nodes) or once the file is there.
    (The calibration itself, on the real model's run: tests/test_real_model.py.)"""
    from rlhf_hpc.launch.first_calibration import needs_first_calibration

    def needs(*overrides: str) -> bool:
        return needs_first_calibration(load_config("tiny_klppo", list(overrides), check_files=False)[0])

    assert needs() and needs("trainer.device=cpu")
    assert not needs("hardware.first_run_calibration=false")
    assert not needs("hardware.preset=h100_sxm") and not needs("trainer.device=cuda")
    write_calibration(tmp_path / "mine.json", GOOD)
    assert not needs(f"hardware.calibration={tmp_path / 'mine.json'}")
    assert not needs("launcher.cluster=slurm")
    assert launch(["recipe=tiny_klppo", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        f"# no calibration file for this CPU ({own_cache}): the plans below use nominal figures; the run "
        f"measures this machine first (about a minute, once)"
    ) in out
    assert "# time plan per step on 2 x CPU (uncalibrated)" in out
    assert launch(["recipe=tiny_klppo", "hardware.first_run_calibration=false", "--dry-run"]) == 0
    assert "# no calibration file" not in capsys.readouterr().out
    write_calibration(own_cache, GOOD)
    assert not needs()
    assert launch(["recipe=tiny_klppo", "--dry-run"]) == 0
    assert "# no calibration file" not in capsys.readouterr().out


# ------------------------------------------------------------------------------------ plan keys
@pytest.mark.parametrize(
    "override,says",
    [
        (
            "plan.response_length=-1",
            "plan.response_length=-1: the data's mean response length in tokens must be > 0; "
            "to plan with the maximum (data.max_response_length=8) leave plan.response_length "
            "unset (null)",
        ),
        ("plan.response_length=0", "plan.response_length=0: the data's mean response length in tokens must be > 0"),
        ("plan.prompt_length=0", "plan.prompt_length=0: the data's mean prompt length in tokens must be > 0"),
        (
            "plan.response_length=9",
            "plan.response_length=9 is larger than data.max_response_length=8: a mean cannot "
            "pass the maximum; set plan.response_length <= 8 (or null: plan with the maximum), "
            "or raise data.max_response_length",
        ),
        ("plan.prompt_length=33", "plan.prompt_length=33 is larger than data.max_prompt_length=32"),
    ],
)
def test_bad_plan_lengths_are_refused_at_the_dry_run(capsys, override, says):
    rc, err = dry_run(capsys, override)
    assert rc == 2 and says in err


def test_plan_lengths_null_means_the_maxima_and_a_mean_is_planned_as_given():
    cfg, _ = load_config("tiny_klppo", [], check_files=False)
    w = workload_of(cfg)
    assert (w.prompt, w.response) == (32, 8) and w.source.startswith("the maxima")
    cfg, _ = load_config("tiny_klppo", ["plan.prompt_length=32", "plan.response_length=3"], check_files=False)
    w = workload_of(cfg)
    assert (w.prompt, w.response) == (32, 3) and w.source == "means from plan.prompt_length and plan.response_length"


# ------------------------------------------------------------------------------------ data files
def test_a_directory_as_a_data_file_says_so_and_which_file(capsys, tmp_path):
    data = tmp_path / "gsm8k"
    data.mkdir()
    rc, err = dry_run(capsys, f"data.train_files={data}")
    assert (
        rc == 2
        and (
            f"data.train_files: '{data}' is a directory; a data file is one parquet file in verl's "
            f"format (python -m rlhf_hpc.data.prepare writes them as <dir>/train.parquet"
        )
        in err
    )
    parquet(data / "train.parquet", 16)
    rc, err = dry_run(capsys, f"data.train_files={data}")
    assert (
        rc == 2
        and (
            f"data.train_files: '{data}' is a directory; a data file is one parquet file in verl's "
            f"format (it holds train.parquet: name one, or list them (data.train_files=["
            f"{data / 'train.parquet'}, ...]))"
        )
        in err
    )
    with pytest.raises(DataError, match=f"{data}: a directory, not a parquet file: name the file in it"):
        load_examples(str(data), build_tiny_tokenizer(), DataConfig())  # what the ranks say


def test_empty_and_unreadable_data_files_are_refused_naming_the_key(capsys, tmp_path):
    empty, zero, text = parquet(tmp_path / "empty.parquet", 0), tmp_path / "zero.parquet", tmp_path / "d.jsonl"
    zero.write_bytes(b"")
    text.write_text(json.dumps(rows(1)[0]) + "\n")
    rc, err = dry_run(capsys, f"data.train_files={empty}")
    assert rc == 2 and f"data.train_files: '{empty}' has no rows (python -m rlhf_hpc.data.prepare writes them)" in err
    assert "fewer than data.train_batch_size" not in err  # one message for one problem
    rc, err = dry_run(capsys, f"data.val_files=[{parquet(tmp_path / 'v.parquet', 2)},{zero},{text}]")
    assert rc == 2
    assert f"data.val_files[1]: '{zero}' is empty (0 bytes); expected a parquet file with rows" in err
    assert f"data.val_files[2]: '{text}' is not a readable parquet file (ArrowInvalid: " in err
    assert "data.val_files[0]" not in err  # 2 rows: a validation set needs no batch


def test_fewer_rows_than_one_batch_are_refused_at_the_dry_run(capsys, tmp_path):
    a, b = parquet(tmp_path / "a.parquet", 10), parquet(tmp_path / "b.parquet", 5)
    rc, err = dry_run(capsys, f"data.train_files=[{a},{b}]")
    assert (
        rc == 2
        and (
            "data.train_files: 15 rows in all, fewer than data.train_batch_size=16 prompts a step "
            "takes, so not one batch (rows counted in the files, before the data.max_prompt_length "
            "filter, which can only lower the count; the ranks count again after it); lower "
            "data.train_batch_size or add rows"
        )
        in err
    )
    c = parquet(tmp_path / "c.parquet", 1)
    rc, _ = dry_run(capsys, f"data.train_files=[{a},{b},{c}]")
    assert rc == 0  # 16 rows: one batch
    dapo = [
        "algorithm.adv_estimator=grpo",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        "data.gen_batch_size=24",
        "algorithm.use_kl_in_reward=false",
    ]
    rc, err = dry_run(capsys, f"data.train_files=[{a},{b},{c}]", *dapo)
    assert rc == 2 and "data.train_files: 16 rows in all, fewer than data.gen_batch_size=24 prompts" in err
    assert parquet_rows(a) == 10  # from the footer


def test_the_ranks_say_empty_or_filtered_and_count_after_the_filter(tmp_path):
    tok = build_tiny_tokenizer()
    with pytest.raises(DataError, match=r"empty.parquet: no rows \(an empty data file\)"):
        load_examples(parquet(tmp_path / "empty.parquet", 0), tok, DataConfig())
    with pytest.raises(DataError, match=r"all 3 rows filtered out as longer than data.max_prompt_length=4 tokens"):
        load_examples(
            parquet(tmp_path / "three.parquet", 3), tok, DataConfig(max_prompt_length=4, filter_overlong_prompts=True)
        )
    with pytest.raises(DataError, match=r"\(3 prompts, counted after the data.max_prompt_length filter\)"):
        StatefulSampler(3, 4, seed=0)


def test_prepare_refuses_an_empty_split_and_a_bad_record(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    with pytest.raises(SystemExit, match=r"train.jsonl: missing \(expected GSM8K's original train.jsonl\)"):
        prepare(["gsm8k", "--src", str(src), "--out", str(out)])
    (src / "train.jsonl").write_text('{"question": "1+1?", "answer": "2 #### 2"}\n{"question": \n')
    with pytest.raises(SystemExit, match=r"train.jsonl, line 2: not a JSON record"):
        prepare(["gsm8k", "--src", str(src), "--out", str(out)])
    (src / "train.jsonl").write_text("\n")
    with pytest.raises(SystemExit, match="the train split has no records; nothing written"):
        prepare(["gsm8k", "--src", str(src), "--out", str(out)])
    assert not out.exists()


# ------------------------------------------------------------------ bf16 on a CPU without native bf16
ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma bmi2\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
NEOVERSE_V1 = "Features\t: fp asimd sve bf16 i8mm\n"


def test_native_bf16_is_read_from_the_cpu_flags():
    from rlhf_hpc.planning.hardware import cpu_has_native_bf16

    assert cpu_has_native_bf16(ZEN3) is False
    assert cpu_has_native_bf16(SAPPHIRE_RAPIDS) is True
    assert cpu_has_native_bf16(NEOVERSE_V1) is True
    assert cpu_has_native_bf16("model name\t: something\n") is None  # no flags line: unknown, nothing said


def test_the_bf16_keys_are_the_models_the_run_has():
    from rlhf_hpc.planning.hardware import cpu_bf16_keys
    from rlhf_hpc.recipe.load import load_config

    mp = "fsdp_config.mixed_precision.param_dtype"
    grpo, _ = load_config("smollm2_add_grpo", [], check_files=False)
    assert cpu_bf16_keys(grpo) == [
        f"actor_rollout_ref.actor.{mp}",
        "actor_rollout_ref.rollout.dtype",
        f"actor_rollout_ref.ref.{mp}",
    ]
    lora, _ = load_config("smollm2_add_grpo", ["actor_rollout_ref.model.lora_rank=8"], check_files=False)
    assert f"actor_rollout_ref.ref.{mp}" not in cpu_bf16_keys(lora)  # the reference is the actor, adapter off
    klppo, _ = load_config("qwen7b_klppo", ["trainer.device=cpu"], check_files=False)
    assert f"critic.model.{mp}" in cpu_bf16_keys(klppo)
    tiny, _ = load_config("tiny_klppo", [], check_files=False)
    assert cpu_bf16_keys(tiny) == []  # fp32 throughout


def test_the_dry_run_says_bf16_is_slow_here_exactly_without_native_bf16(capsys, tmp_path):
    """The warning names every bf16 key and the float32 overrides; with them applied nothing is said;
    a GPU run is never warned about the login node's CPU."""
    from rlhf_hpc.planning.hardware import cpu_bf16_keys, cpu_dtype_warnings, cpu_has_native_bf16
    from rlhf_hpc.recipe.load import load_config

    cfg, _ = load_config("smollm2_add_grpo", [], check_files=False)
    (w,) = cpu_dtype_warnings(cfg, native_bf16=False)
    fix = " ".join(f"{k}=float32" for k in cpu_bf16_keys(cfg))
    assert w.startswith("this CPU has no native bf16") and w.endswith(f"to run in float32 add: {fix}")
    assert cpu_dtype_warnings(cfg, native_bf16=True) == []
    fixed, _ = load_config("smollm2_add_grpo", fix.split(), check_files=False)
    assert cpu_dtype_warnings(fixed, native_bf16=False) == []
    gpu, _ = load_config("qwen7b_klppo", [], check_files=False)
    assert gpu.trainer.device != "cpu" and cpu_dtype_warnings(gpu, native_bf16=False) == []
    # the dry run itself, on this machine
    assert launch(["recipe=smollm2_add_grpo", f"trainer.default_local_dir={tmp_path}/run", "--dry-run"]) == 0
    said = "this CPU has no native bf16" in capsys.readouterr().err
    assert said is (cpu_has_native_bf16() is False)


def test_a_context_longer_than_the_models_positions_is_refused_for_vllm_and_warned_for_hf(capsys):
    # tiny://qwen2 is built for 1024 positions (default RoPE): vLLM would refuse 1020 + 8 at its start
    rc, err = dry_run(capsys, "data.max_prompt_length=1020", "actor_rollout_ref.rollout.name=vllm")
    assert (
        rc == 2
        and (
            "data.max_prompt_length + data.max_response_length = 1020 + 8 is longer than the 1024 "
            "positions of actor_rollout_ref.model.path=tiny://qwen2"
        )
        in err
        and "the vllm engine refuses" in err
    ), err
    rc, err = dry_run(capsys, "data.max_prompt_length=1020")  # (the recipe's auto: vLLM where installed)
    assert rc == 2 and "the vllm engine refuses a longer context" in err, err
    rc, err = dry_run(capsys, "data.max_prompt_length=1020", "actor_rollout_ref.rollout.name=hf")  # (runs them)
    assert rc == 0 and "the model would run positions it was not trained on" in err, err
    rc, err = dry_run(capsys, "data.max_prompt_length=1016", "actor_rollout_ref.rollout.name=vllm")
    assert rc == 0, err

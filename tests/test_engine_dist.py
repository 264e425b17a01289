"""FSDP2 engine under torchrun on CPU (gloo): sharded == single-process, checkpoints reshard.

One 4-rank torchrun (meshes 2x2, 1x4 and 4x1 (replicated: shared memory and gloo), actor and critic,
the shared-memory all-reduce, save, a save that dies half-way, retention) and one 2-rank torchrun
(load the 4-rank checkpoint on a 1x2 mesh, export to HF; replicated <-> sharded checkpoints).
Tolerances (fp32): log-probs/values 1e-5, metrics 1e-5 relative (absolute below 1), gradients 1e-5,
parameters after 3 steps of AdamW at lr 1e-3 (a movement of ~6e-3) 1e-4; measured: ~5e-7, ~4e-7,
~1e-7 and ~5e-6.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tests" / "dist_engine_checks.py"


def torchrun(nproc: int, phase: str, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(SCRIPT),
            phase,
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / f"{phase}.json").read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine")
    return torchrun(4, "train", out), torchrun(2, "reload", out)


@pytest.mark.parametrize("name", ["actor_2x2", "actor_1x4", "actor_4x1", "actor_4x1_gloo", "actor_2x2_dynamic_bsz"])
def test_sharded_actor_matches_single_process(results, name):
    r = results[0][name]
    assert r["logprob_max_diff"] < 1e-5
    for key, diff in r["metric_max_diff"].items():
        assert diff < 1e-5, (key, diff)
    assert r["grad_max_diff"] < 1e-5
    assert r["param_max_diff"] < 1e-4
    assert r["param_moved"] > 1e-3  # the comparison is about weights that really changed
    assert r["pg_clipfrac_max"] > 0  # clipping was exercised
    # a replicated mesh on the host: gradients averaged by ReplicaGradients (through shared memory, all
    # ranks being on this machine; or by asynchronous gloo all-reduces), not FSDP2's HSDP all-reduce;
    # the same numbers either way
    assert r["gradient_reduction"] == {
        "actor_4x1": "host replicas, shared memory",
        "actor_4x1_gloo": "host replicas, gloo",
    }.get(name, "fsdp2")


def test_shared_memory_mean_equals_gloo_all_reduce(results):
    """Averaging through /dev/shm in 1 MiB buckets (tensors spanning buckets, three calls in a row)
    equals gloo's all-reduce / 4: fp32 to its rounding (another summation order), bf16 to ~2 ulps."""
    r = results[0]["shared_memory_mean"]
    assert r["why"].startswith("shared memory (8 x 1 MiB in /dev/shm)"), r["why"]
    assert r["max_diff"]["float32"] < 1e-6
    assert r["max_diff"]["bfloat16"] < 0.04
    assert r["files_left"] == []  # unlinked once every rank mapped it


def test_shared_memory_mean_refuses_what_it_cannot_do(results):
    """Ranks on two hosts, or no /dev/shm: declined on every rank, with why (ReplicaGradients keeps
    gloo). Ranks bringing different sizes: an error on every rank, and the next call is right."""
    r = results[0]["shared_memory_mean"]
    assert r["two_hosts"] == "the 4 ranks run on 2 hosts"
    assert r["no_shm_dir"] == "/nonexistent-shm does not exist"
    assert "ranks brought different numbers of elements (between 10 and 13)" in r["unequal_sizes"]
    assert r["after_error"]


def test_host_replicas_only_where_every_rank_holds_the_model_and_reduces_in_its_dtype(results):
    """On a (replicate, 1) host mesh the model is kept whole without FSDP2 and ReplicaGradients
    averages it, with bf16 compute too (gradients reduced in fp32, as reduce_dtype says); a bf16
    reduce_dtype, offload, an explicit reshard_after_forward or forward_prefetch (FSDP2 features), or
    a real shard group stay with FSDP2."""
    assert results[0]["host_replicas"] == {
        "4x1": True,
        "4x1_bf16_compute": True,
        "4x1_bf16_reduce": False,
        "4x1_offload": False,
        "4x1_reshard_after_forward": False,
        "4x1_forward_prefetch": False,
        "2x2": False,
    }


def test_sharded_critic_matches_single_process(results):
    r = results[0]["critic_2x2"]
    assert r["value_max_diff"] < 1e-5
    for key, diff in r["metric_max_diff"].items():
        assert diff < 1e-5, (key, diff)
    assert r["grad_max_diff"] < 1e-5 and r["param_max_diff"] < 1e-4
    assert r["vf_clipfrac_max"] > 0


def test_crash_during_save_keeps_the_previous_checkpoint(results):
    r = results[0]["crash_during_save"]
    assert r["crashed"] and r["latest"].endswith("global_step_3") and r["complete"] == [3]
    assert r["tmp_left"]  # the half-written one never got a global_step_N name
    assert results[1]["loaded_step"] == "global_step_3"


def test_checkpoints_load_across_replicated_and_sharded_layouts(results):
    """A checkpoint of a replicated actor (host replicas: each rank's FSDP2 mesh is the rank alone)
    loads bit-exact into a sharded one, and a sharded one into a replicated one."""
    assert results[1]["across_layouts"] == {
        "2x2_into_2x1": ["host replicas, shared memory", True, True],
        "4x1_into_1x2": ["fsdp2", True, True],
    }


def test_retention_keeps_the_newest(results):
    assert results[0]["retention"] == [2, 3]


def test_checkpoint_from_4_ranks_loads_bit_exact_on_2(results):
    r = results[1]
    assert r["params_bit_exact"] and r["optim_bit_exact"] and r["n_optim_tensors"] > 20
    assert r["extra"] == {"global_step": 3, "kl_ctrl": {"value": 0.01}}


def test_export_round_trip(results):
    r = results[1]
    assert {"config.json", "model.safetensors"} <= set(r["export_files"])
    assert r["export_logits_max_diff"] < 1e-5


def test_export_command(results, tmp_path):
    """The README's export command on the 4-rank checkpoint: a directory transformers loads."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import run_launch

    ckpt = Path(results[1]["checkpoint"])
    out = run_launch("export", str(ckpt), "--out", str(tmp_path / "hf"), "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.num_hidden_layers == 2 and next(model.parameters()).dtype.is_floating_point
    bad = run_launch("export", str(tmp_path), "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "is not a complete checkpoint" in bad.stderr

"""Colocated rollout under torchrun (2 ranks, gloo, FSDP actor sharded over both): the weight
sync is proven by decoding. After syncing, each engine's greedy outputs equal plain transformers
greedy decoding of the same weights, and its sampled tokens' log-probs equal the actor's to 1e-4
(measured ~1e-6 in fp32), before and after a PPO update changed the weights."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, require

pytestmark = pytest.mark.slow
SCRIPT = REPO / "tests" / "dist_rollout_checks.py"


def run_engine(name: str, tmp_path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(SCRIPT),
            name,
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((tmp_path / f"{name}.json").read_text())


@pytest.fixture(scope="module", params=["hf", "vllm"])
def ranks(request, tmp_path_factory):
    if request.param == "vllm":
        require("vLLM", importlib.util.find_spec("vllm") is not None, "install the cpu profile (env/setup.sh cpu)")
    return run_engine(request.param, tmp_path_factory.mktemp(request.param))


def test_greedy_matches_transformers_and_logprobs_match_the_actor(ranks):
    assert len(ranks) == 2
    for r in ranks:
        for tag in ("initial", "after_update"):
            phase = r[tag]
            assert all(phase["greedy_equal"]), (r["rank"], tag, phase)
            assert phase["mismatch"]["rollout/logprob_diff_max"] < 1e-4, (r["rank"], tag, phase["mismatch"])
            assert phase["n_per_prompt"] == [2, 2, 2, 2]
            assert all(0 < n <= 8 for n in phase["sampled_lengths"])
        assert r["outputs_changed"], "the PPO update did not change the greedy outputs: the check proves nothing"


def test_ranks_generate_for_their_own_prompts(ranks):
    assert ranks[0]["initial"]["greedy"] != ranks[1]["initial"]["greedy"]


def test_bucket_size_does_not_change_the_weights(ranks):
    for r in ranks:
        assert r["buckets_identical"]
        assert r["engine_same_after_small_and_large_bucket"]
        assert r["cast_dtype"] == "torch.bfloat16"


def test_bad_mapping_fails_loudly_naming_the_parameter(ranks):
    for r in ranks:
        assert r["errors"]["bad_name"] == (
            "ValueError: weight sync: the engine has no parameter 'bogus.model.embed_tokens.weight' "
            "(closest engine parameter: 'model.embed_tokens.weight'); check the name mapping"
        )
        assert r["errors"]["bad_shape"] == (
            "ValueError: weight sync: parameter 'model.layers.0.self_attn.k_proj.weight' has shape (128, 128) "
            "but the engine expects (64, 128)"
        )


def test_vllm_under_the_external_launcher_uses_nccls_all_reduce(ranks):
    """disable_custom_all_reduce: vLLM's own all-reduce has crashed with TP + sleep mode under the
    external launcher (verl sets the same); the hf engine has no such setting."""
    want = [True, True] if ranks[0]["engine"] == "vllm" else [None, None]
    assert [r.get("disable_custom_all_reduce") for r in ranks] == want

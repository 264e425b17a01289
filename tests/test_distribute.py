"""How a step is spread over ranks (rlhf_hpc.distributed.rows): no prompt dropped, equal rows per rank,
token-balanced assignment, group statistics across ranks, and the update independent of where
rows sit. One 4-rank torchrun (tests/dist_distribute_checks.py) plus single-process checks.

Tolerances (fp32): advantages 1e-6 (float64 group sums vs float32 per-group mean/std), gradients
after one mini-batch 1e-6 absolute (they are ~1e-1; summation order is all that differs).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

from rlhf_hpc.distributed.rows import balance_ratio, balanced_partitions, contiguous_partitions, prompt_share
from tests.conftest import REPO

SCRIPT = REPO / "tests" / "dist_distribute_checks.py"


@pytest.mark.parametrize("prompts,world", [(6, 4), (4, 8), (12, 8), (1, 2), (16, 2), (7, 3)])
def test_prompt_shares_cover_every_prompt_once_and_differ_by_at_most_one(prompts, world):
    shares = [list(prompt_share(prompts, world, r)) for r in range(world)]
    assert sorted(itertools.chain(*shares)) == list(range(prompts))
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1
    assert all(s == list(range(s[0], s[0] + len(s))) for s in shares if s)  # contiguous


def _best_spread(weights, k):
    """Exhaustive: the smallest max-min of k equal-size sets (small inputs only)."""
    n, per, best = len(weights), len(weights) // k, None

    def assign(i, sets):
        nonlocal best
        if i == n:
            sums = [sum(weights[j] for j in s) for s in sets]
            best = min(best, max(sums) - min(sums)) if best is not None else max(sums) - min(sums)
            return
        for s in sets:
            if len(s) < per:
                s.append(i)
                assign(i + 1, sets)
                s.pop()
                if not s:
                    break  # empty sets are interchangeable

    assign(0, [[] for _ in range(k)])
    return best


@pytest.mark.parametrize("seed", range(6))
def test_balanced_partitions_are_equal_sized_and_near_optimal(seed):
    import random

    rng = random.Random(seed)
    weights = [rng.randint(5, 300) for _ in range(8)]
    parts = balanced_partitions(weights, 2)
    assert sorted(itertools.chain(*parts)) == list(range(8)) and [len(p) for p in parts] == [4, 4]
    sums = [sum(weights[i] for i in p) for p in parts]
    # the differencing method is a heuristic: within the largest weight of the optimum
    assert max(sums) - min(sums) <= _best_spread(weights, 2) + max(weights)
    assert balance_ratio(weights, parts) <= balance_ratio(weights, contiguous_partitions(8, 2)) + 1e-12
    assert balanced_partitions(weights, 2) == parts  # deterministic


def test_balanced_partitions_even_out_a_skewed_batch():
    # sorted lengths: contiguous blocks put all long rows on one rank
    weights = list(range(10, 330, 10))  # 32 rows
    parts = balanced_partitions(weights, 4)
    assert [len(p) for p in parts] == [8] * 4
    assert balance_ratio(weights, contiguous_partitions(32, 4)) > 1.5
    assert balance_ratio(weights, parts) < 1.01


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("distribute")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", str(SCRIPT), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "distribute.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["contiguous", "balanced"])
def test_every_response_of_a_non_divisible_step_is_trained_once(checks, mode):
    assert checks["generated_per_rank"] == [4, 4, 2, 2]  # 6 prompts x 2 on 4 ranks: shares 2, 2, 1, 1
    got = checks[mode]
    assert got["rows_per_rank"] == [3, 3, 3, 3]
    trained = sorted(row for part in got["rows"] for row in part)
    assert trained == [[pos, toks] for pos, toks in checks["all_rows"]]  # all 12, none twice
    assert got["coverage"] == {"training/prompts_trained": 6.0, "training/responses_trained": 12.0}
    tokens = got["tokens_per_rank"]
    assert got["metrics"]["perf/balance_ratio"] == pytest.approx(max(tokens) / (sum(tokens) / 4))
    assert got["metrics"]["global_seqlen/max"] == max(tokens) and got["metrics"]["global_seqlen/min"] == min(tokens)


@pytest.mark.slow
def test_balance_batch_evens_out_tokens(checks):
    b, c = checks["balanced"]["metrics"], checks["contiguous"]["metrics"]
    assert b["perf/balance_ratio_unbalanced"] == c["perf/balance_ratio"]
    assert b["perf/balance_ratio"] < c["perf/balance_ratio"]


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "rpp_baseline"])
def test_group_advantages_with_groups_split_over_ranks_equal_one_process(checks, estimator):
    assert checks["groups_split_over_ranks"]  # some prompt's responses do sit on two ranks
    assert checks["adv_nonzero"][estimator] > 0
    assert checks["adv_max_diff"][estimator] < 1e-6


@pytest.mark.slow
def test_balanced_and_contiguous_assignments_give_the_same_update(checks):
    assert checks["update_grad_max"] > 1e-3
    assert checks["update_grad_max_diff"] < 1e-6
    for k, v in checks["update_metric_diff"].items():
        assert v < 1e-6, k

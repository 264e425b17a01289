"""Every command of README.md and docs/ is real. Its test command is .ci/run's; the dry runs run as
written; a run, a preflight or a plan runs as its dry run (what it would start, validated and
planned); a data preparation writes its files (into a temporary home). What a dry run cannot show (a
job's status, a comparison of two runs, an export, the real model's preparation, the GPU check)
runs in the test named for it in ELSEWHERE, at its smallest size."""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_hpc.data.prepare import main as prepare
from tests.conftest import REPO, SHARED, launch_here, require

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEST_COMMAND = "bash env/setup.sh cpu && .venv/bin/python -m pytest"
CI = (REPO / ".ci" / "run").read_text()

# a command's start -> the test that runs it (file, function), for what needs a run, a job or a GPU
ELSEWHERE = {
    "launch.py status": ("tests/test_slurm.py", "test_submitted_job_completes"),
    "launch.py logs": ("tests/test_slurm.py", "test_submitted_job_completes"),
    "launch.py compare": ("tests/test_compare.py", "test_compare_command_prints_the_table"),
    "MLFLOW_TRACKING_URI=": ("tests/test_profiling.py", "test_compare_reads_mlflow_only_runs"),
    "launch.py export": ("tests/test_engine_dist.py", "test_export_command"),
    "launch.py gpu-check": ("tests/test_gpu_check.py", "test_smoke_runs_every_case_without_optional_packages"),
    "launch.py calibrate": ("tests/test_time_plan.py", "test_the_calibration_bench_writes_what_the_plan_reads"),
    "-m rlhf_hpc.models.real_model": (
        "tests/test_real_model.py",
        "test_the_prepared_checkpoint_is_a_tied_chatml_llama",
    ),
    "-m rlhf_hpc.data.tool_warm_start": (
        "tests/test_multi_turn.py",
        "test_rl_teaches_the_model_to_call_the_tool_whose_answer_it_needs",
    ),
    "-m rlhf_hpc.tools.retrieval_server": (
        "tests/test_search_tool.py",
        "test_a_local_index_and_the_retrieval_service_answer_alike_in_verls_text",
    ),
}
# recipes whose dry run reads the real model's files (prepared by the smollm fixture)
REAL_MODEL_RECIPES = ("smollm2_add_",)


def page_commands(page: Path) -> list[str]:
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        block = block.replace("\\\n", " ")
        lines += [ln.split(" #")[0].strip() for ln in block.splitlines() if not ln.strip().startswith("#")]
    return [re.sub(r"\s+", " ", ln) for ln in lines if ln]


def all_commands() -> list[tuple[str, str]]:
    return [(str(page.relative_to(REPO)), cmd) for page in PAGES for cmd in page_commands(page)]


def kind(cmd: str) -> str:
    """ci (what .ci/run runs), elsewhere (ELSEWHERE's test), prepare, or launch (run here)."""
    if cmd in (TEST_COMMAND, "bash env/setup.sh cpu") or cmd.startswith("bash slurm/dev-cluster.sh up"):
        return "ci"
    if any(key in cmd for key in ELSEWHERE):
        return "elsewhere"
    if "-m rlhf_hpc.data.prepare " in cmd:
        return "prepare"
    assert "launch.py" in cmd, f"a command no test runs: {cmd} (give it a test, or a line in ELSEWHERE)"
    return "launch"


def as_dry_run(cmd: str) -> list[str]:
    """The launch.py arguments of ``cmd``, a dry run where it would start something."""
    args = shlex.split(cmd.split("launch.py", 1)[1].replace("<site>", "example-gpu"))
    if args and args[0] in ("plan", "--help"):
        return args
    if "--dry-run" not in args:
        args.append("--dry-run")
    return args  # a Slurm dry run prints the sbatch script and asks no Slurm (test_slurm.py submits)


def test_ci_runs_the_readme_test_command():
    assert TEST_COMMAND in page_commands(REPO / "README.md")
    assert TEST_COMMAND in CI.splitlines()
    assert "bash slurm/dev-cluster.sh up --nodes 4" in CI  # the docs' Slurm commands need it
    assert re.search(r"^\.venv/bin/ruff check \.$", CI, flags=re.M)  # ... and the formatter before the tests


def test_every_command_of_the_docs_has_a_test():
    commands = all_commands()
    assert len(commands) >= 40 and {page for page, _ in commands} >= {"README.md", "docs/slurm.md"}
    kinds = {cmd: kind(cmd) for _, cmd in commands}  # a command none runs fails here, naming it
    assert sum(k == "launch" for k in kinds.values()) >= 15
    for key, where in ELSEWHERE.items():
        assert any(key in cmd for _, cmd in commands), f"ELSEWHERE names {key!r}, which no page has any longer"
        path, name = where
        tree = ast.parse((REPO / path).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in defined, f"{path}::{name} is gone: ELSEWHERE must name the test that runs {key!r}"
        source = (REPO / path).read_text()
        what = key.split()[-1].rstrip("=")
        assert what in source or what.split(".")[-1] in source, f"{path}::{name} does not run {key!r}"


def launch_commands(real_model: bool) -> list[str]:
    return [
        cmd
        for _, cmd in all_commands()
        if kind(cmd) == "launch" and any(r in cmd for r in REAL_MODEL_RECIPES) == real_model
    ]


def search_r1_source(src: Path) -> None:
    """Search-R1's records as the hub holds them (``PeterJinGo/nq_hotpotqa_train``), a few rows."""
    rows = [("capital of france?", "Paris", "nq"), ("highest mountain?", "Mount Everest", "hotpotqa")]
    src.mkdir(parents=True)
    for split in ("train", "test"):
        records = [
            {
                "id": f"{split}_{i}",
                "question": q,
                "golden_answers": [a],
                "data_source": source,
                "ability": "fact-reasoning",
                "reward_model": {"style": "rule", "ground_truth": {"target": [a]}},
                "metadata": None,
            }
            for i, (q, a, source) in enumerate(rows * 256)  # one batch of 512
        ]
        pq.write_table(pa.Table.from_pylist(records), src / f"{split}.parquet")


def run_page_commands(commands: list[str], home: Path, monkeypatch) -> None:
    """The commands in order, ``~`` being ``home``: each preparation writes the files a later dry run
    reads, as a user following the page would (Search-R1's download is a few made-up rows)."""
    monkeypatch.setenv("HOME", str(home))
    if any("--src ~/nq_hotpotqa_train" in cmd for cmd in commands):
        search_r1_source(home / "nq_hotpotqa_train")
    for cmd in commands:
        if kind(cmd) == "prepare":
            args = shlex.split(cmd.split("-m rlhf_hpc.data.prepare", 1)[1])
            args = [str(Path(a).expanduser()) if a.startswith("~") else a for a in args]
            with monkeypatch.context() as m:
                m.chdir(REPO)
                assert prepare(args) == 0, cmd
            out = Path(args[args.index("--out") + 1])
            assert sorted(p.name for p in out.glob("*.parquet")) == ["test.parquet", "train.parquet"], cmd
        elif kind(cmd) == "launch":
            proc = launch_here(*as_dry_run(cmd))
            assert proc.returncode == 0, f"{cmd}\n{proc.stderr}"
            assert proc.stdout.strip(), cmd


@pytest.mark.slow
def test_each_pages_commands_run_in_order_as_dry_runs(tmp_path, monkeypatch):
    require("../shared", SHARED.is_dir(), f"{SHARED} is missing (the GSM8K preparations read it)")
    for page in PAGES:
        commands = [c for c in page_commands(page) if kind(c) in ("prepare", "launch")]
        commands = [c for c in commands if not any(r in c for r in REAL_MODEL_RECIPES)]
        run_page_commands(commands, tmp_path / page.stem, monkeypatch)
    assert len(launch_commands(real_model=False)) >= 12


@pytest.mark.slow
def test_the_real_model_recipes_dry_run(smollm, tmp_path, monkeypatch):
    """The quick start's SmolLM2 recipes: their dry runs read the prepared model's files."""
    commands = launch_commands(real_model=True)
    assert len(commands) >= 4
    run_page_commands(commands, Path.home(), monkeypatch)


def test_every_module_benchmarks_md_runs_exists():
    """BENCHMARKS.md's commands name modules (``python -m benchmarks.NAME``, ``-m rlhf_hpc...``) and
    launch.py commands that exist: the scripts moved out of the package still run from the checkout."""
    import importlib.util

    text = (REPO / "BENCHMARKS.md").read_text()
    modules = sorted(set(re.findall(r"python3? -m ((?:benchmarks|rlhf_hpc)(?:\.\w+)+)", text)))
    assert len(modules) >= 10 and any(m.startswith("benchmarks.") for m in modules)
    assert [m for m in modules if importlib.util.find_spec(m) is None] == []
    commands = set(re.findall(r"launch\.py (calibrate|gpu-check|plan|compare|export|preflight)\b", text))
    for command in commands:  # each answers --help in-process (argparse exits 0)
        assert launch_here(command, "--help").returncode == 0, command

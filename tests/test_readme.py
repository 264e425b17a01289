"""The README's commands are real: its test command is .ci/run's, its dry runs run here."""

from __future__ import annotations

import re
import shlex

from tests.conftest import REPO, run_launch

README = (REPO / "README.md").read_text()


def bash_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = []
    for block in blocks:
        block = block.replace("\\\n", " ")
        lines += [ln.split("#")[0].strip() for ln in block.splitlines() if ln.split("#")[0].strip()]
    return lines


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    test_cmd = "bash env/setup.sh cpu && .venv/bin/python -m pytest"
    assert test_cmd in bash_commands()
    assert test_cmd in ci.splitlines()


def test_readme_dry_runs_succeed():
    dry = [c for c in bash_commands() if "launch.py" in c and "--dry-run" in c]
    assert len(dry) >= 2
    for cmd in dry:
        args = shlex.split(cmd)
        out = run_launch(*args[args.index("launch.py") + 1 :], "cluster=local")
        assert out.returncode == 0, f"{cmd}\n{out.stderr}"

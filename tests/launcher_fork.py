"""``launch.py`` for the tests, forked from a server that has imported the launcher once.

A launcher process spends ~3.5 CPU-s importing torch, transformers and the package and building its
first model config before it validates anything: paid once per test worker here instead of once per
launch (about a hundred in the full suite). Each launch is still its own process: forked from the
server (multiprocessing's forkserver, whose one preloaded module is ``tests.launcher_preload``), with
the test's working directory, environment and argument list, its standard output and error in files
read back as ``subprocess.run(capture_output=True)`` would give them, and its exit code. What it
starts (torchrun and the ranks, Slurm jobs) is started exactly as from ``python launch.py``.

What differs from a fresh interpreter is only what the imports did: the environment variables they
set (``tracking``'s WANDB_SILENT, ``trainer``'s TOKENIZERS_PARALLELISM) are given again to each
launch whose environment lacks them, as a fresh import would set them; values the imports read from
the environment are the server's. ``run_launch(..., fresh=True)`` runs ``python launch.py`` itself.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["tests.launcher_preload"])
    return _CONTEXT


def _launch_child(script: str, args: list[str], cwd: str, env: dict, out_path: str, err_path: str) -> None:
    """In the forked process: become ``python SCRIPT ARGS`` and exit with its code."""
    from tests import launcher_preload

    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update({**launcher_preload.SET_BY_IMPORTS, **env})
    sys.argv = [script, *args]  # (the resume command a failed run prints is this process's own)
    code = 1
    try:
        from rlhf_hpc.cli import main

        code = main(list(args))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # what the interpreter would print before exiting with 1
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        atexit._run_exitfuncs()  # (multiprocessing's children skip them; the interpreter would not)
        sys.stdout.flush()
        sys.stderr.flush()
        used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        Path(out_path).with_name("cpu").write_text(str(sum(u.ru_utime + u.ru_stime for u in used)))
        os._exit(code if isinstance(code, int) else 1)


def launch_in_fork(script: Path, args: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([python, script, *args], cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)`` for ``script`` = launch.py, forked from the preloaded server."""
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        start = time.monotonic()
        out_path, err_path = f"{tmp}/stdout", f"{tmp}/stderr"
        Path(out_path).touch()
        Path(err_path).touch()
        proc = _context().Process(
            target=_launch_child, args=(str(script), list(args), str(cwd), dict(env), out_path, err_path)
        )
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([str(script), *args], timeout, Path(out_path).read_text())
        done = subprocess.CompletedProcess(  # (an exit code -N: killed by signal N, as Popen says)
            [sys.executable, str(script), *args],
            proc.exitcode,
            Path(out_path).read_text(errors="replace"),
            Path(err_path).read_text(errors="replace"),
        )
        if os.environ.get(LAUNCH_LOG):
            cpu = Path(tmp, "cpu")
            log_launch(args, time.monotonic() - start, float(cpu.read_text()) if cpu.is_file() else None, done)
        return done


LAUNCH_LOG = "RLHF_HPC_LAUNCH_LOG"  # a file each forked launch adds a line to (benchmarks/suite_timeline.py)


def log_launch(args: list[str], wall: float, cpu: float | None, done: subprocess.CompletedProcess) -> None:
    """One JSON line: the test, the arguments, the launch's wall and CPU seconds (itself, torchrun and
    the ranks; not a Slurm job's) and whether its memory plan has a vLLM engine."""
    row = dict(test=os.environ.get("PYTEST_CURRENT_TEST", ""), args=args, wall=round(wall, 1), code=done.returncode)
    row.update(cpu=None if cpu is None else round(cpu, 1), vllm="vLLM (weights" in done.stdout)
    with open(os.environ[LAUNCH_LOG], "a") as f:
        f.write(json.dumps(row) + "\n")

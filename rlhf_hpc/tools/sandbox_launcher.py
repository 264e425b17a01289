"""The first process inside the sandbox: copies the program's files into the working directory, sets
the limits, drops to an unprivileged uid where it starts as root, and becomes the program (exec).

Run as ``python -I -S sandbox_launcher.py SPEC`` (no site, no environment: only the standard
library), SPEC a JSON object: ``stage`` (a read-only directory holding the files, or null),
``workdir``, ``argv`` (the program's command), ``limits`` (resource name -> value), ``uid`` (or
null). Stands alone: it imports nothing of the package, since inside the sandbox there is none.
A failure before the program starts exits with LAUNCH_FAILED and a line naming this launcher.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import sys

__all__ = ["LAUNCH_FAILED", "apply_limits", "copy_files", "main"]

LAUNCH_FAILED = 125  # as env(1) and docker do for "the command could not be started"


def apply_limits(limits: dict[str, int]) -> None:
    """Soft = hard for each ``RLIMIT_<NAME>``, so the program cannot raise them again; CPU gets one
    second between SIGXCPU and SIGKILL."""
    for name, value in limits.items():
        hard = value + 1 if name == "cpu" else value
        resource.setrlimit(getattr(resource, f"RLIMIT_{name.upper()}"), (value, hard))


def copy_files(stage: str) -> None:
    """The stage's files into the working directory, writable by everyone: the program may run
    under another uid than the one copying them, and may change its own files."""
    old = os.umask(0)
    try:
        for root, _, names in os.walk(stage):
            here = os.path.relpath(root, stage)
            os.makedirs(here, mode=0o777, exist_ok=True)
            for name in names:
                fd = os.open(os.path.join(here, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                with open(os.path.join(root, name), "rb") as src, open(fd, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    finally:
        os.umask(old)


def main(argv: list[str]) -> int:
    try:
        spec = json.loads(argv[1])
        os.makedirs(spec["workdir"], exist_ok=True)
        os.chdir(spec["workdir"])
        if spec["stage"]:
            copy_files(spec["stage"])
        apply_limits(spec["limits"])  # as root still: lowering needs no privilege
        if spec["uid"] is not None:
            # a fresh uid owns nothing on the host, and its process count starts at zero, so
            # RLIMIT_NPROC holds (root's never does)
            os.setgroups([])
            os.setgid(spec["uid"])
            os.setuid(spec["uid"])
        os.execv(spec["argv"][0], spec["argv"])
    except Exception as e:  # anything before exec is the sandbox's failure, not the program's
        sys.stderr.write(f"sandbox launcher: {type(e).__name__}: {e}\n")
        return LAUNCH_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv))

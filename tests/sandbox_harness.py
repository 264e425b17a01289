"""Run one program in the bwrap sandbox and print the result as JSON: the process a test puts in a
cgroup of its own to measure what a program held from outside (tests/test_sandbox_memory.py).

``python tests/sandbox_harness.py SPEC``, SPEC a JSON object: ``mode`` (privileged, userns), ``cfg``
(SandboxConfig fields), ``program``. Waits for a line on stdin first: the test moves this process
into its measuring cgroup, then says go (the sandbox finds its cgroup parent from this process's own).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from rlhf_hpc.config.sandbox_schema import SandboxConfig
from rlhf_hpc.tools.backends import SANDBOX_BACKENDS
from rlhf_hpc.tools.sandbox import describe, run_with


def main() -> None:
    spec = json.loads(sys.argv[1])
    sys.stdin.readline()
    cfg = SandboxConfig(**spec["cfg"])
    backend = SANDBOX_BACKENDS["bwrap"]
    line = describe(cfg, backend, spec["mode"])
    result = run_with(backend, spec["mode"], cfg, spec["program"], b"")
    print(json.dumps({"line": line, **asdict(result)}), flush=True)


if __name__ == "__main__":
    main()

"""Code answers, verl's code-scoring format: the response's program run against the row's test cases.

``reward_model.ground_truth`` is JSON (verl's prime_code / sandbox_fusion): ``{"inputs": [...],
"outputs": [...]}``, each input a program's stdin and each output its expected stdout; with
``"fn_name"``, each input is the function's arguments, one JSON value a line, and each output its
JSON return value (a function of that name, or a method of ``class Solution``). The program is the
response's last python code block (as prime_code extracts it). Every case runs in the sandbox
(rlhf_hpc/tools) under ``sandbox``'s limits, or on the user's SandboxFusion service; the score is
verl's continuous one: the share of the first MAX_CASES cases passed (all passed: 1.0). A program
that hangs, crashes or breaks a limit fails its case; the run goes on.
"""

from __future__ import annotations

import ast
import json
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlhf_hpc.config.sandbox_schema import SandboxConfig, SandboxFusionConfig
from rlhf_hpc.rewards.synthetic_scores import CODE_SOURCE
from rlhf_hpc.tools.code_runner import run_code

__all__ = [
    "CODE_SOURCES",
    "MAX_CASES",
    "code_score",
    "configure_code_reward",
    "extract_program",
    "function_program",
    "outputs_match",
    "parse_test_cases",
]

# verl 0.9.1's data_sources scored by running code (verl/utils/reward_score/__init__.py), and the
# built-in programming task (synthetic://code)
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco", CODE_SOURCE)
MAX_CASES = 10  # verl's continuous score counts the first 10 cases (some problems have thousands)

_settings_lock = threading.Lock()
_settings = {"sandbox": SandboxConfig(), "sandbox_fusion": SandboxFusionConfig()}


def configure_code_reward(sandbox: SandboxConfig, sandbox_fusion: SandboxFusionConfig) -> None:
    """The limits and the service the code reward runs with (the run's ``sandbox`` and
    ``reward_model.sandbox_fusion``); until called, the defaults and the sandbox on this node."""
    with _settings_lock:
        _settings.update(sandbox=sandbox, sandbox_fusion=sandbox_fusion)


def extract_program(response: str) -> str:
    """The code after the last ```python fence up to the next fence; without one, the text up to the
    first fence (prime_code's rule: a bare program is taken as it is)."""
    return response.split("```python")[-1].split("```")[0]


def parse_test_cases(ground_truth: Any) -> dict:
    """The test cases of a row: a dict, its JSON, or its Python literal (a dict passed through str())."""
    if isinstance(ground_truth, dict):
        return ground_truth
    try:
        cases = json.loads(ground_truth)
    except ValueError:
        cases = ast.literal_eval(ground_truth)  # a dict that went through str(): single quotes
    if (
        not isinstance(cases, dict)
        or not {"inputs", "outputs"} <= set(cases)
        or len(cases["inputs"]) != len(cases["outputs"])
    ):
        raise ValueError(
            'expected test cases {"inputs": [...], "outputs": [...]} of equal length '
            f"(verl's code format), got {str(ground_truth)[:200]!r}"
        )
    return cases


# call-based problems (LeetCode style) use these names without importing them
PRELUDE = (
    "from typing import *\nfrom collections import *\nfrom itertools import *\nfrom functools import *\n"
    "from heapq import *\nfrom bisect import *\nfrom math import *\nimport collections, itertools, functools, "
    "heapq, bisect, math, string, re, sys\n"
)


def function_program(source: str, fn_name: str) -> str:
    """A program that defines ``source``, calls ``fn_name`` (or ``Solution().fn_name``) with the
    arguments on stdin (one JSON value a line) and prints the result as JSON."""
    return (
        f"import json, sys\nSOURCE = {PRELUDE + source!r}\nNAME = {fn_name!r}\n"
        "space = {'__name__': '__solution__'}\n"
        "exec(compile(SOURCE, 'solution.py', 'exec'), space)\n"
        "target = space[NAME] if NAME in space else getattr(space['Solution'](), NAME)\n"
        "args = [json.loads(line) for line in sys.stdin.read().split('\\n') if line.strip()]\n"
        "print(json.dumps(target(*args)))\n"
    )


def outputs_match(actual: str, expected: str) -> bool:
    """stdout against the expected output as prime_code compares them: equal line by line up to
    surrounding whitespace, or token by token, numbers within a relative 1e-5."""
    lines = [line.strip() for line in actual.strip().splitlines()]
    if lines == [line.strip() for line in expected.strip().splitlines()]:
        return True
    got, want = actual.split(), expected.split()
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if a != b:
            try:
                if not math.isclose(float(a), float(b), rel_tol=1e-5, abs_tol=1e-8):
                    return False
            except ValueError:
                return False
    return True


def returns_match(stdout: str, expected: Any) -> bool:
    """A call's printed JSON against the expected return value (or its only element, as verl's
    outputs often wrap it in a list)."""
    try:
        got = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False
    if isinstance(expected, str):
        try:
            expected = json.loads(expected)
        except ValueError:
            pass  # a bare string return value
    return got == expected or (isinstance(expected, list) and len(expected) == 1 and got == expected[0])


def as_text(value: Any) -> str:
    """A case's stdin or expected stdout: a list is its lines (prime_code joins them)."""
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def code_score(response: str, ground_truth: str) -> float:
    """verl's continuous code score of ``response`` on the row's test cases (``ground_truth``)."""
    cases = parse_test_cases(ground_truth)
    with _settings_lock:
        sandbox, fusion = _settings["sandbox"], _settings["sandbox_fusion"]
    source, fn_name = extract_program(response), cases.get("fn_name")
    pairs = list(zip(cases["inputs"], cases["outputs"]))[:MAX_CASES]
    if not pairs:
        return 0.0
    program = function_program(source, fn_name) if fn_name else source

    def passes(pair) -> bool:
        stdin, expected = pair
        if fn_name:
            args = stdin if isinstance(stdin, str) else "\n".join(json.dumps(a) for a in stdin)
            result = run_code(program, args, sandbox, fusion)
            return result.ok and returns_match(result.stdout, expected)
        result = run_code(program, as_text(stdin), sandbox, fusion)
        return result.ok and outputs_match(result.stdout, as_text(expected))

    # the cases at once, as many as sandbox.max_parallel lets run (it bounds the whole process too)
    with ThreadPoolExecutor(max_workers=max(1, min(len(pairs), sandbox.max_parallel))) as pool:
        passed = sum(pool.map(passes, pairs))
    return passed / len(pairs)

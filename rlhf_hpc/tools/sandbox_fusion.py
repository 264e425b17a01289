"""The user's own SandboxFusion service (``reward_model.sandbox_fusion.url``, its run_code endpoint):
a program and its stdin POSTed as verl sends them, the reply read into a ``SandboxResult`` like a
local run's. Plain urllib: no client package."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Union

from rlhf_hpc.config.sandbox_schema import SandboxConfig, SandboxFusionConfig
from rlhf_hpc.tools.sandbox import SandboxResult, classify
from rlhf_hpc.tools.sandbox_metrics import SANDBOX_METRICS

__all__ = ["fusion_request", "fusion_result", "run_in_sandbox_fusion"]

RETRIES = 3  # verl's: a 504 (the gateway's timeout) is tried again, after 1 s, then 2 s
API_SLACK_S = 10  # verl's: the HTTP timeout is the compile and run timeouts plus this
HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}

_requests: dict[int, threading.BoundedSemaphore] = {}
_requests_lock = threading.Lock()


def fusion_request(program: str, stdin: str, cfg: SandboxConfig, fusion: SandboxFusionConfig) -> dict:
    """The body verl POSTs (verl/utils/reward_score/sandbox_fusion/utils.py: call_sandbox_api)."""
    timeout = max(1, int(-(-cfg.timeout_s // 1)))
    return {
        "compile_timeout": timeout,
        "run_timeout": timeout,
        "code": program,
        "stdin": stdin,
        "memory_limit_MB": fusion.memory_limit_mb,
        "language": "python",
        "files": {},
        "fetch_files": [],
    }


def fusion_result(reply: dict, seconds: float, cfg: SandboxConfig) -> SandboxResult:
    """A run_code reply as a SandboxResult: ``status`` Success / Failed / SandboxError, and a
    ``run_result`` with its own status (Finished, TimeLimitExceeded, Error), return_code, stdout, stderr."""
    reply = reply if isinstance(reply, dict) else {"status": None, "message": f"not a JSON object: {reply!r:.200}"}
    run = reply.get("run_result") or {}
    compiled = reply.get("compile_result") or {}
    limit = cfg.max_output_kb * 1024
    stdout, stderr = run.get("stdout") or "", run.get("stderr") or compiled.get("stderr") or ""
    rc = run.get("return_code")

    def result(status: str, error: str) -> SandboxResult:
        return SandboxResult(status, rc, stdout[:limit], stderr[:limit], seconds, "sandbox_fusion", error)

    if reply.get("status") not in ("Success", "Failed"):  # SandboxError: the service's own failure
        return result(
            "sandbox_error",
            f"SandboxError: SandboxFusion replied {reply.get('status')!r}: {reply.get('message', '')}".strip(),
        )
    if run.get("status") == "TimeLimitExceeded" or compiled.get("status") == "TimeLimitExceeded":
        return result(*classify(0, "", "timeout", cfg, translate_signals=False))
    if max(len(stdout), len(stderr)) > limit:
        return result(*classify(0, "", "output_limit", cfg, translate_signals=False))
    if reply["status"] == "Success" and run.get("status") == "Finished":
        return result("ok", "")
    # a non-zero exit, a compile error, or an error of the run without a code (Python: negative = signal)
    code = rc if isinstance(rc, int) and rc != 0 else 1
    return result(*classify(code, stderr, None, cfg, translate_signals=False))


def run_in_sandbox_fusion(
    program: str, stdin: Union[str, bytes], cfg: SandboxConfig, fusion: SandboxFusionConfig
) -> SandboxResult:
    """Run ``program`` on the service; at most ``max_concurrent`` requests at once in this process.
    A service that cannot be reached is a ``sandbox_error`` result, counted like any other."""
    text = stdin.decode(errors="replace") if isinstance(stdin, bytes) else stdin
    body = json.dumps(fusion_request(program, text, cfg, fusion)).encode()
    timeout = 2 * max(1, int(-(-cfg.timeout_s // 1))) + API_SLACK_S
    with _requests_lock:
        gate = _requests.setdefault(fusion.max_concurrent, threading.BoundedSemaphore(max(1, fusion.max_concurrent)))
    start = time.monotonic()
    error = ""
    with gate:
        for attempt in range(RETRIES):
            request = urllib.request.Request(fusion.url, data=body, method="POST", headers=HEADERS)
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    reply = json.loads(response.read())
                result = fusion_result(reply, time.monotonic() - start, cfg)
                break
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code} {e.reason}"
                if e.code == 504 and attempt < RETRIES - 1:
                    time.sleep(attempt + 1)
                    continue
            except (urllib.error.URLError, OSError, ValueError) as e:  # unreachable, timed out, not JSON
                error = f"{type(e).__name__}: {e}"
            result = SandboxResult(
                "sandbox_error",
                None,
                "",
                "",
                time.monotonic() - start,
                "sandbox_fusion",
                f"SandboxError: SandboxFusion at {fusion.url} failed: {error}",
            )
            break
    SANDBOX_METRICS.record(result.status, result.seconds)
    return result

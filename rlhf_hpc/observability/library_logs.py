"""The libraries' own warnings go to the run's log file, not the console.

vLLM, torch and their Python warnings print a dozen lines per rank before the first step on a CPU
run (thread binding, preloaded allocators, Triton missing, the global seed, deprecations inside
vLLM) that say nothing a user can act on. Each rank writes them to
``RUN_DIR/logs/libraries.rank<R>.log``; errors still reach the console. What stays on the console:
this project's own lines, transformers' warnings (a checkpoint that does not fit the model is one;
its progress bars are off), and every error.

Where the user chose how a library logs, that library is left alone: ``VLLM_CONFIGURE_LOGGING`` or
``VLLM_LOGGING_CONFIG_PATH`` set keeps vLLM's own set-up, and ``TORCH_CPP_LOG_LEVEL`` is the user's
when set (the launcher sets it to ERROR for CPU ranks only: torch's C++ warnings bypass Python and
cannot be routed to a file; on GPUs they stay, NCCL's among them).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Optional

__all__ = ["library_log_path", "route_library_logs"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET = ("vllm", "torch")  # libraries whose warnings move to the file


def library_log_path(run_dir: str | Path, rank: int | str) -> Path:
    return Path(run_dir) / "logs" / f"libraries.rank{rank}.log"


def _package_dir(name: str) -> Optional[str]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "")


class _Below(logging.Filter):
    """On a console handler: a record below ``level`` goes to ``file`` instead."""

    def __init__(self, level: int, file: logging.Handler):
        super().__init__()
        self.level, self.file = level, file

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.level:
            return True
        if record.levelno >= self.file.level:
            self.file.handle(record)
        return False


class _FromPackages(logging.Filter):
    """On ``py.warnings``: keep (True) a Python warning raised outside the given packages."""

    def __init__(self, dirs: list[str]):
        super().__init__()
        self.dirs = tuple(dirs)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.args[0] if isinstance(record.args, tuple) and record.args else record.getMessage()
        return not str(text).startswith(self.dirs)


def route_library_logs(run_dir: str | Path, rank: int) -> Path:
    """Send vLLM's and torch's log records below ERROR, and the Python warnings raised inside
    those packages, to this rank's library log. Call once per process, before vLLM is imported
    (its logging is configured at import). Returns the log file's path."""
    path = library_log_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    file = logging.FileHandler(path, encoding="utf-8")
    file.setLevel(logging.DEBUG)  # what reaches it is what each logger's level lets through
    file.setFormatter(logging.Formatter(FORMAT))

    if "VLLM_CONFIGURE_LOGGING" not in os.environ and "VLLM_LOGGING_CONFIG_PATH" not in os.environ:
        # vLLM applies no logging config of its own; its records stop at the "vllm" logger
        os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
        vllm_log = logging.getLogger("vllm")
        vllm_log.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
        console = logging.StreamHandler()
        console.setFormatter(logging.Formatter("vLLM %(levelname)s %(message)s"))
        console.addFilter(_Below(logging.ERROR, file))
        vllm_log.handlers = [console]
        vllm_log.propagate = False

    import torch  # noqa: F401  (torch's logging puts its console handler on "torch" at import)

    for handler in logging.getLogger("torch").handlers:
        if isinstance(handler, logging.StreamHandler) and not any(isinstance(f, _Below) for f in handler.filters):
            handler.addFilter(_Below(logging.ERROR, file))

    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights" bars: one per model per rank

    logging.captureWarnings(True)
    py_warnings = logging.getLogger("py.warnings")
    console = logging.StreamHandler()
    console.setFormatter(logging.Formatter("%(message)s"))
    console.addFilter(_FromPackages([d for d in map(_package_dir, QUIET) if d]))
    py_warnings.handlers = [file, console]
    py_warnings.propagate = False
    return path

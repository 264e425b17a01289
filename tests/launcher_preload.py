"""Imported once by ``tests.launcher_fork``'s server: the launcher's imports, and a dry run of the
tiny recipe for the ones it makes at its first config (transformers' configuration modules), so a
launch forked from it starts at its own validation. ``SET_BY_IMPORTS``: the environment variables
the imports set, given again to each launch (a fresh interpreter would set them)."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile

_before = dict(os.environ)

import rlhf_hpc.cli  # noqa: E402

with tempfile.TemporaryDirectory(prefix="launcher-preload-") as _tmp:
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rlhf_hpc.cli.main(["recipe=tiny_klppo", f"trainer.default_local_dir={_tmp}/run", "--dry-run"])
    except Exception:  # a launch forked from here then pays these imports itself, and shows what fails
        pass

SET_BY_IMPORTS = {k: v for k, v in os.environ.items() if k not in _before}

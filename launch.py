#!/usr/bin/env python3
"""rlhf-hpc launcher: ``python launch.py recipe=NAME [key=value ...] [--dry-run]`` (see --help)."""

import sys

from rlhf_hpc.cli import main

if __name__ == "__main__":
    sys.exit(main())

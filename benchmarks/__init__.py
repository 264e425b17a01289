"""The scripts behind BENCHMARKS.md, run from a source checkout (``python -m benchmarks.NAME``); not
part of the installed package. Each figure in BENCHMARKS.md names the command that made it."""

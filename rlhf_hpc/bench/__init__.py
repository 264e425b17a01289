"""Benchmark scripts; their output is recorded in BENCHMARKS.md with the command that made it."""

"""The configuration as data: the typed dataclasses (``schema``), the error type (``errors``), the
YAML tree and its operations (``tree``). Imports nothing else of the project."""

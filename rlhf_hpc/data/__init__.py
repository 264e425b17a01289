"""Prompt data: the reference parquet format, a task built in code, and dataset preparation."""

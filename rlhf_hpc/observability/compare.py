"""Compare runs without W&B: ``python launch.py compare RUN [RUN ...] [--metrics a,b] [--out DIR]``.

A RUN is a run directory, or ``mlflow:RUN_ID`` for a run that only an MLflow tracking server/store
holds (``MLFLOW_TRACKING_URI``, or ``--mlflow-uri``). Reads each run's ``metrics.jsonl`` (in step
order, the last record of a step that a resumed run logged twice) and ``config.yaml``; a run
directory without ``metrics.jsonl`` but with an MLflow run (``mlflow_run_id``, ``mlruns/``) and an
``mlflow:`` run are read from MLflow instead (metric histories, the ``config.yaml`` artifact).
Writes ``compare.png`` (one panel per metric, one line per run,
x = global step, runs named by the config keys that differ between them) and a table of the last
and best value per run (printed, and saved as ``compare.md`` and ``compare.csv``). Works on runs
that are still going.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.tree import flatten, parse_yaml
from rlhf_hpc.observability.tracking import (
    MLFLOW_DIR,
    MLFLOW_ID_FILE,
    RUN_SPECIFIC,
    mlflow_metric_name,
    mlflow_tracking_uri,
    read_metrics,
)

__all__ = ["compare", "load_run", "main", "series"]

DEFAULT_METRICS = [
    "critic/score/mean",
    "actor/reward_kl_penalty",
    "response_length/mean",
    "actor/pg_clipfrac",
    "critic/vf_loss",
    "perf/throughput",
]
# a metric is "best" when high, unless it is one of these (lower is better)
LOWER_IS_BETTER = ("loss", "kl", "clipfrac", "time", "length", "memory")


@dataclass
class Run:
    path: Path
    config: dict  # flattened
    records: list[dict]


def load_run(path: str | Path, mlflow_uri: Optional[str] = None) -> Run:
    if str(path).startswith("mlflow:"):
        uri = mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise ConfigError(
                f"{path}: set MLFLOW_TRACKING_URI (or --mlflow-uri) to the tracking server/store that holds the run"
            )
        return load_mlflow_run(str(path)[len("mlflow:") :], uri)
    path = Path(path)
    if not (path / "metrics.jsonl").is_file() and (path / MLFLOW_ID_FILE).is_file():
        uri = (
            mlflow_tracking_uri(path)
            if (path / MLFLOW_DIR).is_dir()
            else mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        )
        if uri:
            run = load_mlflow_run((path / MLFLOW_ID_FILE).read_text().strip(), uri)
            return Run(path, run.config, run.records)
    if not (path / "config.yaml").is_file() or not (path / "metrics.jsonl").is_file():
        missing = [n for n in ("config.yaml", "metrics.jsonl") if not (path / n).is_file()]
        raise ConfigError(
            f"{path} is not a run directory (no {' or '.join(missing)}); give the trainer.default_local_dir of a run"
        )
    return Run(path, flatten(parse_yaml((path / "config.yaml").read_text()) or {}), read_metrics(path))


def load_mlflow_run(run_id: str, uri: str) -> Run:
    """A run read back from MLflow: records by step (metric names as MLflow stores them; the last
    value logged for a step wins, as in ``read_metrics``) and the config from its ``config.yaml``
    artifact (else its parameters)."""
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        raise ConfigError(f"mlflow:{run_id}: no such run at {uri} ({str(e).splitlines()[0]})") from None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config = parse_yaml(Path(client.download_artifacts(run_id, "config.yaml", tmp)).read_text()) or {}
        config = flatten(config)
    except (MlflowException, OSError):
        config = {k: _param(v) for k, v in run.data.params.items()}
    by_step: dict[int, dict] = {}
    for key in run.data.metrics:
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            by_step.setdefault(m.step, {"training/global_step": m.step})[key] = m.value
    return Run(Path(f"mlflow:{run_id}"), config, [by_step[s] for s in sorted(by_step)])


def _param(value: str):
    try:
        return json.loads(value)
    except ValueError:
        return value


def differing_keys(runs: list[Run]) -> list[str]:
    keys = sorted(set().union(*(r.config for r in runs)))
    return [k for k in keys if k not in RUN_SPECIFIC and len({repr(r.config.get(k)) for r in runs}) > 1]


def run_label(run: Run, keys: list[str]) -> str:
    if not keys:
        return run.path.name
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={run.config.get(k)}" for k in keys)


def series(run: Run, metric: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    stored = mlflow_metric_name(metric)  # runs read from MLflow hold its names
    for r in run.records:
        v = r.get(metric, r.get(stored))
        if isinstance(v, (int, float)):
            xs.append(int(r["training/global_step"]))
            ys.append(float(v))
    return xs, ys


def best(values: list[float], metric: str) -> Optional[float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    return min(finite) if any(w in metric for w in LOWER_IS_BETTER) else max(finite)


def compare(
    run_dirs: list[str | Path],
    metrics: Optional[list[str]] = None,
    out: Optional[str | Path] = None,
    mlflow_uri: Optional[str] = None,
):
    """Returns (figure, table rows, differing keys); writes compare.png/.md/.csv to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [load_run(d, mlflow_uri) for d in run_dirs]
    metrics = metrics or [m for m in DEFAULT_METRICS if any(series(r, m)[0] for r in runs)]
    absent = [m for m in metrics if not any(series(r, m)[0] for r in runs)]
    if absent:
        known = sorted({k for r in runs for rec in r.records for k in rec})
        import difflib

        hints = [
            f"{m}"
            + (
                f" (did you mean {difflib.get_close_matches(m, known, n=1)[0]}?)"
                if difflib.get_close_matches(m, known, n=1)
                else ""
            )
            for m in absent
        ]
        raise ConfigError(f"no run has the metric(s): {', '.join(hints)}")
    keys = differing_keys(runs)
    cols = min(3, len(metrics))
    rows_n = math.ceil(len(metrics) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.4 * rows_n), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for run in runs:
            xs, ys = series(run, metric)
            ax.plot(xs, ys, label=run_label(run, keys))
        ax.set_title(metric)
        ax.set_xlabel("global step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.remove()
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(runs), 3), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))

    table = []
    for run in runs:
        row = {
            "run": str(run.path),
            "differs": "; ".join(f"{k}={run.config.get(k)}" for k in keys),
            "steps": len(run.records),
        }
        for metric in metrics:
            _, ys = series(run, metric)
            row[f"{metric} last"] = ys[-1] if ys else None
            row[f"{metric} best"] = best(ys, metric)
        table.append(row)
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        fig.savefig(out / "compare.png", dpi=90)
        with open(out / "compare.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
        (out / "compare.md").write_text(markdown_table(table))
    return fig, table, keys


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def markdown_table(table: list[dict]) -> str:
    cols = list(table[0])
    lines = ["| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    lines += ["| " + " | ".join(_fmt(row[c]) for c in cols) + " |" for row in table]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python launch.py compare", description="Compare runs: plots and a table.")
    ap.add_argument("runs", nargs="+", help="run directories (trainer.default_local_dir) or mlflow:RUN_ID")
    ap.add_argument("--metrics", default=None, help=f"comma-separated (default: {','.join(DEFAULT_METRICS)})")
    ap.add_argument("--out", default="compare", help="output directory (default: ./compare)")
    ap.add_argument("--mlflow-uri", default=None, help="tracking URI for mlflow:RUN_ID (default: MLFLOW_TRACKING_URI)")
    args = ap.parse_args(argv)
    metrics = [m.strip() for m in args.metrics.split(",")] if args.metrics else None
    _, table, keys = compare(args.runs, metrics, args.out, args.mlflow_uri)
    print(markdown_table(table))
    print(f"config keys that differ: {', '.join(keys) or 'none'}")
    print(f"[rlhf-hpc] wrote {Path(args.out) / 'compare.png'}, compare.md, compare.csv")
    return 0

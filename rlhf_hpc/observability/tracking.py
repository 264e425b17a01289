"""Where metrics go: ``metrics.jsonl`` in the run directory (always), one console line per step, and
optionally TensorBoard, Weights & Biases and MLflow (``trainer.logger``). Only rank 0 writes.

MLflow: the tracking URI is ``MLFLOW_TRACKING_URI`` when set (a group's server), else a file store in
``<run dir>/mlruns`` (no server needed on compute nodes; MLflow >= 3.7 keeps its file store behind
``MLFLOW_ALLOW_FILE_STORE=true``, which is set for it). Experiment = ``trainer.project_name``, run
name = ``trainer.experiment_name``; parameters = the flat resolved config (values as JSON, strings
as they are); tags = W&B's (recipe, profile, git, config hash, group); the resolved ``config.yaml``
as an artifact; metrics per step
under W&B's names passed through ``mlflow_metric_name``. A resumed or requeued run continues the
same MLflow run (its id is in the checkpoint and in ``<run dir>/mlflow_run_id``).

Validation generations (``trainer.log_val_generations``): ``<run dir>/val_generations.jsonl``
(always; one JSON object per row, with its ``step``), and each backend's ``log_generations``: W&B
verl's table ``val/generations`` (a row per validation: step, input_1, output_1, score_1, ...),
TensorBoard verl's text ``val/generations``, MLflow verl's artifact ``val_step<step>.json``."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import time
import uuid
from pathlib import Path
from typing import Optional

from rlhf_hpc.config.trackers import TRACKERS, TrackerSpec
from rlhf_hpc.config.tree import flatten, to_dict

__all__ = [
    "ConsoleBackend",
    "MLFLOW_DIR",
    "MLFLOW_ID_FILE",
    "MLflowBackend",
    "RUN_SPECIFIC",
    "TensorBoardBackend",
    "Tracker",
    "VAL_GENERATIONS_FILE",
    "WandbBackend",
    "backend_class",
    "config_hash",
    "mlflow_metric_name",
    "mlflow_tracking_uri",
    "read_metrics",
    "wandb_mode",
    "wandb_sync_command",
]

WANDB_ID_FILE = "wandb_run_id"
GLOBAL_STEP, LOG_STEP = "training/global_step", "training/log_step"
MLFLOW_ID_FILE = "mlflow_run_id"
MLFLOW_DIR = "mlruns"
VAL_GENERATIONS_FILE = "val_generations.jsonl"
VAL_GENERATIONS_KEY = "val/generations"  # verl's name (ValidationGenerationsLogger)


def git_commit() -> Optional[str]:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


# keys that name or place a run rather than define the experiment (left out of the config hash)
RUN_SPECIFIC = ("trainer.default_local_dir", "trainer.experiment_name", "trainer.resume_mode", "trainer.val_only")


def config_hash(cfg) -> str:
    """Short hash of the resolved config, identical for runs that are the same experiment."""
    import hashlib

    flat = {k: v for k, v in flatten(to_dict(cfg)).items() if k not in RUN_SPECIFIC}
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:8]


def wandb_tags(cfg) -> list[str]:
    commit = git_commit()
    tags = [
        f"recipe:{cfg.trainer.recipe}" if cfg.trainer.recipe else None,
        f"profile:{cfg.launcher.cluster_profile}" if cfg.launcher.cluster_profile else None,
        f"git:{commit}" if commit else None,
        f"config:{config_hash(cfg)}",
    ]
    return [t for t in tags if t]


def _fmt_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Tracker:
    """Rank 0's metrics: every row into ``metrics.jsonl`` and to each backend ``trainer.logger``
    names (``rlhf_hpc.config.trackers.TRACKERS``: the backend classes below); other ranks write nothing.
    ``wandb_id`` / ``mlflow_id``: the runs a resumed run continues (kept in its checkpoints)."""

    def __init__(
        self,
        cfg,
        run_dir: str | Path,
        is_main: bool,
        total_steps: int,
        wandb_id: Optional[str] = None,
        mlflow_id: Optional[str] = None,
    ):
        self.cfg, self.run_dir, self.is_main, self.total = cfg, Path(run_dir), is_main, total_steps
        self.backends: list = []
        self._ids = {"wandb": wandb_id, "mlflow": mlflow_id}
        if not is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        # the loggers' x-axis step: one per logged row, across rollbacks (which repeat training
        # steps), resumes and requeues; W&B drops a row whose step is not larger than the last
        self.log_step = sum(1 for line in path.open() if line.strip()) if path.is_file() else 0
        self._jsonl = open(path, "a", buffering=1)
        for name in dict.fromkeys(cfg.trainer.logger):  # (in order, once each)
            backend = backend_class(TRACKERS[name])(self, self._ids.get(name))
            self.backends.append(backend)
            self.log_step = max(self.log_step, backend.first_step)

    @property
    def wandb_id(self) -> Optional[str]:
        return self._run_id("wandb")

    @property
    def mlflow_id(self) -> Optional[str]:
        return self._run_id("mlflow")

    def _run_id(self, name: str) -> Optional[str]:
        return next((b.run_id for b in self.backends if b.name == name), self._ids.get(name))

    def log(self, metrics: dict[str, float], step: int) -> None:
        """One row: ``training/global_step`` is ``step`` (it repeats after a rollback), and every
        logger's own step is ``training/log_step``, which only grows, so no row is dropped."""
        if not self.is_main:
            return
        self.log_step += 1
        record = {GLOBAL_STEP: step, LOG_STEP: self.log_step, **{k: _num(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        for backend in self.backends:
            backend.log(metrics, step, self.log_step)

    def log_generations(self, rows: list[dict], step: int) -> None:
        """Validation generations (``{"input", "output", "score", ...}`` each) of training step
        ``step``: appended to ``val_generations.jsonl`` with the step, then to each backend's
        ``log_generations(rows, step, log_step)`` where it has one. ``log_step`` is the row of the
        metrics logged next (the validation's own row), so W&B shows the table in that row."""
        if not self.is_main or not rows:
            return
        with open(self.run_dir / VAL_GENERATIONS_FILE, "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **{k: _num(v) for k, v in row.items()}}) + "\n")
        for backend in self.backends:
            log_generations = getattr(backend, "log_generations", None)  # (optional for a backend)
            if log_generations is not None:
                log_generations(rows, step, self.log_step + 1)

    def log_line(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)

    def close(self) -> None:
        if not self.is_main:
            return
        self._jsonl.close()
        for backend in self.backends:
            backend.close()


def backend_class(spec: TrackerSpec) -> type:
    module, _, cls = spec.entry.partition(":")
    return getattr(importlib.import_module(module), cls)


class ConsoleBackend:
    """One line per step: the headline metrics, validation scores, seconds per step and the ETA."""

    name, run_id, first_step = "console", None, 0

    def __init__(self, tracker: Tracker, run_id: Optional[str] = None):
        self.total = tracker.total
        self.path = tracker.run_dir / VAL_GENERATIONS_FILE

    def log(self, metrics: dict[str, float], step: int, log_step: int) -> None:
        print(self.progress_line(metrics, step), flush=True)

    def progress_line(self, m: dict, step: int) -> str:
        dt = m.get("timing_s/step", 0.0)
        eta = dt * max(0, self.total - step)
        parts = [f"step {step}/{self.total}"]
        for key, label in (
            ("critic/score/mean", "score"),
            ("actor/reward_kl_penalty", "kl"),
            ("actor/kl_loss", "kl_loss"),
            ("response_length/mean", "resp_len"),
            ("actor/pg_loss", "pg_loss"),
            ("critic/vf_loss", "vf_loss"),
            ("rollout/logprob_diff_max", "lp_diff"),
        ):
            if key in m:
                parts.append(f"{label} {m[key]:.4g}")
        # validation scores (val-core/<data_source>/reward/mean@n), by data source
        parts += [
            f"val {k[len('val-core/') :].rsplit('/reward/', 1)[0]} {v:.4g}"
            for k, v in sorted(m.items())
            if k.startswith("val-core/") and isinstance(v, (int, float))
        ]
        if "timing_s/step" in m:  # (a validation before training is no step)
            parts.append(f"{dt:.2f}s/step  ETA {_fmt_duration(eta)}")
        return " | ".join(parts)

    def log_generations(self, rows: list[dict], step: int, log_step: int) -> None:
        print(f"[rlhf-hpc] step {step}: {len(rows)} validation generations in {self.path}", flush=True)

    def close(self) -> None:
        pass


class TensorBoardBackend:
    """Scalars in ``<run dir>/tensorboard``, against the row counter (``training/log_step``)."""

    name, run_id, first_step = "tensorboard", None, 0

    def __init__(self, tracker: Tracker, run_id: Optional[str] = None):
        try:
            from torch.utils.tensorboard import SummaryWriter  # (optional package: only when asked for)
        except ImportError:
            raise RuntimeError(
                "trainer.logger has tensorboard but the tensorboard package is not installed "
                "(pip install tensorboard, or drop it from trainer.logger)"
            ) from None
        self.tb = SummaryWriter(log_dir=str(tracker.run_dir / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int, log_step: int) -> None:
        for k, v in {GLOBAL_STEP: step, **metrics}.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.tb.add_scalar(k, v, log_step)

    def log_generations(self, rows: list[dict], step: int, log_step: int) -> None:
        """verl's text: each sample's input, output and score in Markdown (against the row counter, as the scalars)."""
        text = f"**Generation Results - Step {step}**\n\n" + "".join(
            f"### Sample {i + 1}\n**Input:** {r['input']}\n\n**Output:** {r['output']}\n\n**Score:** {r['score']}\n\n"
            f"---\n\n"
            for i, r in enumerate(rows)
        )
        self.tb.add_text(VAL_GENERATIONS_KEY, text, log_step)
        self.tb.flush()

    def close(self) -> None:
        self.tb.close()


class WandbBackend:
    """A W&B run (offline where the service cannot be reached: ``wandb_mode``), resumed by id."""

    name = "wandb"

    def __init__(self, tracker: Tracker, run_id: Optional[str] = None):
        import wandb  # (optional package: only when asked for)

        run_dir, cfg = tracker.run_dir, tracker.cfg
        self.run_dir = run_dir
        id_file = run_dir / WANDB_ID_FILE
        if run_id is None and id_file.is_file():
            run_id = id_file.read_text().strip()
        self.run_id = run_id or uuid.uuid4().hex[:12]
        tr = cfg.trainer
        mode, why = wandb_mode(os.environ)
        if mode == "offline" and "WANDB_MODE" not in os.environ:
            tracker.log_line(
                f"[rlhf-hpc] W&B offline: {why}; the run is kept in {run_dir / 'wandb'} "
                f"(upload it later: {wandb_sync_command(run_dir)})"
            )
        self.offline = mode == "offline"
        self.run = wandb.init(
            project=tr.project_name,
            name=tr.experiment_name,
            id=self.run_id,
            resume="allow",
            group=tr.wandb_group or tr.recipe or tr.experiment_name,
            dir=str(run_dir),
            config=flatten(to_dict(cfg)),
            tags=wandb_tags(cfg),
            mode=mode,
        )
        # charts are drawn against the training step; W&B's own step is the row counter
        self.run.define_metric(GLOBAL_STEP)
        self.run.define_metric("*", step_metric=GLOBAL_STEP)
        self.first_step = int(getattr(self.run, "step", 0) or 0)
        id_file.write_text(self.run_id)
        self._gen_columns, self._gen_rows = None, []  # verl's validation-generations table (log_generations)

    def log(self, metrics: dict[str, float], step: int, log_step: int) -> None:
        # one row per call: W&B's step is the row counter, the charts' x-axis training/global_step
        # (defined as every metric's step metric at init)
        self.run.log({**metrics, GLOBAL_STEP: step}, step=log_step)

    def log_generations(self, rows: list[dict], step: int, log_step: int) -> None:
        """verl's table: one row per validation (step, input_1, output_1, score_1, ...), the table
        of all validations so far logged again each time (wandb issue 2981's workaround, as verl),
        into the row of the validation's metrics (``commit=False``: they follow in the same row)."""
        import wandb  # (imported by __init__ already)

        columns = ["step"] + [f"{c}_{i + 1}" for i in range(len(rows)) for c in ("input", "output", "score")]
        if self._gen_columns != columns:  # (a new table if the number of rows changes)
            self._gen_columns, self._gen_rows = columns, []
        self._gen_rows.append([step] + [v for r in rows for v in (r["input"], r["output"], r["score"])])
        table = wandb.Table(columns=columns, data=[list(r) for r in self._gen_rows])
        self.run.log({VAL_GENERATIONS_KEY: table}, step=log_step, commit=False)

    def close(self) -> None:
        self.run.finish()
        if self.offline:
            print(f"[rlhf-hpc] W&B ran offline; upload the run with: {wandb_sync_command(self.run_dir)}", flush=True)


class MLflowBackend:
    """An MLflow run (module docstring), continued by id."""

    name, first_step = "mlflow", 0

    def __init__(self, tracker: Tracker, run_id: Optional[str] = None):
        try:
            from mlflow import MlflowClient  # (optional package: only when asked for)
            from mlflow.entities import Param
            from mlflow.exceptions import MlflowException
        except ImportError:
            raise RuntimeError(
                "trainer.logger has mlflow but the mlflow package is not installed "
                "(pip install mlflow-skinny, or drop it from trainer.logger)"
            ) from None
        run_dir, cfg = tracker.run_dir, tracker.cfg
        id_file = run_dir / MLFLOW_ID_FILE
        if run_id is None and id_file.is_file():
            run_id = id_file.read_text().strip()
        uri = mlflow_tracking_uri(run_dir)
        self.client = MlflowClient(uri)
        tr = cfg.trainer
        if run_id is not None:
            # a resumed/requeued run continues the same MLflow run; its parameters stay those of the
            # launch that created it (MLflow parameters cannot change), tags and config.yaml follow this one
            try:
                self.client.update_run(run_id, status="RUNNING")
            except MlflowException as e:
                raise RuntimeError(
                    f"MLflow run {run_id} (this run's, from its checkpoint) is not in the "
                    f"tracking store {uri}: set MLFLOW_TRACKING_URI to the store the run started "
                    f"with ({str(e).splitlines()[0]})"
                ) from None
            for key, value in mlflow_tags(cfg).items():
                self.client.set_tag(run_id, key, value)
        else:
            exp = self.client.get_experiment_by_name(tr.project_name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(tr.project_name)
            run_id = self.client.create_run(exp_id, run_name=tr.experiment_name, tags=mlflow_tags(cfg)).info.run_id
            params = [Param(k, _param_value(v)) for k, v in flatten(to_dict(cfg)).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
                self.client.log_batch(run_id, params=params[i : i + 100])
        self.run_id = run_id
        id_file.write_text(run_id)
        if (run_dir / "config.yaml").is_file():
            self.client.log_artifact(run_id, str(run_dir / "config.yaml"))

    def log(self, metrics: dict[str, float], step: int, log_step: int) -> None:
        from mlflow.entities import Metric  # (optional package, imported by __init__ already)

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id,
            metrics=[
                Metric(mlflow_metric_name(k), float(v), now, step)
                for k, v in metrics.items()
                if isinstance(v, (int, float))
            ],
        )

    def log_generations(self, rows: list[dict], step: int, log_step: int) -> None:
        """verl's artifact: ``val_step<step>.json``, a list of {input, output, score}."""
        self.client.log_text(
            self.run_id,
            json.dumps([{k: r[k] for k in ("input", "output", "score")} for r in rows]),
            f"val_step{step}.json",
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


WANDB_REACH_TIMEOUT_S = 3.0


def wandb_mode(env) -> tuple[str, str]:
    """(W&B's mode, why): ``WANDB_MODE`` where it is set; else "offline" when there are no
    credentials (no ``WANDB_API_KEY``, no netrc entry for the W&B host) or the service does not
    answer within ``WANDB_REACH_TIMEOUT_S`` (a compute node without internet: ``wandb.init`` would
    fail or hang there); else "online"."""
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"], "WANDB_MODE is set"
    import netrc
    import socket
    from urllib.parse import urlparse

    url = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    host = url.hostname or "api.wandb.ai"
    has_key = bool(env.get("WANDB_API_KEY"))
    if not has_key:
        try:
            has_key = netrc.netrc(env.get("NETRC") or None).authenticators(host) is not None
        except (OSError, netrc.NetrcParseError):
            has_key = False
    if not has_key:
        return "offline", f"no W&B credentials here (WANDB_API_KEY, or a ~/.netrc entry for {host})"
    try:
        socket.create_connection(
            (host, url.port or (443 if url.scheme == "https" else 80)), timeout=WANDB_REACH_TIMEOUT_S
        ).close()
    except OSError as e:
        return "offline", f"{host} cannot be reached from here ({e.strerror or e})"
    return "online", "credentials found and the service answers"


def wandb_sync_command(run_dir: str | Path) -> str:
    return f"wandb sync {Path(run_dir).resolve() / 'wandb'}/offline-run-*"


def mlflow_tracking_uri(run_dir: str | Path) -> str:
    """``MLFLOW_TRACKING_URI``, else the file store ``<run dir>/mlruns``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (Path(run_dir).resolve() / MLFLOW_DIR).as_uri()


def mlflow_metric_name(name: str) -> str:
    """A metric name as MLflow stores it. MLflow accepts letters, digits, ``_ - . : /`` and space,
    and names that are normalised paths (no empty, ``.`` or ``..`` parts; at most 250 characters).
    Every other character becomes ``_`` and bad path parts are dropped (empty) or become ``_``:
    ``val-core/openai/gsm8k/reward/mean@1`` -> ``val-core/openai/gsm8k/reward/mean_1``,
    ``val-core/synthetic://copy/...`` -> ``val-core/synthetic:/copy/...``. Names made only of
    accepted characters (all of the loop's own) are unchanged."""
    name = re.sub(r"[^\w.\- :/]", "_", name)
    parts = ["_" if p in (".", "..") else p for p in name.split("/") if p]
    return "/".join(parts)[:250] or "_"


def mlflow_tags(cfg) -> dict[str, str]:
    """W&B's tags as MLflow tags (key: value), plus the W&B group."""
    tags = dict(t.split(":", 1) for t in wandb_tags(cfg))
    tr = cfg.trainer
    tags["group"] = tr.wandb_group or tr.recipe or tr.experiment_name
    return tags


def _param_value(v) -> str:
    """Parameter values are strings in MLflow (at most 6000 characters)."""
    return (v if isinstance(v, str) else json.dumps(v, default=str))[:6000]


def _num(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf: keep them visible as strings
    return v


def read_metrics(run_dir: str | Path) -> list[dict]:
    """Records of ``metrics.jsonl``, one per step in step order; when a step was logged again (a
    resumed run, or a rollback that repeated it), the later record wins: the step that was kept."""
    by_step: dict[int, dict] = {}
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[int(rec["training/global_step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


if os.environ.get("WANDB_SILENT") is None:
    os.environ["WANDB_SILENT"] = "true"
